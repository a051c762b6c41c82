"""``lens-evals verify MODEL``: the stream-contract self-check (``engine/frontend/self_check.py``) on the
user's own model, as vLLM loads it (dtype, quantization and engine arguments as given), printed as
a table: per checked layer, the prompt log-probs' move when the captured stream is written back
(identity), the capture against what the next layer reads (handoff), and the last layer's steering
against its control (steer). Then, where HF transformers can load the checkpoint, capture and
steering of every layer against HF (``verify_hf.py``; ``hf=False`` skips it). Exit status 1 when
either fails, 2 when the self-check could not run (``self_check=False``: the HF comparison alone,
on an engine that serves lens requests whatever its contract)."""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

from lens_evals.cli.checks import model_name_or_dir
from lens_evals.engine.frontend.offline import add_engine_arg_option, parse_engine_args

HELP = "check the stream contract on a model as vLLM loads it (the start-up self-check)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", type=model_name_or_dir, help="an embedded model's name or a model directory")
    parser.add_argument("--json", action="store_true", help="the numbers as JSON")
    parser.add_argument("--no-hf", action="store_true", help="the self-check only, no comparison with HF transformers")
    parser.add_argument(
        "--no-self-check",
        action="store_true",
        help="the comparison with HF only, on an engine serving lens requests whatever the check says",
    )
    add_engine_arg_option(parser)


def run(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    return run_verify(
        args.model, parse_engine_args(args.engine_arg), as_json=args.json, hf=not args.no_hf, self_check=not args.no_self_check
    )


def run_verify(model: str, engine_args: dict[str, Any], as_json: bool = False, hf: bool = True, self_check: bool = True) -> int:
    # the point of the command, whatever the environment says
    os.environ["LENS_EVALS_SELF_CHECK"] = "1" if self_check else "0"
    from lens_evals.cli.verify_hf import HFComparison, compare, hf_reference, hf_unloadable
    from lens_evals.engine import compat
    from lens_evals.engine.frontend.offline import close_offline_engine, open_offline_engine
    from lens_evals.engine.frontend.self_check_run import ensure_offline, result_of
    from lens_evals.models.registry import resolve_model

    comparison, reference, reference_seconds = None, None, 0.0
    if hf:  # HF first, in its own process: its memory is free before the engine starts
        directory = resolve_model(model)
        why = hf_unloadable(directory)
        comparison = HFComparison(model, skipped=why) if why else None
        started = time.monotonic()
        reference = None if why else hf_reference(directory)
        reference_seconds = time.monotonic() - started
    llm = open_offline_engine(model, in_process=True, **engine_args)
    try:
        ensure_offline(llm)  # already run at the engine's start, unless it was the process's first
        result = result_of(compat.frontend.input_processor(llm.llm_engine))
        if reference is not None and (result is None or result.refusal() is None):
            try:
                comparison = compare(llm, reference, model)
                comparison.seconds = round(comparison.seconds + reference_seconds, 1)
            except Exception as exc:  # noqa: BLE001 - a lens request that fails is the comparison failing, with why
                comparison = HFComparison(model, error=f"{type(exc).__name__}: {exc}"[:2000])
        elif reference is not None:
            comparison = HFComparison(model, skipped="lens requests are refused: the self-check failed")
    finally:
        close_offline_engine(llm)
    if result is None:
        print(f"lens-evals verify: the self-check did not run on {model}")
        return 2
    if as_json:
        print(json.dumps(result.to_json() | ({"hf": comparison.to_json()} if comparison else {}), indent=2))
    else:
        print(result.table() + ("\n\n" + comparison.table() if comparison else ""))
    failed = not result.passed or (comparison is not None and not comparison.passed)
    return 1 if failed else 0
