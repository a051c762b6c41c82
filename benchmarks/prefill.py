"""The prefill workload (``lens-evals bench --workload prefill``): Alpaca-like prompt lengths,
``max_tokens=1``, every prompt token captured. What it shares with the decode workload lives in
the other modules; here: the prompt lengths, the layer sets it captures, the bytes a capture
moves and what copying them alone costs (the floor under any capture's overhead)."""

from __future__ import annotations

import time

import numpy as np
import torch

# Instruction-following prompts (Alpaca-like): a skewed length distribution, 40-400 tokens,
# mean ~170 tokens (the 1,000 prompts: 169,905 tokens).
PREFILL_MIN, PREFILL_MAX = 40, 400
MEDIAN_TOKENS, LOG_SIGMA = 160.0, 0.55
MANY_LAYERS = 8  # the "capture 8 layers" systems
STEP_ROWS = 8192  # rows of one engine step the copy-alone measurement copies at a time


def prefill_lengths(n: int, seed: int = 0) -> list[int]:
    """``n`` lengths from a log-normal distribution (median 160), redrawn outside 40-400."""
    rng = np.random.default_rng(seed)
    out: list[int] = []
    while len(out) < n:
        draw = np.round(rng.lognormal(np.log(MEDIAN_TOKENS), LOG_SIGMA, size=2 * n)).astype(int)
        out.extend(int(x) for x in draw if PREFILL_MIN <= x <= PREFILL_MAX)
    return out[:n]


def many_layers(num_layers: int, layer: int, count: int = MANY_LAYERS) -> list[int]:
    """``count`` layers spread over the model, ``layer`` among them (all of them if fewer)."""
    if num_layers <= count:
        return list(range(num_layers))
    spread = {int(round(i * (num_layers - 1) / (count - 1))) for i in range(count)}
    spread.discard(min(spread, key=lambda x: abs(x - layer)))
    spread.add(layer)
    return sorted(spread)


def capture_layers(lens: str | None, num_layers: int, layer: int) -> list[int]:
    """The layers a capture feature (``capture-1``, ``capture-8``, ``capture-all``) asks for."""
    if lens == "capture-1":
        return [layer]
    if lens == "capture-8":
        return many_layers(num_layers, layer)
    if lens == "capture-all":
        return list(range(num_layers))
    return []


def bytes_moved(positions: int, n_layers: int, hidden: int, dtype: torch.dtype) -> int:
    """What a capture of ``n_layers`` at every position brings to the host."""
    return positions * n_layers * hidden * torch.empty((), dtype=dtype).element_size()


def copy_alone_seconds(nbytes: int, row_bytes: int, device: str, repeats: int = 3) -> tuple[float, float]:
    """(seconds, GB/s): copying ``nbytes`` from the device into pinned host memory (on CPU: into
    other host memory), ``STEP_ROWS`` rows of ``row_bytes`` at a time (one copy per engine
    step, as the plugin does); best of ``repeats``."""
    chunk = min(nbytes, STEP_ROWS * row_bytes)
    if chunk <= 0:
        return 0.0, 0.0
    src = torch.empty(chunk, dtype=torch.uint8, device=device)
    src.fill_(1)
    dst = torch.empty(chunk, dtype=torch.uint8, pin_memory=device == "cuda")
    copies, rest = divmod(nbytes, chunk)
    best = float("inf")
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        started = time.perf_counter()
        for _ in range(copies):
            dst.copy_(src, non_blocking=True)
        if rest:
            dst[:rest].copy_(src[:rest], non_blocking=True)
        if device == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - started)
    return best, nbytes / best / 1e9 if best > 0 else 0.0


def copy_note(positions: int, n_layers: int, hidden: int, dtype: torch.dtype, device: str) -> str:
    """The bytes a capture moved and what that copy costs alone, for a row's note."""
    moved = bytes_moved(positions, n_layers, hidden, dtype)
    seconds, rate = copy_alone_seconds(moved, moved // max(positions, 1), device)
    return f"{n_layers} layer(s) x {positions} positions = {moved / 1e9:.3f} GB moved; the copy alone {seconds:.3f} s ({rate:.1f} GB/s)"
