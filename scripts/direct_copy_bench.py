"""Would step copies straight into the shared pool pay? (issue #21, all 32 layers in one call.)

Today a captured step goes device -> pinned arena (DMA), and each finished request's rows then go
pinned arena -> shared pool (a host copy on the worker's writer thread); for 44 GB the pinning
and the host copy, not the DMA, set the time (benchmarks/results/NOTEBOOK.md). The alternative: the pool's
shared-memory segment registered with the CUDA driver (``cudaHostRegister``: pinned in place) and
each request's rows copied device -> pool directly. This times, on one GPU, with torch only:

* ``register``: registering a fresh segment of ``--gib`` (once per segment: segments persist);
* ``d2h pinned``: device -> a torch pinned buffer (today's step copy), in pieces of ``--piece-mib``;
* ``d2h registered``: device -> the registered segment, the same pieces (the proposed copy);
* ``d2h pageable``: device -> the segment unregistered (what torch does without pinning);
* ``host copy``: pinned buffer -> segment on one thread (today's early write), into touched pages,
  and into a fresh segment (the 2-core CPU here: 1.4-1.5 GB/s fresh against 13-14 GB/s touched);
* ``gather``: one step's rows made request-major on the device (``index_select`` of a
  (layers, rows, hidden) block), what the direct copy needs first.

    python3 scripts/direct_copy_bench.py [--gib 8] [--piece-mib 44] [--layers 32] [--step-rows 16384]

Prints GB/s per path and the seconds each would take for 43.9 GB (the 1,000-prompt, 32-layer
capture). Needs CUDA; the segment lives in /dev/shm as the pool's do.
"""

from __future__ import annotations

import argparse
import mmap
import os
import tempfile
import time
from collections.abc import Callable

import numpy as np
import torch

CAPTURE_BYTES = 43.9e9  # 1,000 prefill prompts x 32 layers x 4,096 x bf16


def shm_segment(nbytes: int) -> mmap.mmap:
    """A fresh shared-memory segment as the pool makes them (a file in /dev/shm, mapped, unlinked)."""
    directory = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    fd, path = tempfile.mkstemp(dir=directory, prefix="lens-evals-direct-")
    try:
        os.ftruncate(fd, nbytes)
        return mmap.mmap(fd, nbytes)
    finally:
        os.close(fd)
        os.unlink(path)


def timed(run: Callable[[], object], repeats: int) -> float:
    """Best wall seconds of ``repeats`` runs, the device synchronised around each."""
    best = float("inf")
    for _ in range(repeats):
        torch.cuda.synchronize()
        began = time.perf_counter()
        run()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - began)
    return best


def copies(source: torch.Tensor, target: torch.Tensor, piece: int, stream: torch.cuda.Stream) -> Callable[[], None]:
    """Copy ``source`` (device bytes) into consecutive ``piece``-byte slices of ``target`` until it is full."""
    count = target.numel() // piece

    def run() -> None:
        with torch.cuda.stream(stream):
            for index in range(count):
                target[index * piece : (index + 1) * piece].copy_(source[:piece], non_blocking=True)

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=8.0, help="the segment (and pinned buffer) size")
    parser.add_argument("--piece-mib", type=float, default=44.0, help="one copy (a 168-token request's 32 layers: 44 MiB)")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--step-rows", type=int, default=16384)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("direct_copy_bench needs a CUDA device (it times device-to-host copies)")
    nbytes = int(args.gib * 2**30)
    piece = int(args.piece_mib * 2**20)
    nbytes -= nbytes % piece
    stream = torch.cuda.Stream()
    source = torch.empty(piece, dtype=torch.uint8, device="cuda").fill_(1)
    rows: dict[str, float] = {}

    segment = shm_segment(nbytes)
    target = torch.frombuffer(segment, dtype=torch.uint8)
    rows["d2h pageable"] = nbytes / timed(copies(source, target, piece, stream), 1)  # first touch of every page included

    cudart = torch.cuda.cudart()
    began = time.perf_counter()
    error = cudart.cudaHostRegister(target.data_ptr(), nbytes, 0)
    register_seconds = time.perf_counter() - began
    if int(error) != 0:
        raise SystemExit(f"cudaHostRegister failed: {cudart.cudaGetErrorString(error)}")
    rows["d2h registered"] = nbytes / timed(copies(source, target, piece, stream), args.repeats)

    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    rows["d2h pinned"] = nbytes / timed(copies(source, pinned, piece, stream), args.repeats)
    into, out_of = np.frombuffer(segment, dtype=np.uint8), pinned.numpy()  # one thread, as the writer copies
    rows["host copy"] = nbytes / timed(lambda: np.copyto(into, out_of), args.repeats)
    fresh = np.frombuffer(shm_segment(nbytes), dtype=np.uint8)  # a segment never written: every page faults in
    rows["host copy, fresh pages"] = nbytes / timed(lambda: np.copyto(fresh, out_of), 1)
    cudart.cudaHostUnregister(target.data_ptr())

    block = torch.empty(args.layers, args.step_rows, args.hidden, dtype=torch.bfloat16, device="cuda")
    order = torch.randperm(args.step_rows, device="cuda")
    gather_seconds = timed(lambda: block.index_select(1, order).permute(1, 0, 2).contiguous(), args.repeats)
    step_bytes = block.numel() * block.element_size()

    print(f"{torch.cuda.get_device_name()}, segment {nbytes / 2**30:.1f} GiB, pieces of {piece / 2**20:.0f} MiB")
    print(f"register: {register_seconds:.2f} s ({nbytes / register_seconds / 1e9:.1f} GB/s), once per segment")
    for name, rate in rows.items():
        print(f"{name:>15}: {rate / 1e9:6.1f} GB/s -> {CAPTURE_BYTES / rate:6.2f} s for 43.9 GB")
    print(
        f"         gather: {gather_seconds * 1e3:.1f} ms per step of {args.step_rows} rows x {args.layers} layers "
        f"({step_bytes / 1e9:.2f} GB) -> {gather_seconds * CAPTURE_BYTES / step_bytes:.2f} s for 43.9 GB, on the device"
    )


if __name__ == "__main__":
    main()
