"""tests/run_ledger.py, the GPU suite's guard against tests that hang where pytest-timeout cannot
reach them: a scratch suite whose second test blocks in C holding the GIL (as a stuck CUDA or
NCCL call can) is run twice the way scripts/gpu_suite.sh runs a part."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from tests.run_ledger import hung_test

SCRATCH = """
import ctypes

def test_first():
    pass

def test_stuck_in_c_with_the_gil():
    ctypes.PyDLL(None).sleep(60)  # C, GIL held: no Python signal handler can run

def test_after():
    pass
"""
REPO = Path(__file__).resolve().parent.parent


def run_part(tmp_path: Path, ledger: Path) -> tuple[subprocess.CompletedProcess[str], float]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "LENS_EVALS_TEST_LEDGER": str(ledger), "LENS_EVALS_TEST_HANG_EXIT_S": "2"}
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "tests.run_ledger", "-v", "-o", "addopts=", "test_scratch.py"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    return done, time.monotonic() - started


def test_a_hung_test_is_named_with_its_stack_and_the_next_process_runs_the_rest(tmp_path) -> None:
    (tmp_path / "test_scratch.py").write_text(SCRATCH)
    ledger = tmp_path / "part.ledger"
    first, seconds = run_part(tmp_path, ledger)
    assert first.returncode != 0 and seconds < 40, first.stdout[-2000:]  # ended by the watchdog, not the 60 s sleep
    assert "test_first PASSED" in first.stdout and "test_after" not in first.stdout
    assert hung_test(ledger) == "test_scratch.py::test_stuck_in_c_with_the_gil"
    stacks = ledger.with_suffix(".stacks").read_text()
    assert stacks.startswith("--- test_scratch.py::test_stuck_in_c_with_the_gil ---") and 'test_scratch.py", line 8' in stacks

    second, _ = run_part(tmp_path, ledger)
    assert second.returncode == 0, second.stdout[-2000:]
    assert "test_after PASSED" in second.stdout and "1 passed, 2 deselected" in second.stdout
    assert hung_test(ledger) is None
