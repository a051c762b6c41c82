"""``scripts/gpu_suite.sh`` fails a part in which a test skipped (issue #45): on the GPU machine a
skip is a test that never ran there (no chromium for the report's page, a refused tmpfs mount),
unless its reason is one the machine has by design (``EXPECTED_GPU_SKIPS``: one GPU for the
two-worker tests). The script runs here for real (``PART=files``) on a test file written for it,
with this interpreter's pytest, and its exit code and output are the ones a GPU call would see."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
EXPECTED = "two workers need 2 GPUs; this machine has 1"


def run_part_with_a_skip(tmp_path: Path, reason: str) -> subprocess.CompletedProcess[str]:
    """``PART=files`` on a file of one passing test and one that skips for ``reason``."""
    test_file = tmp_path / "test_a_part.py"
    test_file.write_text(f"import pytest\n\n\ndef test_runs():\n    pass\n\n\ndef test_skips():\n    pytest.skip({reason!r})\n")
    (tmp_path / "out").mkdir()
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",  # python3: this interpreter's
        "PART": "files",
        "FILES": str(test_file),
        "SUITE_SRC": str(REPO),
        "SUITE_TMP": str(tmp_path),  # not /tmp/pytest-partfiles-0, which a GPU run's PART=files itself may use
        "OUT": str(tmp_path / "out"),
        "LIMIT": "200",
    }
    return subprocess.run(["bash", str(REPO / "scripts" / "gpu_suite.sh")], env=env, capture_output=True, text=True, timeout=240)


@pytest.mark.parametrize("reason", ["no chromium on the lent GPU machine", f"{EXPECTED} (they run on CPU in CI)"])
def test_a_skip_fails_the_part_unless_the_machine_lacks_what_it_needs_by_design(tmp_path: Path, reason: str) -> None:
    done = run_part_with_a_skip(tmp_path, reason)
    log = (tmp_path / "out" / "partfiles.log").read_text()
    assert "1 passed, 1 skipped" in log, log[-3000:]  # the tests ran: the outcome is the skip check's
    if reason.startswith(EXPECTED):
        assert done.returncode == 0 and "FAILED" not in done.stdout, done.stdout[-3000:] + done.stderr[-2000:]
    else:
        assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-2000:]
        assert "FAILED partfiles: tests skipped on the GPU machine, where they must run:" in done.stdout
        assert f"test_a_part.py:9: {reason}" in done.stdout and "FAILED partfiles" in log
