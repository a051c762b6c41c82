"""The hand-off directory is shared with every user and container on the host (``/dev/shm``):
what others put there under our names is skipped, never followed, never waited on, never fatal,
and files of another pid namespace are never touched (``handoff_files``). Each test failed
before: a FIFO named like a marker hung the frontend's start, a symlink was followed, another
user's file was read and deleted (as root) or failed every capture (EPERM), a claimed name that
was a symlink mapped the file it pointed to, another container's files whose pids were free here
were deleted."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from lens_evals.engine.transport import handoff
from lens_evals.engine.transport.handoff import HandoffTarget, claim
from lens_evals.engine.transport.handoff_files import MARKER_PREFIX, NAMESPACE, ROWS_PREFIX, SEGMENT_PREFIX, marker_name

NOBODY = 65534


@pytest.fixture(scope="module")
def dead_pid() -> int:
    """A pid no process has now (a child that has exited)."""
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True)
    return int(done.stdout)


def rows_name(pid: int, tag: str, prefix: str = ROWS_PREFIX, namespace: str = NAMESPACE) -> str:
    return f"{prefix}{namespace}-{pid}-{tag * 32}"


def start_frontend(directory: Path) -> HandoffTarget:
    """A frontend starting on ``directory`` (it sweeps first), on a thread: a sweep that blocks
    fails the test in 20 s instead of hanging it."""
    made: list[HandoffTarget] = []
    thread = threading.Thread(target=lambda: made.append(HandoffTarget(str(directory))), daemon=True)
    thread.start()
    thread.join(20)
    blocked = thread.is_alive()
    if blocked:  # let the thread end: a writer opens and closes each FIFO, its reader sees the end
        for fifo in (path for path in directory.iterdir() if path.is_fifo()):
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        thread.join(20)
    assert not blocked, "the frontend's sweep blocked"
    os.unlink(made[0].marker)
    return made[0]


def test_a_fifo_named_like_a_marker_does_not_block_the_frontend(tmp_path: Path, dead_pid: int) -> None:
    fifo = tmp_path / marker_name("a" * 32)
    os.mkfifo(fifo)
    stale = tmp_path / marker_name("b" * 32)
    stale.write_text(str(dead_pid))
    start_frontend(tmp_path)
    assert fifo.is_fifo() and not stale.exists()  # skipped; the dead frontend's marker still swept


def test_a_symlink_named_like_a_marker_or_row_file_is_not_followed(tmp_path: Path, dead_pid: int) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    target = elsewhere / "a dead pid"
    target.write_text(str(dead_pid))
    links = [tmp_path / marker_name("a" * 32), tmp_path / rows_name(dead_pid, "1")]
    for link in links:
        link.symlink_to(target)
    start_frontend(tmp_path)
    assert all(link.is_symlink() for link in links) and target.read_text() == str(dead_pid)


@pytest.mark.skipif(os.geteuid() != 0, reason="making another user's file takes root (CI runs tests as root)")
def test_another_users_files_are_skipped_not_deleted(tmp_path: Path, dead_pid: int) -> None:
    names = [marker_name("a" * 32), rows_name(dead_pid, "1"), rows_name(dead_pid, "2", SEGMENT_PREFIX)]
    for name in names:
        (tmp_path / name).write_text(str(dead_pid))
        os.chown(tmp_path / name, NOBODY, NOBODY)
    mine = tmp_path / rows_name(dead_pid, "3")
    mine.write_text("rows")
    start_frontend(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(names)  # only this user's dead file went


def test_a_claimed_name_that_is_not_a_plain_file_of_ours_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The frontend claims a row file a reply names: a symlink there is not followed, a FIFO does
    not block, another user's file is not mapped; that block's request fails (ValueError) alone."""
    monkeypatch.setenv(handoff.DIR_ENV, str(tmp_path))
    monkeypatch.setattr(HandoffTarget, "_current", None)
    HandoffTarget.address()
    secret = tmp_path / "secret"
    secret.write_bytes(b"12345678")
    link, fifo, foreign = (tmp_path / rows_name(os.getpid(), tag) for tag in "abc")
    link.symlink_to(secret)
    os.mkfifo(fifo)
    foreign.write_bytes(b"12345678")
    refused = [link, fifo]
    if os.geteuid() == 0:  # another user's file (as root, it could be opened)
        os.chown(foreign, NOBODY, NOBODY)
        refused.append(foreign)
    try:
        for path in refused:
            with pytest.raises(ValueError, match="hand-off file"):
                claim({"file": path.name, "nbytes": 8, "dtype": "uint8", "shape": [8]})
            assert os.path.lexists(path)  # not deleted either
    finally:
        os.unlink(HandoffTarget._current.marker)


def test_files_of_another_pid_namespace_are_never_touched(tmp_path: Path, dead_pid: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Containers sharing ``/dev/shm`` (``--ipc=host``) have pids of their own: a pid free here
    may be a live process there. Their names (another namespace token, or none: lens-evals before
    the token) are not swept, not claimed, and a worker does not take their marker for its
    frontend's; this namespace's dead files still go."""
    other = "0" * 16 if NAMESPACE != "0" * 16 else "1" * 16
    theirs = [
        f"{MARKER_PREFIX}{other}-{'a' * 32}",
        rows_name(dead_pid, "1", namespace=other),
        rows_name(dead_pid, "2", SEGMENT_PREFIX, namespace=other),
        f"{MARKER_PREFIX}{'b' * 32}",  # the names before the token
        f"{ROWS_PREFIX}{dead_pid}-{'3' * 32}",
        f"{SEGMENT_PREFIX}{dead_pid}-{'4' * 32}",
    ]
    mine = [marker_name("c" * 32), rows_name(dead_pid, "5"), rows_name(dead_pid, "6", SEGMENT_PREFIX)]
    for name in theirs + mine:
        (tmp_path / name).write_text(str(dead_pid))
    start_frontend(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(theirs)
    monkeypatch.setenv(handoff.DIR_ENV, str(tmp_path))
    monkeypatch.setattr(HandoffTarget, "_current", None)
    HandoffTarget.address()
    try:
        for name in theirs[1:3]:
            kind = "file" if name.startswith(ROWS_PREFIX) else "pool"
            with pytest.raises(ValueError, match="unexpected hand-off"):
                claim({kind: name, "offset": 0, "nbytes": 8, "dtype": "uint8", "shape": [8]})
    finally:
        os.unlink(HandoffTarget._current.marker)
    assert handoff.pool_for({"dir": str(tmp_path), "token": "a" * 32, "pid": -1}) is None  # only their marker
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(theirs)
