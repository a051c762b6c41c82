"""The offline vLLM engine (``vllm.LLM``) as the package opens it: one set of defaults.

Probe training and sweeps, ``lens-evals capture``, the science runs, the demo, activation-oracle
training and the benchmark all open their engine through :func:`offline_engine_args`; what one of
them needs differently (LoRA, a longer context, the benchmark's parallelism) is an explicit
override at its call. vllm is imported only by :func:`open_offline_engine`.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from lens_evals.engine.plugin import require_plugin

# The checkpoint's dtype, except float32 for the embedded models: the vllm-lens provider's server
# uses float32 for them too, so probes trained here see the numbers they will score.
EMBEDDED_DTYPE = "float32"
DEFAULTS: dict[str, Any] = {"max_model_len": 1024, "seed": 0}
KV_CACHE_GIB = 2  # VLLM_CPU_KVCACHE_SPACE unless the environment sets it (vLLM's CPU build only)


def engine_defaults(**overrides: Any) -> dict[str, Any]:
    """The defaults without a model: a 1024-token context and seed 0; ``overrides`` win."""
    return {**DEFAULTS, **overrides}


def offline_engine_args(model: str, **overrides: Any) -> dict[str, Any]:
    """``LLM(**...)`` keyword arguments for an embedded model's name or a model directory: its
    directory, float32 for an embedded model (else the checkpoint's dtype), and
    :func:`engine_defaults`; ``overrides`` win. With ``enable_lora`` on a GPU, float32 becomes
    bfloat16 (:func:`lens_evals.engine.compat.lora.lora_engine_dtype`)."""
    from lens_evals.models.registry import PREPARERS, resolve_model

    dtype = EMBEDDED_DTYPE if model in PREPARERS else "auto"
    args = {"model": resolve_model(model), **engine_defaults(**{"dtype": dtype, **overrides})}
    if args.get("enable_lora"):
        from lens_evals.engine.compat.lora import lora_engine_dtype

        args["dtype"] = lora_engine_dtype(args["dtype"])  # bf16 on a GPU: vLLM's LoRA kernels there take no fp32
    return args


def open_offline_engine(model: str, *, kv_cache_gib: int = KV_CACHE_GIB, in_process: bool = False, **overrides: Any) -> Any:
    """A ``vllm.LLM`` with :func:`offline_engine_args`. ``kv_cache_gib`` and ``in_process`` (no
    engine-core process: ``VLLM_ENABLE_V1_MULTIPROCESSING=0``) are set in the environment unless
    it already sets them. Refuses (``PluginNotLoadable``) when vLLM would not load our plugin."""
    require_plugin()  # else lens requests would come back without activations, and nothing would say why
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kv_cache_gib))
    if in_process:
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM

    return LLM(**offline_engine_args(model, **overrides))


def close_offline_engine(llm: Any) -> None:
    """Shut the engine down now (its engine core, workers and their memory), not at exit."""
    llm.llm_engine.engine_core.shutdown()


@contextmanager
def engine_for(model: str, llm: Any = None, engine_args: dict[str, Any] | None = None) -> Iterator[Any]:
    """``llm`` if given (the caller's: left open), else an engine for ``model`` opened with
    ``engine_args`` and shut down on leaving, error or not: its memory is free for what comes next
    (the main job's server after a probe is trained, say)."""
    if llm is not None:
        yield llm
        return
    engine = open_offline_engine(model, **(engine_args or {}))
    try:
        yield engine
    finally:
        close_offline_engine(engine)


def add_engine_arg_option(parser: argparse.ArgumentParser) -> None:
    """``--engine-arg KEY=VALUE`` (repeatable), read by :func:`parse_engine_args`."""
    parser.add_argument(
        "--engine-arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an extra vLLM engine argument, e.g. gpu_memory_utilization=0.5 (repeatable; JSON values)",
    )


def parse_engine_args(pairs: list[str]) -> dict[str, Any]:
    """``["gpu_memory_utilization=0.5", "enforce_eager=true"]`` -> ``{"gpu_memory_utilization": 0.5, "enforce_eager": True}``."""
    parsed: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise SystemExit(f"--engine-arg {pair!r}: expected KEY=VALUE")
        try:
            parsed[key] = json.loads(value)
        except json.JSONDecodeError:
            parsed[key] = value
    return parsed
