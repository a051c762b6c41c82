"""The worker's host-side cost per engine step at GPU scale, without a model or a GPU.

``python -m benchmarks.host_path`` plans, runs the layer ops on random tensors and stores
``--steps`` decode steps of ``--requests`` requests (hidden ``--hidden``, bf16), then fetches
every request (inline bytes, and through the hand-off as for a frontend in another process), for capture / steering / probe requests. It prints milliseconds per step for each
part and, for scale, that time as a share of an 8B eager decode step on an H200 (~12 ms: 2.52 s
for 128 tokens of 256 requests in `benchmarks/results/gpu-h200-2026-12-02.md`). The tensor ops run on
this CPU, so their column is only indicative; planning and storing are host work on any device.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import numpy as np
import torch

from lens_evals import settings
from lens_evals.engine.compat.worker import BatchLayout
from lens_evals.engine.transport import handoff, timing
from lens_evals.engine.worker.core import WorkerCore
from lens_evals.engine.worker.host_copy import PlainCopy
from lens_evals.engine.worker.requests import WorkerLensRequest, WorkerProbe, WorkerSteering
from lens_evals.engine.worker.results import write_results
from lens_evals.engine.worker.taps import run_layer

GPU_EAGER_STEP_MS = 12.0


def _request(feature: str, index: int, layer: int, hidden: int, dtype: torch.dtype, probes: int = 1) -> WorkerLensRequest:
    key = f"key-{index}"
    if feature == "capture":
        return WorkerLensRequest(key=key, capture_layers=[layer])
    if feature == "steer":
        vector = torch.randn(1, hidden).to(dtype)
        return WorkerLensRequest(key=key, capture_layers=[], steering=[WorkerSteering({layer: vector}, None, 0.0, False)])
    generator = torch.Generator().manual_seed(0)  # every request the same probes, as the bench sends them
    weights = [torch.randn(hidden, generator=generator) / hidden**0.5 for _ in range(probes)]
    return WorkerLensRequest(key=key, capture_layers=[], probes=[WorkerProbe(i, layer, f"probe{i}", w, 0.5) for i, w in enumerate(weights)])


def measure(
    feature: str,
    requests: int,
    steps: int,
    hidden: int,
    dtype: torch.dtype,
    layer: int = 16,
    sink: handoff.Sink = handoff.inline,
    threads: int = 1,
    probes: int = 1,
    old: bool = False,
    address: dict[str, Any] | None = None,
    device_ms: float = 0.0,
) -> dict[str, float]:
    """``old``: the worker's pre-#47 paths (a piece per request per step, probe pairs gathered).
    ``address``: every request names this frontend, as the engine's do, so rows written while
    the requests run may go there (``stream_write``; off while ``stream_write.MIN_BYTES`` is
    above a request's rows). ``device_ms``: each step also waits this long, as the host waits
    for a GPU's forward pass (the GIL free: a writer thread runs meanwhile)."""
    core = WorkerCore(torch.device("cpu"), dtype, set(range(32)))
    core.decode_runs = core.planner.probe_matrix = not old
    for index in range(requests):
        req = _request(feature, index, layer, hidden, dtype, probes)
        req.handoff, req.rows_at_most = address, steps
        core.ledger.track(f"req-{index}", req)
    if timing.ENABLED:
        timing.take()  # from zero
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
        if device_ms:
            time.sleep(device_ms / 1e3)
    phases = timing.take() if timing.ENABLED else {}
    writer_s = phases.get("stream: write rows", (0.0, 0))[0]
    rounds_s = phases.get(timing.DETAIL + "stream rows", (0.0, 0))[0]  # the main thread's part
    started = time.perf_counter()
    written = write_results({f"key-{i}": core.take_result(f"key-{i}", address) for i in range(requests)}, sink, threads)  # as a fetch does
    core.streams.reap()  # (``WorkerCore.fetch_results`` does after writing)
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
        "writer_ms": 1e3 * writer_s,
        "rounds_ms": 1e3 * rounds_s / steps,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--steps", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--probes", type=int, default=1, help="probes per request of the probe feature")
    parser.add_argument("--compare-old", type=int, default=0, metavar="ROUNDS", help="only: the pre-#47 paths against now, paired rounds")
    parser.add_argument(
        "--gpu-segments",
        action="store_true",
        help="captured rows in decode-run segments as on a GPU (on CPU only probe scores are: a segment costs a host copy here)",
    )
    parser.add_argument(
        "--stream", type=int, default=0, metavar="ROUNDS", help="only: rows written while decoding against at the fetch, paired rounds"
    )
    parser.add_argument("--device-ms", type=float, default=20.0, help="--stream: each step's forward pass on the device (waited for)")
    args = parser.parse_args(argv)
    if args.gpu_segments:
        PlainCopy.segment_step_bytes = None
    if args.compare_old:
        return compare_old(args)
    if args.stream:
        return compare_stream(args)
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


