"""What a system's process measures and hands back, and helpers every system runner shares."""

from __future__ import annotations

import json
import resource
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import torch

T = TypeVar("T")
# A system's result as it crosses processes as JSON (child -> launcher -> checks -> report): which
# keys it holds depends on the system, its status and the checks, so its values are as JSON gives them.
Result = dict[str, Any]


class SystemUnavailable(RuntimeError):
    """The system cannot run here (not installed, not supported on this device): its row says why."""


@dataclass
class Measured:
    start_seconds: float  # load / engine start, not timed with the work
    warmup_seconds: float
    seconds: float  # the best timed run over every prompt
    token_ids: list[list[int]]  # generated ids per prompt, in prompt order
    samples: dict[int, torch.Tensor] = field(default_factory=dict)  # prompt -> (positions, hidden) at the layer
    notes: list[str] = field(default_factory=list)
    all_seconds: list[float] = field(default_factory=list)  # every timed run
    runs_agree: int | None = None  # prompts whose outputs were equal in the first and last timed run
    interleaved: dict[str, Any] = field(default_factory=dict)  # lens-mixed systems: times per feature and summary


def best_of(repeats: int, run: Callable[[], T]) -> tuple[float, list[float], T]:
    """Run ``repeats`` times (at least once): (best seconds, every run's seconds, last result)."""
    times: list[float] = []
    result: T | None = None
    for _ in range(max(1, repeats)):
        started = time.perf_counter()
        result = run()
        times.append(time.perf_counter() - started)
    return min(times), times, result  # type: ignore[return-value]


class Stopwatch:
    def __init__(self) -> None:
        self.seconds = 0.0

    @contextmanager
    def timing(self, sync_cuda: bool = False) -> Iterator[None]:
        if sync_cuda and torch.cuda.is_available():
            torch.cuda.synchronize()
        started = time.perf_counter()
        try:
            yield
        finally:
            if sync_cuda and torch.cuda.is_available():
                torch.cuda.synchronize()
            self.seconds = time.perf_counter() - started


def torch_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown torch dtype {name!r}")
    return dtype


def left_pad(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """(input_ids, attention_mask, pad per row) with the prompts right-aligned."""
    width = max(len(p) for p in prompts)
    pads = [width - len(p) for p in prompts]
    ids = torch.tensor([[pad_id] * pad + p for p, pad in zip(prompts, pads)], dtype=torch.long)
    mask = torch.tensor([[0] * pad + [1] * len(p) for p, pad in zip(prompts, pads)], dtype=torch.long)
    return ids, mask, pads


def package_version(name: str) -> str:
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "not installed"


def own_max_rss_bytes() -> int:
    """This process's and its waited-for children's peak RSS (Linux reports KiB)."""
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return int(max(own, children) * 1024)


def write_result(path: Path, result: Result) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".partial")
    tmp.write_text(json.dumps(result))
    tmp.replace(path)
