"""A reused shared pool for the row hand-off: memory touched once, written at copy speed after.

A new file for every fetched block costs more in first-touch page faults than in copying (on the
lent H200's host and this CPU machine, writing 258 MiB into fresh pages takes 150-250 ms, into
pages touched before 25-30 ms). So a worker keeps, per frontend, a few shared segment files
(64 MiB, or one block's size) in the frontend's hand-off directory, maps them once, and copies
each block into a free region of one; the reply names the segment and offset. The frontend maps
each segment once (and deletes its name: only the two mappings remain), returns tensors that are
views of their region, and when such a tensor is freed (``weakref.finalize`` on the region's
array) reports the region free with its next fetch; the worker then reuses it. A tensor the user
keeps keeps its region; beyond ``LENS_EVALS_HANDOFF_POOL_MIB`` (default 4096) of segments per
frontend, blocks go to files of their own (``handoff``). A frontend's pool is dropped when its
marker file is gone (the frontend exited); a frontend forgets the segments of a worker that
exited (checked at each fetch), so their memory goes back with their last tensor. A pool that
took or gave no region for ``LENS_EVALS_HANDOFF_POOL_IDLE_S`` gives back the pages of its free
regions but the first segment's (``trim``, from a daemon thread: the pool would otherwise keep a
large capture's memory as long as the frontend runs); a region of a trimmed segment takes its
pages again before it is written (``posix_fallocate``: ENOSPC then, the block going elsewhere,
never SIGBUS mid-copy on a full tmpfs).
"""

from __future__ import annotations

import bisect
import logging
import mmap
import os
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np

from lens_evals import settings
from lens_evals.engine.transport.handoff_files import SEGMENT_NAME, SEGMENT_PREFIX, alive, map_and_unlink, new_name

logger = logging.getLogger("lens_evals")
POOL_ENV = settings.HANDOFF_POOL_MIB.name
SEGMENT_BYTES = 64 * 2**20
ALIGN = 4096
ROOM_MARGIN = 256 << 20  # leave this much free in the hand-off directory (segments and files)


def free_bytes(directory: str) -> int:
    """Free bytes in ``directory``; 0 when it cannot be read (the rows then go inline)."""
    try:
        stats = os.statvfs(directory)
    except OSError as exc:
        logger.warning("lens_evals: hand-off directory %s is unusable (%s)", directory, exc)
        return 0
    return stats.f_bavail * stats.f_frsize


