"""``scripts/gpu_suite.sh`` runs the default suite on the lent GPU machine in parts: together they
must hold every test. Each test file is named by exactly one part (3d takes the files no other
part names), or split between parts by test ids (``tests/x.py::test_y``) that together collect
exactly the file's tests, none twice. A test added to a split file and to none of its ids would
otherwise never run on the GPU."""

from __future__ import annotations

import os
import subprocess
import sys
from collections import Counter, defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def suite_parts() -> dict[str, list[str]]:
    """``PART=list``: each part's test files or ids."""
    done = subprocess.run(
        ["bash", str(REPO / "scripts" / "gpu_suite.sh")],
        env={**os.environ, "PART": "list", "SUITE_SRC": str(REPO)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    parts = {}
    for line in done.stdout.splitlines():
        name, _, entries = line.partition(":")
        parts[name] = entries.split()
    return parts


def collected(args: list[str]) -> list[str]:
    """The default suite's test ids that pytest collects from ``args`` (files or ids)."""
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "--collect-only",
            "-q",
            "-p",
            "no:cacheprovider",
            "-o",
            "addopts=",
            "-m",
            "not slow and not gpu",
            *args,
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return [line for line in done.stdout.splitlines() if "::" in line]


def test_the_parts_hold_every_test_once() -> None:
    parts = suite_parts()
    assert {"1", "2a", "3d", "solo"} <= set(parts) and all(parts.values()), parts
    whole: Counter[str] = Counter()
    split: dict[str, list[str]] = defaultdict(list)
    for entries in parts.values():
        for entry in entries:
            if "::" in entry:
                split[entry.split("::")[0]].append(entry)
            else:
                whole[entry] += 1
    tests = REPO / "tests"
    files = sorted(path.relative_to(REPO).as_posix() for path in tests.rglob("test_*.py") if (tests / "scripts") not in path.parents)
    assert sorted(set(whole) | set(split)) == files, "a test file in no part (or a part naming a missing file)"
    assert [f for f, n in whole.items() if n > 1] == [], "a test file named by two parts"
    assert set(whole).isdisjoint(split), "a file both whole in one part and split by ids"
    assert split, "no file is split by test ids (then this test checks nothing of them: drop that half)"
    for path, ids in split.items():
        by_ids = collected(ids)
        assert len(by_ids) == len(set(by_ids)), f"{path}: a test named by two parts"
        assert sorted(by_ids) == sorted(collected([path])), f"{path}: the parts' test ids do not collect the file's tests"
