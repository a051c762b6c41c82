"""One vLLM engine with the Ray executor in a process of its own, for tests/engine/test_ray_executor.py
(why a fresh process per Ray engine: that module's docstring). Runs the module's three lens
requests (capture + probe, steering + capture + probe, hooks) or a mode's own check, writes what
came back to OUT (safetensors) and OUT with the suffix .json (token ids, the engine's options,
timings, a mode's outcome), then shuts the engine and Ray down.

    python tests/scripts/ray_engine_run.py MODE MODEL_DIR OUT.safetensors [--executor ray|default]

MODE: ``local``: its own Ray instance (``ray.init(address="local", num_gpus=1)``), the requests;
``setting``: Ray started first, THEN ``LENS_EVALS_MAX_HELD_CAPTURE_GIB`` set on this driver, the
engine: the lens request's error and a plain request's tokens are recorded; ``cluster``: joins
the Ray cluster at ``RAY_ADDRESS``, the requests; ``no-plugin``: joins it too, and records which
way the lens request failed (the engine refused to start, or the request failed, or neither).
``--executor default`` skips Ray (vLLM's default executor): the plumbing check on CPU.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from lens_evals import LinearProbe, SteeringVector
from lens_evals.request.hooks import Hook

REPO = Path(__file__).resolve().parents[2]
PROMPTS = ["the cat reads a book.", "a model finds the truth.", "1 2 3 4 5 6 7 8"]
LAYERS = [0, 3]
PROBE = LinearProbe(name="p", layer=3, weights=np.random.default_rng(3).normal(size=128).astype(np.float32), bias=0.5)
STEER = SteeringVector(activations=np.random.default_rng(2).normal(size=(1, 128)).astype(np.float32), layer_indices=[1], scale=6.0)
HOOKS = [Hook("record_norm", [1, 2])]
SETTING = "LENS_EVALS_MAX_HELD_CAPTURE_GIB"
TINY_BOUND_GIB = str(1 / 2**20)  # ~1 KiB: layers 0-3 of one 6-token request hold more
# Past this many seconds every thread's stack is printed and the process exits (code 1). A Ray
# engine here took ~70 s on the H200 (2026-12-04: Ray's start ~10 s, its worker ~35-40 s).
STACKS_AFTER_S = 200  # the whole script: import, Ray, the engine, requests, shut-down (lanes share the host)


def lens_params() -> list[Any]:
    from tests.conftest import greedy

    extra: dict[str, Any] = {"output_residual_stream": LAYERS, "output_probe_scores": [PROBE]}
    return [greedy(6, **extra), greedy(6, apply_steering_vectors=[STEER], **extra), greedy(6, apply_hooks=HOOKS)]


def ray_engine_options(executor: str) -> dict[str, Any]:
    """The options of tests/conftest.py's make_llm (the tests' in-process reference), plus the executor."""
    from tests.conftest import engine_options

    return engine_options(**{"enable_prefix_caching": True, **({"distributed_executor_backend": "ray"} if executor == "ray" else {})})


def results_of(outputs: list[Any]) -> list[dict[str, Any]]:
    """Per request: ``tokens`` (ids), ``capture`` (layers, tokens, hidden) or None, ``probes``
    ({name: scores}) and ``saved`` ({key: hook result}); tensors on the CPU."""
    results = []
    for out in outputs:
        acts = getattr(out, "activations", None) or {}
        capture = acts.get("residual_stream")
        results.append(
            {
                "tokens": list(out.outputs[0].token_ids),
                "capture": None if capture is None else capture.detach().cpu(),
                "probes": {name: s.detach().cpu() for name, s in acts.get("probe_scores", {}).items()},
                "saved": {key: v.detach().cpu() for key, v in acts.get("saved", {}).items()},
            }
        )
    return results


def save_results(results: list[dict[str, Any]], out: Path, meta: dict[str, Any]) -> None:
    """Tensors to ``out`` as ``{i}/capture``, ``{i}/probe/{name}``, ``{i}/saved/{key}``; token ids
    and ``meta`` to ``out.with_suffix(".json")``."""
    from safetensors.torch import save_file

    tensors = {}
    for i, r in enumerate(results):
        if r["capture"] is not None:
            tensors[f"{i}/capture"] = r["capture"]
        tensors.update({f"{i}/probe/{name}": s for name, s in r["probes"].items()})
        tensors.update({f"{i}/saved/{key}": v for key, v in r["saved"].items()})
    save_file({name: t.contiguous().clone() for name, t in tensors.items()}, str(out))
    write_meta(out, meta, results)


def write_meta(out: Path, meta: dict[str, Any], results: list[dict[str, Any]]) -> None:
    out.with_suffix(".json").write_text(json.dumps({**meta, "tokens": [r["tokens"] for r in results]}, indent=1))


def load_results(out: Path) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """What :func:`save_results` wrote: the results and the metadata (with ``tokens``)."""
    from safetensors.torch import load_file

    meta = json.loads(out.with_suffix(".json").read_text())
    results: list[dict[str, Any]] = [{"tokens": t, "capture": None, "probes": {}, "saved": {}} for t in meta["tokens"]]
    for name, tensor in load_file(str(out)).items():
        index, kind, *key = name.split("/", 2)
        if kind == "capture":
            results[int(index)]["capture"] = tensor
        else:
            results[int(index)]["probes" if kind == "probe" else "saved"][key[0]] = tensor
    return results, meta


def start_ray(mode: str) -> int:
    """Ray for ``mode``: a fresh local instance or the cluster at RAY_ADDRESS; the alive nodes."""
    import ray

    if mode in ("local", "setting"):
        ray.init(address="local", num_gpus=1, include_dashboard=False)  # never a cluster left running
    else:
        ray.init(address=os.environ["RAY_ADDRESS"])
    return sum(1 for node in ray.nodes() if node["Alive"])


def engine_checks(mode: str, llm: Any, meta: dict[str, Any]) -> list[dict[str, Any]]:
    """The mode's requests on an engine that started; what ``meta`` records of them."""
    from tests.conftest import greedy

    if mode in ("local", "cluster"):
        return results_of(llm.generate(PROMPTS, lens_params(), use_tqdm=False))
    try:
        llm.generate(PROMPTS[:1], greedy(6, output_residual_stream=[0, 1, 2, 3]), use_tqdm=False)
        meta["lens_error"] = None
    except Exception as exc:  # recorded: the test says whether it is the expected failure
        meta["lens_error"] = f"{type(exc).__name__}: {exc}"
    if mode == "no-plugin":
        meta["failure"] = None if meta["lens_error"] is None else f"lens request failed: {meta['lens_error']}"
    else:  # the engine goes on after the refused request
        meta["plain_tokens"] = list(llm.generate(PROMPTS[:1], greedy(6), use_tqdm=False)[0].outputs[0].token_ids)
    return []


