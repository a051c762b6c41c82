"""Hand-off pool regions and mappings (no engine): a segment whose worker exited is unmapped
once its last tensor dies, not held for the life of the process (segments made here, one renamed
to a dead worker's pid), and an empty block never shares a live block's region."""

from __future__ import annotations

import gc
import os
import subprocess
import sys

import numpy as np

from lens_evals.engine.transport import handoff_files, handoff_pool


def _mapped(name: str) -> bool:
    with open("/proc/self/maps") as maps:
        return any(name in line for line in maps)


def test_segments_of_an_exited_worker_are_unmapped_after_their_last_view(tmp_path) -> None:
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True)
    rows = np.arange(1024, dtype=np.float32)
    segments = {}
    for owner in ("dead", "live"):  # the live one is this process's
        segment = handoff_pool._Segment(str(tmp_path), handoff_pool.ALIGN * 4)
        segment.map[: rows.nbytes] = rows.tobytes()
        segment.map.close()  # the worker's mapping: gone with the worker
        if owner == "dead":
            name = segment.name.replace(f"-{os.getpid()}-", f"-{int(dead.stdout)}-")
            os.rename(segment.path, tmp_path / name)
        segments[owner] = segment.name if owner == "live" else name
    views = handoff_pool.PoolViews()
    packed = {owner: {"pool": name, "offset": 0, "nbytes": rows.nbytes} for owner, name in segments.items()}
    held = views.view(str(tmp_path), packed["dead"], source=0)
    live = views.view(str(tmp_path), packed["live"], source=0)
    assert views.take_freed(0) == [] and segments["live"] in views.maps
    assert segments["dead"] not in views.maps  # forgotten: its worker exited (was kept forever)
    assert _mapped(segments["dead"]) and np.array_equal(held.view(np.float32), rows)  # a live tensor keeps it
    del held, live
    gc.collect()
    assert not _mapped(segments["dead"])  # the memory is back
    assert views.take_freed(0) == [[segments["live"], 0]]  # only the live worker hears of its region


def test_an_empty_block_gets_a_region_of_its_own(tmp_path) -> None:
    """A 0-byte block (``LENS_EVALS_HANDOFF_MIN_BYTES=0``) took no room, so the next block got
    the same offset, and freeing the empty one freed the live block under its tensor."""
    segment = handoff_pool._Segment(str(tmp_path), handoff_pool.ALIGN * 4)
    empty, live = segment.take(0), segment.take(100)
    assert empty is not None and live is not None and empty != live
    assert segment.give(empty)
    assert segment.take(100) != live  # the live block's region is still taken
    segment.map.close()


def test_a_worker_exiting_after_its_frontend_was_killed_removes_the_frontends_marker(tmp_path, monkeypatch) -> None:
    """A frontend killed hard (SIGKILL) runs no exit handler; its engine's worker exits after it
    and now removes the dead frontend's marker too (it stayed in /dev/shm until another
    frontend started there)."""
    from lens_evals.engine.transport import handoff

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True)
    marker = tmp_path / handoff_files.marker_name("a" * 32)
    marker.write_text(dead.stdout.strip())
    live = tmp_path / handoff_files.marker_name("b" * 32)
    live.write_text(str(os.getpid()))
    pool = handoff_pool.SharedPool(str(tmp_path), str(marker))
    monkeypatch.setattr(handoff, "_files", handoff._WorkerFiles({}, set(), {"a" * 32: pool}))
    handoff._cleanup_unclaimed()
    assert not marker.exists() and live.exists()