class _Segment:
    """One shared file, mapped by the worker, with its free regions (sorted, coalesced)."""

    def __init__(self, directory: str, size: int) -> None:
        self.name = new_name(SEGMENT_PREFIX)
        self.path = os.path.join(directory, self.name)
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.posix_fallocate(self.fd, 0, size)  # the memory now, or ENOSPC now (not SIGBUS later)
            self.map = mmap.mmap(self.fd, size)
        except OSError:
            os.unlink(self.path)
            os.close(self.fd)
            raise
        self.size = size
        self.free_starts: list[int] = [0]
        self.free_lengths: dict[int, int] = {0: size}
        self.used: dict[int, int] = {}  # offset -> length
        self.punched = False  # free regions may have given their pages back (``trim_free``)

    def trim_free(self) -> int:
        """Give back the pages of every free region (every mapping then reads zeros there); the
        bytes of those regions. An OSError where the file system cannot."""
        freed = 0
        for start in self.free_starts:
            self.map.madvise(mmap.MADV_REMOVE, start, self.free_lengths[start])  # ALIGN-aligned ranges
            freed += self.free_lengths[start]
        self.punched = self.punched or freed > 0
        return freed

    def allocated_bytes(self) -> int:
        return os.fstat(self.fd).st_blocks * 512

    def take(self, nbytes: int) -> int | None:
        size = max(1, -(-nbytes // ALIGN)) * ALIGN  # an empty block too: else it shares the next one's offset
        # first fit: low offsets stay in use, pages stay warm
        start = next((start for start in self.free_starts if self.free_lengths[start] >= size), None)
        if start is None:
            return None
        if self.punched:  # its pages again first: ENOSPC now, not SIGBUS mid-copy on a full tmpfs
            try:
                os.posix_fallocate(self.fd, start, size)
            except OSError as exc:  # the block goes elsewhere
                logger.warning("lens_evals: hand-off pool segment %s has no room for a region again (%s)", self.name, exc)
                return None
        length = self.free_lengths.pop(start)
        self.free_starts.remove(start)
        if length > size:
            bisect.insort(self.free_starts, start + size)
            self.free_lengths[start + size] = length - size
        self.used[start] = size
        return start

    def shrink(self, offset: int, nbytes: int) -> None:
        size = self.used[offset]
        keep = max(1, -(-nbytes // ALIGN)) * ALIGN
        if keep < size:
            # the tail becomes a region of its own, then free
            self.used[offset], self.used[offset + keep] = keep, size - keep
            self.give(offset + keep)

    def give(self, offset: int) -> bool:
        size = self.used.pop(offset, None)
        if size is None:
            return False
        index = bisect.bisect(self.free_starts, offset)
        after = offset + size
        if index < len(self.free_starts) and self.free_starts[index] == after:  # join the next region
            size += self.free_lengths.pop(after)
            self.free_starts.pop(index)
        if index > 0:  # join the previous region
            before = self.free_starts[index - 1]
            if before + self.free_lengths[before] == offset:
                self.free_lengths[before] += size
                return True
        self.free_starts.insert(index, offset)
        self.free_lengths[offset] = size
        return True


class SharedPool:
    """A worker's segments for one frontend (thread-safe: fetches write on several threads)."""

    def __init__(self, directory: str, marker: str) -> None:
        self.directory = directory
        self.marker = marker
        self.segments: dict[str, _Segment] = {}
        self.lock = threading.Lock()
        self.last_use = time.monotonic()  # a region taken or given
        self.trimmed = True  # nothing freed since the last trim

    @property
    def limit(self) -> int:
        return settings.HANDOFF_POOL_MIB.in_bytes()

    @property
    def pooled_bytes(self) -> int:
        return sum(segment.size for segment in self.segments.values())

    def release(self, regions: Any) -> int:
        """Regions the frontend no longer uses: ``[[segment name, offset], ...]``; how many were
        in use here and are free now."""
        given = 0
        with self.lock:
            for region in regions if isinstance(regions, list) else []:
                if isinstance(region, (list, tuple)) and len(region) == 2 and region[0] in self.segments:
                    given += self.segments[region[0]].give(int(region[1]))
            if given:
                self._used_now()
        return given

    def _used_now(self) -> None:
        self.last_use, self.trimmed = time.monotonic(), False

    def write(self, rows: Any) -> dict[str, Any] | None:
        """``rows`` (``handoff.Rows``) copied into a free region: the reply's reference (None:
        the pool is full)."""
        with self.lock:
            place = self._allocate(rows.nbytes)
        if place is None:
            return None
        segment, offset = place
        view = memoryview(segment.map)[offset : offset + rows.nbytes]
        try:
            rows.copy_into(view)
        finally:
            view.release()
        return {"pool": segment.name, "offset": offset, "nbytes": rows.nbytes}

    def take_region(self, nbytes: int) -> tuple[str, int, np.ndarray] | None:
        """A free region of ``nbytes`` to be written later (``stream_write``: a request's rows
        as they come): its segment name, offset and bytes (None: the pool is full)."""
        with self.lock:
            place = self._allocate(nbytes)
        if place is None:
            return None
        segment, offset = place
        return segment.name, offset, np.frombuffer(segment.map, dtype=np.uint8, count=nbytes, offset=offset)

    def shrink(self, name: str, offset: int, nbytes: int) -> None:
        """Keep the first ``nbytes`` of a region taken here, the rest free again."""
        with self.lock:
            self.segments[name].shrink(offset, nbytes)
            self._used_now()

    def give_region(self, name: str, offset: int) -> None:
        """A region taken here and never named in a reply, free again."""
        with self.lock:
            segment = self.segments.get(name)
            if segment is not None:
                segment.give(offset)
                self._used_now()

    def read_back(self, packed: dict[str, Any], keep: bool = True) -> bytearray | None:
        """The bytes of a region this worker wrote (``write``'s reply) and no frontend will
        claim (``keep=False``: the rows are dropped, nothing is read); the region is free again."""
        name, offset, nbytes = packed.get("pool"), int(packed.get("offset", -1)), int(packed.get("nbytes", -1))
        segment = self.segments.get(str(name))
        if segment is None or offset < 0 or offset + nbytes > segment.size:
            raise ValueError(f"no region {offset}+{nbytes} in hand-off pool segment {name!r}")
        data = bytearray(segment.map[offset : offset + nbytes]) if keep else None
        with self.lock:
            segment.give(offset)
            self._used_now()
        return data

    def _allocate(self, nbytes: int) -> tuple[_Segment, int] | None:
        self._used_now()
        for segment in self.segments.values():
            offset = segment.take(nbytes)
            if offset is not None:
                return segment, offset
        size = max(SEGMENT_BYTES, -(-nbytes // ALIGN) * ALIGN)
        if self.pooled_bytes + size > self.limit or free_bytes(self.directory) < size + ROOM_MARGIN:
            return None
        try:
            segment = _Segment(self.directory, size)
        except OSError as exc:
            logger.warning("lens_evals: no hand-off pool segment of %d bytes in %s (%s)", size, self.directory, exc)
            return None
        self.segments[segment.name] = segment
        offset = segment.take(nbytes)
        assert offset == 0, "a new segment is at least the block's size"
        return segment, offset

    def trim(self, idle_seconds: float | None = None) -> int:
        """Once no region was taken or given for ``idle_seconds`` (default
        ``LENS_EVALS_HANDOFF_POOL_IDLE_S``), the free regions of every segment but the first give
        their pages back (once per idle spell); the bytes of those regions."""
        idle = settings.HANDOFF_POOL_IDLE_S.get() if idle_seconds is None else idle_seconds
        trimmed = 0
        with self.lock:
            if self.trimmed or time.monotonic() - self.last_use < idle:
                return 0
            self.trimmed = True
            for segment in list(self.segments.values())[1:]:
                try:
                    trimmed += segment.trim_free()
                except OSError as exc:
                    logger.info("lens_evals: hand-off pool segment %s keeps its memory (%s)", segment.name, exc)
        return trimmed

    def allocated_bytes(self) -> int:
        """The bytes the segments' files hold pages for (what trimming gives back, and takes again)."""
        with self.lock:
            return sum(segment.allocated_bytes() for segment in self.segments.values())

    def segment_paths(self) -> list[str]:
        return [segment.path for segment in self.segments.values()]

    def close(self) -> None:
        with self.lock:  # not under a trim
            for segment in self.segments.values():
                try:
                    segment.map.close()
                except BufferError:  # a block still being written views it (``stream_write``)
                    logger.info("lens_evals: hand-off pool segment %s stays mapped until its last block is done", segment.name)
                os.close(segment.fd)
            self.segments.clear()


class _Trimmer:
    """One daemon thread per worker process trimming its pools (``SharedPool.trim``) a few times
    per idle period, so a worker left idle after a large capture gives the memory back too."""

    def __init__(self) -> None:
        self.thread: threading.Thread | None = None
        self.pools: Callable[[], list[SharedPool]] = list

    def start(self, pools: Callable[[], list[SharedPool]]) -> None:
        self.pools = pools
        if self.thread is None or not self.thread.is_alive():  # a forked child has none running
            self.thread = threading.Thread(target=self._run, name="lens_evals-pool-trim", daemon=True)
            self.thread.start()

    def _run(self) -> None:
        while True:
            try:
                idle = settings.HANDOFF_POOL_IDLE_S.get()
            except ValueError as exc:  # a bad value: said once per period, nothing trimmed
                logger.warning("lens_evals: hand-off pools not trimmed: %s", exc)
                time.sleep(60.0)
                continue
            time.sleep(min(max(idle / 4, 1.0), 60.0))
            for pool in self.pools():
                try:
                    trimmed = pool.trim()
                except (OSError, ValueError) as exc:  # a pool closed meanwhile: its maps are gone
                    logger.info("lens_evals: hand-off pool not trimmed (%s)", exc)
                    continue
                if trimmed:
                    logger.debug("lens_evals: hand-off pool gave back %d MiB", trimmed >> 20)


trimmer = _Trimmer()


# ----------------------------------------------------------------- frontend side
class PoolViews:
    """The frontend's mappings of the worker segments it has seen, and the regions freed since
    the last fetch, by source (the engine whose workers own the segment: each engine's fetch
    reports only its own regions, so two engines in one process do not lose each other's)."""

    def __init__(self) -> None:
        self.maps: dict[str, mmap.mmap | bytearray] = {}
        self.sources: dict[str, int] = {}  # segment name -> the engine it came from
        # appended by finalizers, which run whenever the garbage collector does (any thread, even
        # inside take_freed): a deque's append and popleft are atomic, no lock can deadlock
        self.freed: dict[int, deque[list[Any]]] = {}

    def _region_freed(self, region: list[Any]) -> None:
        source = self.sources.get(region[0])
        if source is not None:  # else its worker exited (``_forget_exited``): nobody to tell
            self.freed[source].append(region)

    def _forget_exited(self) -> None:
        """Drop the mappings of segments whose worker exited (its engine shut down): no region
        of theirs comes again, and a segment's memory (64 MiB or more) goes back once the last
        tensor viewing it dies, instead of staying for the life of this process."""
        for name in list(self.maps):
            owner = SEGMENT_NAME.match(name)  # always: ``view`` maps no other name
            if owner is not None and not alive(int(owner.group(1))):
                del self.maps[name]
                self.sources.pop(name, None)

    def has_freed(self, source: int) -> bool:
        return bool(self.freed.get(source))

    def take_freed(self, source: int) -> list[list[Any]]:
        self._forget_exited()
        freed = self.freed.get(source)
        taken = []
        while freed:
            taken.append(freed.popleft())
        return taken

    def view(self, directory: str, packed: dict[str, Any], source: int) -> np.ndarray:
        """The bytes of a pooled block, as an array that frees its region when it dies."""
        name, offset, nbytes = packed.get("pool"), int(packed.get("offset", -1)), int(packed.get("nbytes", -1))
        if not isinstance(name, str) or not SEGMENT_NAME.match(name):
            raise ValueError(f"unexpected hand-off pool segment {name!r}")
        mapping = self.maps[name] if name in self.maps else self._open(directory, name, source)
        if offset < 0 or nbytes < 0 or offset + nbytes > len(mapping):
            raise ValueError(f"hand-off region {offset}+{nbytes} is outside segment {name} ({len(mapping)} bytes)")
        array = np.frombuffer(mapping, dtype=np.uint8, count=nbytes, offset=offset)
        weakref.finalize(array, self._region_freed, [name, offset])
        return array

    def _open(self, directory: str, name: str, source: int) -> mmap.mmap | bytearray:
        mapping = self.maps[name] = map_and_unlink(os.path.join(directory, name))
        self.sources[name] = source
        self.freed.setdefault(source, deque())
        return mapping
