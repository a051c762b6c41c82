"""The worker's host-side cost per engine step at GPU scale, without a model or a GPU.

``python -m benchmarks.host_path`` plans, runs the layer ops on random tensors and stores
``--steps`` decode steps of ``--requests`` requests (hidden ``--hidden``, bf16), then fetches
every request (inline bytes, and through the hand-off as for a frontend in another process), for capture / steering / probe requests. It prints milliseconds per step for each
part and, for scale, that time as a share of an 8B eager decode step on an H200 (~12 ms: 2.52 s
for 128 tokens of 256 requests in `docs/bench/gpu-h200-2026-12-02.md`). The tensor ops run on
this CPU, so their column is only indicative; planning and storing are host work on any device.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from lens_evals import settings
from lens_evals.engine.compat.worker import BatchLayout
from lens_evals.engine.transport import handoff
from lens_evals.engine.worker.core import WorkerCore
from lens_evals.engine.worker.requests import WorkerLensRequest, WorkerProbe, WorkerSteering
from lens_evals.engine.worker.results import write_results
from lens_evals.engine.worker.taps import run_layer

GPU_EAGER_STEP_MS = 12.0


def _request(feature: str, index: int, layer: int, hidden: int, dtype: torch.dtype) -> WorkerLensRequest:
    key = f"key-{index}"
    if feature == "capture":
        return WorkerLensRequest(key=key, capture_layers=[layer])
    if feature == "steer":
        vector = torch.randn(1, hidden).to(dtype)
        return WorkerLensRequest(key=key, capture_layers=[], steering=[WorkerSteering({layer: vector}, None, 0.0, False)])
    weights = torch.randn(hidden) / hidden**0.5
    return WorkerLensRequest(key=key, capture_layers=[], probes=[WorkerProbe(0, layer, "probe", weights, 0.5)])


def measure(
    feature: str,
    requests: int,
    steps: int,
    hidden: int,
    dtype: torch.dtype,
    layer: int = 16,
    sink: handoff.Sink = handoff.inline,
    threads: int = 1,
) -> dict[str, float]:
    core = WorkerCore(torch.device("cpu"), dtype, set(range(32)))
    for index in range(requests):
        core.ledger.track(f"req-{index}", _request(feature, index, layer, hidden, dtype))
    hidden_rows = torch.randn(requests, hidden).to(dtype)
    residual_rows = torch.randn(requests, hidden).to(dtype)
    plan_s = ops_s = store_s = 0.0
    for step in range(steps):
        layout = BatchLayout([f"req-{i}" for i in range(requests)], [1] * requests, [step] * requests)
        started = time.perf_counter()
        plan = core.plan_step(layout, None)
        if plan is None:  # every request here is a lens request: a step without a plan is a planner bug
            raise RuntimeError(f"{feature}: no plan for step {step} of {requests} lens requests")
        planned = time.perf_counter()
        step_context = core.begin_step(plan)
        run_layer(step_context, layer, hidden_rows, residual_rows)
        ran = time.perf_counter()
        core.store_step(step_context)
        stored = time.perf_counter()
        plan_s, ops_s, store_s = plan_s + planned - started, ops_s + ran - planned, store_s + stored - ran
    started = time.perf_counter()
    written = write_results({f"key-{i}": core.take_result(f"key-{i}") for i in range(requests)}, sink, threads)  # as a fetch does
    results = list(written.values())
    handoff.claim_all([{str(i): r for i, r in enumerate(results) if r}])  # the frontend's side: map, unlink
    fetch_s = time.perf_counter() - started
    if feature != "steer" and any(r is None or "error" in r for r in results):
        raise RuntimeError(f"{feature}: a request came back without its rows: {results[0]}")
    return {
        "plan_ms": 1e3 * plan_s / steps,
        "ops_ms": 1e3 * ops_s / steps,
        "store_ms": 1e3 * store_s / steps,
        "fetch_all_ms": 1e3 * fetch_s,
        "held_bytes_after": float(core.held_bytes),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--steps", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=4096)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    np.random.seed(0)
    print(f"{args.requests} requests x {args.steps} decode steps, hidden {args.hidden}, bfloat16, one hooked layer")
    target = handoff.HandoffTarget.for_this_process()
    to_file = handoff.sink_for({**target, "pid": -1}) if target else handoff.inline  # as for another process
    threads = settings.WRITE_THREADS.get() if settings.WRITE_THREADS.is_set() else 8
    print(
        f"| feature | plan ms/step | store ms/step | plan+store share of a 12 ms GPU step | layer ops ms/step (CPU) "
        f"| fetch all ms (inline bytes) | fetch all ms (hand-off) | same, {threads} writer threads |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for feature in ("capture", "steer", "probe"):
        m = measure(feature, args.requests, args.steps, args.hidden, torch.bfloat16)
        by_file = measure(feature, args.requests, args.steps, args.hidden, torch.bfloat16, sink=to_file)["fetch_all_ms"]
        threaded = measure(feature, args.requests, args.steps, args.hidden, torch.bfloat16, sink=to_file, threads=threads)["fetch_all_ms"]
        share = (m["plan_ms"] + m["store_ms"]) / GPU_EAGER_STEP_MS
        print(
            f"| {feature} | {m['plan_ms']:.3f} | {m['store_ms']:.3f} | {share:.1%} | {m['ops_ms']:.2f} "
            f"| {m['fetch_all_ms']:.0f} | {by_file:.0f} | {threaded:.0f} |"
        )
        if m["held_bytes_after"]:
            raise RuntimeError(f"{feature}: {m['held_bytes_after']:.0f} bytes still held after every fetch")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
