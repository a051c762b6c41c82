"""The end of a capture run at GPU scale, on a bare machine: step rows copied from the GPU into
the pinned arena (``store.to_host``), then one fetch of every request as the worker does it
(release, then write: inline bytes or hand-off files, 1 or N writer threads) and the frontend's
claim of the files. Needs only torch and numpy (the GPU image has no pydantic, so the package's
``__init__`` is skipped: only ``store``, ``results`` and ``handoff`` are loaded).

    python3 scripts/fetch_path_bench.py [--requests 256] [--steps 129] [--hidden 4096]
"""

from __future__ import annotations

import argparse
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

from lens_evals.engine import handoff  # noqa: E402
from lens_evals.engine.results import TakenResult, write_results, writer_threads  # noqa: E402
from lens_evals.engine.store import Piece, PieceStore, row_blocks, to_host  # noqa: E402


def fill(requests: int, steps: int, hidden: int, device: str) -> PieceStore:
    store = PieceStore()
    rows = torch.randn(requests, hidden, device=device).to(torch.bfloat16)
    for step in range(steps):
        data, ready, chunk = to_host(rows.unsqueeze(0).clone(), store.arena)
        buffer = store.new_buffer(data, ready, requests, chunk)
        for index in range(requests):
            store.add(f"k{index}", Piece(buffer, index, 1, step, None))
    return store


def fetch(store: PieceStore, requests: int, sink: handoff.Sink, threads: int) -> tuple[float, float, float]:
    started = time.perf_counter()
    taken = {}
    for index in range(requests):
        pieces = store.release(f"k{index}")
        taken[f"k{index}"] = TakenResult({}, [("residual_stream", "layers", [16], row_blocks(pieces))])
    released = time.perf_counter()
    results = write_results(taken, sink, threads)
    written = time.perf_counter()
    handoff.claim_all([results])
    return released - started, written - released, time.perf_counter() - written


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--steps", type=int, default=129)
    parser.add_argument("--hidden", type=int, default=4096)
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    target = handoff.HandoffTarget.for_this_process()
    to_file = handoff.sink_for({**target, "pid": -1}) if target else handoff.inline
    total = args.requests * args.steps * args.hidden * 2
    print(f"{args.requests} requests x {args.steps} positions x hidden {args.hidden} (bf16, {total / 2**20:.0f} MiB) "
          f"on {device}, {os.cpu_count()} cpus, hand-off dir {target['dir'] if target else '-'}")
    print("| path | release ms | write ms | claim ms |")
    print("| --- | --- | --- | --- |")
    for name, sink, threads in (("inline bytes", handoff.inline, 1), ("hand-off files, 1 thread", to_file, 1),
                                (f"hand-off files, {writer_threads()} threads", to_file, writer_threads())) * 2:
        store = fill(args.requests, args.steps, args.hidden, device)
        release_s, write_s, claim_s = fetch(store, args.requests, sink, threads)
        print(f"| {name} | {release_s * 1e3:.0f} | {write_s * 1e3:.0f} | {claim_s * 1e3:.0f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