def main(mode: str, model: str, out: Path, executor: str) -> None:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    faulthandler.dump_traceback_later(STACKS_AFTER_S, exit=True)
    began = time.monotonic()
    timings: dict[str, float] = {}

    def mark(stage: str) -> None:
        timings[stage] = round(time.monotonic() - began, 1)
        print(f"ray_engine_run {mode}: {stage} at {timings[stage]} s", file=sys.stderr, flush=True)

    options = ray_engine_options(executor)
    from vllm import LLM

    mark("imported")
    meta: dict[str, Any] = {"mode": mode, "executor": executor, "engine_options": options, "timings": timings}
    if executor == "ray":
        meta["alive_nodes"] = start_ray(mode)
        mark("ray ready")
    if mode == "setting":
        os.environ[SETTING] = TINY_BOUND_GIB  # after Ray started: only vLLM's executor can carry it
    results: list[dict[str, Any]] = []
    try:
        llm = LLM(model, **options)
    except Exception as exc:
        if mode != "no-plugin":
            raise
        llm, meta["failure"] = None, f"engine refused to start: {type(exc).__name__}: {exc}"
    mark("engine started" if llm is not None else "engine refused")
    try:
        if llm is not None:
            results = engine_checks(mode, llm, meta)
            mark("requests done")
        save_results(results, out, meta)  # before the shutdown: a stall there still leaves the results
    finally:
        if llm is not None:
            llm.llm_engine.engine_core.shutdown()
        if executor == "ray":
            import ray

            ray.shutdown()
    mark("shut down")
    write_meta(out, meta, results)  # with the shutdown's time


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=["local", "setting", "cluster", "no-plugin"])
    parser.add_argument("model")
    parser.add_argument("out", type=Path)
    parser.add_argument("--executor", choices=["ray", "default"], default="ray")
    args = parser.parse_args()
    if args.executor == "default" and args.mode in ("cluster", "no-plugin"):
        parser.error(f"{args.mode} needs Ray")
    sys.path.insert(0, str(REPO))  # tests.conftest: the tests' engine options and requests
    main(args.mode, args.model, args.out, args.executor)