def compare_old(args: argparse.Namespace) -> int:
    """Plan + store (host work on any device) and the layer ops (here on the CPU; device work
    on a GPU) per step, and the fetch of every request: the pre-#47 paths against now, in
    alternating order, ``--compare-old`` rounds: medians and the median paired ratio. On CPU a
    decode run's store copies the step's rows into its segment (on a GPU the copy is the
    device-to-host copy made anyway)."""
    import statistics

    print(f"{args.requests} requests x {args.steps} decode steps, hidden {args.hidden}, bf16, {args.probes} probe(s); now / before, paired")
    print(
        "| feature | plan+store ms/step, before | now | now/before | layer ops ms/step (CPU), before | now "
        "| now/before | fetch all ms, before | now | now/before |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for feature in ("capture", "probe"):
        runs: dict[bool, list[dict[str, float]]] = {True: [], False: []}
        for round_index in range(args.compare_old):
            for old in (True, False) if round_index % 2 == 0 else (False, True):
                runs[old].append(measure(feature, args.requests, args.steps, args.hidden, torch.bfloat16, probes=args.probes, old=old))

        def host_ms(m: dict[str, float]) -> float:
            return m["plan_ms"] + m["store_ms"]

        cells = []
        for value in (host_ms, lambda m: m["ops_ms"], lambda m: m["fetch_all_ms"]):
            before, now = [value(m) for m in runs[True]], [value(m) for m in runs[False]]
            ratio = statistics.median(n / b for n, b in zip(now, before))
            cells += [f"{statistics.median(before):.3f}", f"{statistics.median(now):.3f}", f"{ratio:.2f}x"]
        print(f"| {feature} | " + " | ".join(cells) + " |")
    return 0


def compare_stream(args: argparse.Namespace) -> int:
    """Captures written while the requests decode (``stream_write``) against written at the
    fetch, as bytes (no pool), into the hand-off pool of a frontend in this process (an
    in-process engine) and of one in another, in alternating order, ``--stream`` rounds: store ms per step (the main thread's share of the
    rounds), the fetch after the last step, and the writer thread's time while the steps ran.
    Each step waits ``--device-ms`` as for a GPU's forward pass (an 8B decode step of 256
    requests: ~20 ms on an H100)."""
    import os
    import statistics

    from lens_evals.engine.worker import stream_write

    if handoff.HandoffTarget.for_this_process() is None:
        raise SystemExit("the hand-off is off (LENS_EVALS_HANDOFF=0): nothing to compare")

    def address_of(name: str) -> dict[str, Any]:
        """Each round's target as a call sends it (the regions freed since the last: the pool is
        reused, as over an eval's calls). bytes: a directory the worker does not share (no pool)."""
        if name == "bytes":
            return {"dir": "/nonexistent", "token": "0" * 32, "pid": os.getpid()}
        target = handoff.HandoffTarget.for_this_process()
        assert target is not None
        return {**target, "pid": os.getpid() if name == "pool, this process" else -1}

    names = ("bytes", "pool, this process", "pool, another process")
    print(f"{args.requests} requests x {args.steps} decode steps, hidden {args.hidden}, bf16, one captured layer; streamed / at the fetch")
    print(
        "| frontend | store ms/step, at fetch | streamed | of which rounds of writes | fetch ms, at fetch | streamed "
        "| streamed/at fetch | writer ms during steps |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    timing.collect()
    minimum = stream_write.MIN_BYTES
    for name in names:
        runs: dict[bool, list[dict[str, float]]] = {True: [], False: []}
        for round_index in range(args.stream):
            for streamed in (True, False) if round_index % 2 == 0 else (False, True):
                stream_write.MIN_BYTES = minimum if streamed else 1 << 62
                address = address_of(name)
                try:
                    runs[streamed].append(
                        measure(
                            "capture",
                            args.requests,
                            args.steps,
                            args.hidden,
                            torch.bfloat16,
                            sink=handoff.sink_for(address),
                            address=address,
                        )
                    )
                finally:
                    stream_write.MIN_BYTES = minimum
        cells = []
        for key in ("store_ms", "fetch_all_ms"):
            off, on = [m[key] for m in runs[False]], [m[key] for m in runs[True]]
            cells += [f"{statistics.median(off):.3f}", f"{statistics.median(on):.3f}"]
            if key == "store_ms":
                cells.append(f"{statistics.median(m['rounds_ms'] for m in runs[True]):.3f}")
        ratio = statistics.median(on["fetch_all_ms"] / off["fetch_all_ms"] for on, off in zip(runs[True], runs[False]))
        writer = statistics.median(m["writer_ms"] for m in runs[True])
        print(f"| {name} | " + " | ".join(cells) + f" | {ratio:.2f}x | {writer:.0f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
