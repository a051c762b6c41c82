"""Host time of the probes' graph-mode read, op by op, on a GPU (issue #47): the H100 decode
profile spends 0.62 ms per step in ``taps._probe_scores`` (three probes on one layer, 256 rows,
hidden 4096, bf16 stream, float32 weights), where three or four kernel launches should take tens
of microseconds. Torch only (runs on a bare GPU machine)::

    python3 scripts/probe_read_bench.py [--rows 256] [--hidden 4096] [--probes 3]

Prints, per variant, the host microseconds per call (no synchronisation inside the timed loop)
and the device microseconds per call (the loop timed with a synchronisation at its end).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch


def timed(fn: Callable[[], torch.Tensor], calls: int) -> tuple[float, float]:
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    began = time.perf_counter()
    for _ in range(calls):
        fn()
    host = time.perf_counter() - began
    torch.cuda.synchronize()
    total = time.perf_counter() - began
    return 1e6 * host / calls, 1e6 * total / calls


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--probes", type=int, default=3)
    parser.add_argument("--calls", type=int, default=500)
    args = parser.parse_args()
    device = torch.device("cuda")
    hidden = torch.randn(args.rows + 64, args.hidden, device=device, dtype=torch.bfloat16)
    residual = torch.randn_like(hidden)
    weights = torch.randn(args.probes, args.hidden, device=device) / args.hidden**0.5
    bias = torch.randn(args.probes, device=device)
    weights_bf16 = weights.to(torch.bfloat16)
    rows = torch.arange(args.rows, device=device)
    n = args.rows

    def stream() -> torch.Tensor:
        return hidden[:n] + residual[:n]

    variants: dict[str, Callable[[], torch.Tensor]] = {
        "slice + add (the stream)": stream,
        "index_select x2 + add": lambda: hidden.index_select(0, rows) + residual.index_select(0, rows),
        "stream .float()": lambda: stream().float(),
        "now: addmm(bias, W, s.float().T)": lambda: torch.addmm(bias.unsqueeze(1), weights, stream().float().T).reshape(-1),
        "linear(s.float(), W, bias)": lambda: torch.nn.functional.linear(stream().float(), weights, bias).T.reshape(-1),
        "s.float() @ W.T + bias": lambda: (stream().float() @ weights.T + bias).T.reshape(-1),
        "bf16: addmm(bias, Wbf16, s.T).float()": lambda: (
            torch.addmm(bias.unsqueeze(1).to(torch.bfloat16), weights_bf16, stream().T).float().reshape(-1)
        ),
        "matmul only, fp32 (W @ s.T)": lambda: weights @ stream().float().T,
    }
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}: {args.rows} rows x {args.hidden}, {args.probes} probes")
    print("| variant | host us/call | device+host us/call |")
    print("| --- | --- | --- |")
    for name, fn in variants.items():
        host, total = timed(fn, args.calls)
        print(f"| {name} | {host:.1f} | {total:.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
