"""Where the plugin's own host time goes, by phase, when ``LENS_EVALS_TIMING=1``: wall time of
our code only (no device synchronisation is added, so queued GPU work is not counted). Each
process logs its totals when results are fetched, then starts again from zero."""

from __future__ import annotations

import sys
import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext

from lens_evals import settings

ENABLED = settings.TIMING.get()  # read once, when the process imports the engine
_seconds: dict[str, float] = defaultdict(float)
_calls: dict[str, int] = defaultdict(int)
_lock = threading.Lock()  # the worker's early writes are timed on a thread of their own
_collecting = False  # a caller in this process reads the totals (``collect``): no log at fetch


_OFF = nullcontext()
DETAIL = "  · "  # a phase timed inside another (its time is also its parent's): not summed with the others


def phase(name: str) -> AbstractContextManager[None]:
    """Time a block under ``name`` (a shared no-op context when timing is off)."""
    return _timed(name) if ENABLED else _OFF


@contextmanager
def _timed(name: str) -> Iterator[None]:
    started = time.perf_counter()
    try:
        yield
    finally:
        elapsed = time.perf_counter() - started
        with _lock:
            _seconds[name] += elapsed
            _calls[name] += 1


def collect() -> None:
    """Time every phase from now on and keep the totals for :func:`take` (the worker must run in
    this process: an in-process engine); fetches then log nothing."""
    global ENABLED, _collecting
    ENABLED = _collecting = True


def take() -> dict[str, tuple[float, int]]:
    """The totals since the last ``take`` (name -> (seconds, calls)), and start again from zero."""
    with _lock:
        totals = {name: (_seconds[name], _calls[name]) for name in _seconds}
        _seconds.clear()
        _calls.clear()
    return totals


def log_and_reset(where: str) -> None:
    if not ENABLED or _collecting:
        return
    with _lock:
        if not _seconds:
            return
        parts = ", ".join(f"{name} {_seconds[name] * 1e3:.1f} ms / {_calls[name]}" for name in sorted(_seconds))
        _seconds.clear()
        _calls.clear()
    # straight to stderr: the engine process may route or filter library loggers
    print(f"lens_evals timing ({where}): {parts}", file=sys.stderr, flush=True)
