"""``lens-evals verify MODEL``: the stream-contract self-check (``engine/frontend/self_check.py``) on the
user's own model, as vLLM loads it (dtype, quantization and engine arguments as given), printed as
a table: per checked layer, the prompt log-probs' move when the captured stream is written back
(identity), the capture against what the next layer reads (handoff), and the last layer's steering
against its control (steer). Exit status 1 when the check fails, 2 when it could not run."""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

from lens_evals.cli.checks import model_name_or_dir
from lens_evals.engine.frontend.offline import add_engine_arg_option, parse_engine_args

HELP = "check the stream contract on a model as vLLM loads it (the start-up self-check)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", type=model_name_or_dir, help="an embedded model's name or a model directory")
    parser.add_argument("--json", action="store_true", help="the numbers as JSON")
    add_engine_arg_option(parser)


def run(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    return run_verify(args.model, parse_engine_args(args.engine_arg), as_json=args.json)


def run_verify(model: str, engine_args: dict[str, Any], as_json: bool = False) -> int:
    os.environ["LENS_EVALS_SELF_CHECK"] = "1"  # the point of the command, whatever the environment says
    from lens_evals.engine import compat
    from lens_evals.engine.frontend.offline import close_offline_engine, open_offline_engine
    from lens_evals.engine.frontend.self_check_run import ensure_offline, result_of

    llm = open_offline_engine(model, in_process=True, **engine_args)
    try:
        ensure_offline(llm)  # already run at the engine's start, unless it was the process's first
        result = result_of(compat.frontend.input_processor(llm.llm_engine))
    finally:
        close_offline_engine(llm)
    if result is None:
        print(f"lens-evals verify: the self-check did not run on {model}")
        return 2
    print(json.dumps(result.to_json(), indent=2) if as_json else result.table())
    return 0 if result.passed else 1
