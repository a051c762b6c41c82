"""A pytest plugin for the GPU suite (``scripts/gpu_suite.sh`` loads it with ``-p tests.run_ledger``):
a test stuck past ``LENS_EVALS_TEST_HANG_EXIT_S`` seconds prints every thread's stack and ends
its pytest process, and ``LENS_EVALS_TEST_LEDGER`` (a file) records which tests started and ended,
so that the script's next pytest process runs only the tests not yet started.

Why: on the H200 (2026-12-04) a test hung inside vLLM with no word from pytest-timeout for the
rest of a 9-minute call, and another's timeout was swallowed by a finalizer: pytest-timeout's
signal method needs the main thread back in Python. ``faulthandler``'s watchdog is a C thread
that needs neither the GIL nor the main thread, so the stacks come out and the call goes on.

``python -m tests.run_ledger hung LEDGER`` prints the test that started and never ended, if any.
"""

from __future__ import annotations

import faulthandler
import os
import sys
from pathlib import Path
from typing import IO, Any

import pytest

LEDGER_ENV = "LENS_EVALS_TEST_LEDGER"
HANG_ENV = "LENS_EVALS_TEST_HANG_EXIT_S"
_stacks: list[IO[str]] = []  # the open file the watchdog writes to (kept open for its C thread)


def _ledger() -> Path | None:
    path = os.environ.get(LEDGER_ENV)
    return Path(path) if path else None


def _entries(ledger: Path) -> list[tuple[str, str]]:
    """(``start`` or ``end``, node id) in order. Node ids hold no newline (pytest escapes them)."""
    if not ledger.exists():
        return []
    return [(kind, nodeid) for kind, _, nodeid in (line.partition(" ") for line in ledger.read_text().splitlines()) if nodeid]


def hung_test(ledger: Path) -> str | None:
    """The last test that started and never ended: the one whose process was ended."""
    entries = _entries(ledger)
    if entries and entries[-1][0] == "start":
        return entries[-1][1]
    return None


def _note(kind: str, nodeid: str) -> None:
    ledger = _ledger()
    if ledger is not None:
        with ledger.open("a") as file:
            file.write(f"{kind} {nodeid}\n")


def pytest_configure(config: pytest.Config) -> None:
    ledger = _ledger()
    if ledger is not None and float(os.environ.get(HANG_ENV, "0")) > 0:
        _stacks.append(ledger.with_suffix(".stacks").open("w"))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Leave out every test an earlier process of this run started (ended or hung)."""
    ledger = _ledger()
    if ledger is None:
        return
    started = {nodeid for _, nodeid in _entries(ledger)}
    done = [item for item in items if item.nodeid in started]
    if done:
        config.hook.pytest_deselected(items=done)
        items[:] = [item for item in items if item.nodeid not in started]


def pytest_runtest_logstart(nodeid: str, location: Any) -> None:
    _note("start", nodeid)
    if _stacks:  # the file holds the running test's stacks only
        _stacks[0].seek(0)
        _stacks[0].truncate()
        _stacks[0].write(f"--- {nodeid} ---\n")
        _stacks[0].flush()
        faulthandler.dump_traceback_later(float(os.environ[HANG_ENV]), exit=True, file=_stacks[0])


def pytest_runtest_logfinish(nodeid: str, location: Any) -> None:
    if _stacks:
        faulthandler.cancel_dump_traceback_later()
    _note("end", nodeid)


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] != "hung":
        sys.exit("usage: python -m tests.run_ledger hung LEDGER")
    print(hung_test(Path(sys.argv[2])) or "")
