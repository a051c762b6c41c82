"""The end of a capture run at GPU scale, on a bare machine: step rows copied from the GPU into
the pinned arena (``host_copy``), then one fetch of every request as the worker does it
(release, then write: inline bytes, hand-off files on 1 or N writer threads, or the shared pool)
and the frontend's claim. Needs only torch and numpy (the GPU image has no pydantic, so the package's
``__init__`` is skipped: only ``host_copy``, ``host_store``, ``protocol``, ``results``, ``handoff`` and
``settings`` are loaded).

    python3 scripts/fetch_path_bench.py [--requests 256] [--steps 129] [--hidden 4096]
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
for package in ("lens_evals", "lens_evals.engine"):  # namespace stubs: no package __init__ runs
    module = types.ModuleType(package)
    module.__path__ = [str(ROOT / package.replace(".", "/"))]
    sys.modules[package] = module

import torch  # noqa: E402

from lens_evals.engine.transport import handoff, handoff_pool  # noqa: E402
from lens_evals.engine.transport.protocol import PackedRows  # noqa: E402
from lens_evals.engine.worker.host_copy import host_copier  # noqa: E402
from lens_evals.engine.worker.host_store import Piece, PieceStore  # noqa: E402
from lens_evals.engine.worker.results import THREADS_ENV, TakenResult, write_results  # noqa: E402


def fill(requests: int, steps: int, hidden: int, device: str) -> PieceStore:
    store = PieceStore()
    rows = torch.randn(requests, hidden, device=device).to(torch.bfloat16)
    copier = host_copier(torch.device(device))
    for step in range(steps):
        data, ready, chunk = copier.to_host(rows.unsqueeze(0).clone(), store.arena)
        buffer = store.new_buffer(data, ready, requests, chunk)
        for index in range(requests):
            store.add(f"k{index}", Piece(buffer, index, 1, step, None))
    return store


def fetch(store: PieceStore, requests: int, sink: handoff.Sink, threads: int) -> tuple[float, float, float]:
    started = time.perf_counter()
    taken = {}
    for index in range(requests):
        pieces = store.release(f"k{index}")
        taken[f"k{index}"] = TakenResult({}, [("residual_stream", "layers", [16], pieces)])
    released = time.perf_counter()
    results = write_results(taken, sink, threads)
    written = time.perf_counter()
    handoff.claim_all([results])
    claimed = time.perf_counter()
    tensors = [PackedRows.decode(result["residual_stream"]) for result in results.values()]  # what the frontend keeps
    assert len(tensors) == requests
    return released - started, written - released, claimed - written


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--steps", type=int, default=129)
    parser.add_argument("--hidden", type=int, default=4096)
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    total = args.requests * args.steps * args.hidden * 2
    target = handoff.HandoffTarget.for_this_process()
    print(
        f"{args.requests} requests x {args.steps} positions x hidden {args.hidden} (bf16, {total / 2**20:.0f} MiB) "
        f"on {device}, {os.cpu_count()} cpus, hand-off dir {target['dir'] if target else '-'}"
    )
    print("(second half: the same again; the pool reuses the regions the rounds before freed)")
    print("| path | release ms | write ms | claim ms |")
    print("| --- | --- | --- | --- |")

    def sink(pool_mib: str) -> handoff.Sink:  # as for a frontend in another process; the regions it freed
        os.environ[handoff_pool.POOL_ENV] = pool_mib
        return handoff.sink_for({**handoff.HandoffTarget.for_this_process(), "pid": -1})

    many = int(os.environ.get(THREADS_ENV, 8))
    for name, make_sink, threads in (
        ("inline bytes", lambda: handoff.inline, 1),
        ("files, 1 thread", lambda: sink("0"), 1),
        (f"files, {many} threads", lambda: sink("0"), many),
        ("shared pool, 1 thread", lambda: sink("4096"), 1),
        (f"shared pool, {many} threads", lambda: sink("4096"), many),
    ) * 2:
        store = fill(args.requests, args.steps, args.hidden, device)
        release_s, write_s, claim_s = fetch(store, args.requests, make_sink(), threads)
        print(f"| {name} | {release_s * 1e3:.0f} | {write_s * 1e3:.0f} | {claim_s * 1e3:.0f} |")
        gc.collect()  # the tensors of this round are gone: the next fetch reports their regions free
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
