"""Captured rows from a worker to the frontend through a file when both run on one host.

Through ``collective_rpc`` a request's rows are copied four or five times on their way (msgpack
on the engine side, the socket, msgpack on the frontend, a writable copy): for a batch of 8B
captures that is seconds of host time. When the frontend and the worker see the same directory,
the worker instead writes each large block once, straight from its step buffers, into a new file
of the frontend's hand-off directory (tmpfs ``/dev/shm`` when it has room, else the temporary
directory) and sends only its name; the frontend maps the file and deletes its name at once, and
the tensor it returns is backed by that mapping (freed with the tensor). Nothing is unpickled:
the file holds raw rows of the dtype and shape the reply names, and the name must match our own
pattern, with this host's and pid namespace's token (``handoff_files``: containers sharing
``/dev/shm`` never touch each other's files).

The frontend proves it shares the directory with a marker file made once per process
(``HandoffTarget``). A worker that cannot see the marker, a block under
``LENS_EVALS_HANDOFF_MIN_BYTES`` (64 KiB) and a full directory keep the inline bytes. A frontend in
the worker's own process (an in-process engine) takes blocks from the pool too: nothing crosses a
process there, but the pool's memory was touched before, where new bytes for every block are fresh
pages, written at a tenth of the speed (the H100 host: 1.3 against 10.3 GB/s); where the pool has no
room, or the directory is on a disk (its rows would go through the page cache to the disk), it gets
the inline bytes, never a file.
``LENS_EVALS_HANDOFF=0`` turns the hand-off off, ``LENS_EVALS_HANDOFF_DIR`` picks the directory.
Files a frontend never claimed (it died first) are deleted when the worker exits, with the marker of a
frontend that died without its exit handlers.
"""

from __future__ import annotations

import atexit
import logging
import os
import re
import tempfile
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from lens_evals import settings
from lens_evals.engine.transport.handoff_files import (
    MARKER_NAME,
    OWNED_NAME,
    ROWS_NAME,
    ROWS_PREFIX,
    alive,
    in_memory,
    map_and_unlink,
    marker_name,
    new_name,
    own_file_exists,
    read_pid,
    remove_if_own,
)
from lens_evals.engine.transport.handoff_files import remove as _remove
from lens_evals.engine.transport.handoff_pool import ROOM_MARGIN, PoolViews, SharedPool, free_bytes, trimmer
from lens_evals.engine.transport.protocol import HandoffAddressWire, HandoffTargetWire

logger = logging.getLogger("lens_evals")
HANDOFF_ENV = settings.HANDOFF.name
DIR_ENV = settings.HANDOFF_DIR.name
MIN_BYTES_ENV = settings.HANDOFF_MIN_BYTES.name  # smaller blocks go inline: a file costs more than copying them
SHM_DIR = "/dev/shm"
_IOV_MAX = min(os.sysconf("SC_IOV_MAX"), 1024) if hasattr(os, "sysconf") else 16


class Rows(Protocol):
    """A request's packed rows (``store.RowBlocks``): ``nbytes`` in all, as contiguous
    ``blocks`` in order, or copied into a buffer by ``copy_into``."""

    nbytes: int

    @property
    def blocks(self) -> list[Any]: ...

    def copy_into(self, buffer: Any) -> None: ...

    def to_bytearray(self) -> bytearray: ...


# Puts rows where the reply can find them and returns what the reply says about them:
# ``{"data": bytearray}`` inline, ``{"pool": ...}`` or ``{"file": ...}`` shared.
Sink = Callable[[Rows], dict[str, Any]]
# The same, or None: not written (``early_sink_for``: the rows stay for the fetch's sink)
PartialSink = Callable[[Rows], dict[str, Any] | None]


def inline(rows: Rows) -> dict[str, Any]:
    data = rows.to_bytearray()
    if len(data) != rows.nbytes:
        raise ValueError(f"row blocks hold {len(data)} bytes, expected {rows.nbytes}")
    return {"data": data}


def _enabled() -> bool:
    return settings.HANDOFF.get()


def _default_dir() -> str:
    configured = settings.HANDOFF_DIR.get()
    if configured:
        return str(configured)
    if os.path.isdir(SHM_DIR) and os.access(SHM_DIR, os.W_OK) and free_bytes(SHM_DIR) > 2 * ROOM_MARGIN:
        return SHM_DIR
    return tempfile.gettempdir()


# ----------------------------------------------------------------- frontend side
class HandoffTarget:
    """The frontend process's hand-off directory and marker (made on first use, removed at exit)."""

    _current: HandoffTarget | None = None
    claimed = 0  # blocks claimed by this process, from files and the pool (tests and diagnostics)

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.pool_views = PoolViews()
        self.token = uuid.uuid4().hex
        self.marker = os.path.join(directory, marker_name(self.token))
        sweep_stale(directory)
        fd = os.open(self.marker, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)  # as every hand-off file
        with os.fdopen(fd, "w") as marker:
            marker.write(str(os.getpid()))
        atexit.register(_remove, self.marker)

    @classmethod
    def for_this_process(cls, source: int = 0) -> HandoffTargetWire | None:
        """What a fetch call to the workers of engine ``source`` sends them (None: hand-off off
        or no usable directory)."""
        address = cls.address()
        if address is None:
            return None
        assert cls._current is not None
        return address | {"free": cls._current.pool_views.take_freed(source)}  # type: ignore[return-value]

    @classmethod
    def has_freed(cls, source: int = 0) -> bool:
        """Whether regions of engine ``source``'s pool were freed here since its last fetch."""
        return cls._current is not None and cls._current.pool_views.has_freed(source)

    @classmethod
    def address(cls) -> HandoffAddressWire | None:
        """Where this process takes rows (each request's spec names it, see ``early_write``)."""
        if not _enabled():
            return None
        if cls._current is None:
            directory = _default_dir()
            try:
                cls._current = cls(directory)
            except OSError as exc:
                raise RuntimeError(
                    f"lens_evals: cannot use {directory!r} for the row hand-off ({exc}); "
                    f"set {DIR_ENV} to a writable directory or {HANDOFF_ENV}=0"
                ) from exc
        return {"dir": cls._current.directory, "token": cls._current.token, "pid": os.getpid()}


def claim(packed: dict[str, Any], source: int = 0) -> dict[str, Any]:
    """A block the worker left in the shared pool (a view of its region) or in a file of its own
    (mapped, its name deleted: the mapping stays valid)."""
    if "pool" not in packed and "file" not in packed:
        return packed
    target = HandoffTarget._current
    header = {key: value for key, value in packed.items() if key not in ("file", "pool", "offset", "nbytes")}
    if "pool" in packed:
        if target is None:
            raise ValueError("a hand-off pool block came back, but this process sent no hand-off target")
        HandoffTarget.claimed += 1
        return header | {"data": target.pool_views.view(target.directory, packed, source)}
    name = packed["file"]
    directory = target.directory if target is not None else None
    if directory is None or not isinstance(name, str) or not ROWS_NAME.match(name):
        raise ValueError(f"unexpected hand-off file name {name!r}")
    path = os.path.join(directory, name)
    mapping = map_and_unlink(path)
    if len(mapping) != int(packed.get("nbytes", -1)):
        raise ValueError(f"hand-off file {path} has {len(mapping)} bytes, the reply says {packed.get('nbytes')}")
    HandoffTarget.claimed += 1
    return header | {"data": mapping}


def claim_all(rank_results: list[Any], source: int = 0) -> None:
    """Claim every hand-off block in a fetch reply at once (also those of requests that failed
    on another rank), so no file outlives the call and every pool region is tracked."""
    for per_rank in rank_results:
        for result in (per_rank or {}).values():
            for name in ("residual_stream", "probe_scores"):
                if isinstance(result, dict) and isinstance(result.get(name), dict):
                    result[name] = claim(result[name], source)  # inline rows come back as they are


def sweep_stale(directory: str) -> list[str]:
    """Remove what processes that died without their exit handlers (SIGKILL, OOM) left in the
    hand-off ``directory``: markers, row files and pool segments whose owner's pid is gone. Only
    regular files of this user are read or removed (``handoff_files``: a link, a FIFO or another
    user's file under such a name is skipped); a marker without a pid (older versions) is left
    alone. Returns the names removed."""
    removed: list[str] = []
    try:
        names = os.listdir(directory)
    except OSError as exc:
        logger.warning("lens_evals: cannot list hand-off directory %s (%s)", directory, exc)
        return removed
    for name in names:
        path = os.path.join(directory, name)
        owned = OWNED_NAME.match(name)
        pid = int(owned.group(1) or owned.group(2)) if owned else read_pid(path) if MARKER_NAME.match(name) else None
        if pid is not None and not alive(pid) and remove_if_own(path):
            removed.append(name)
    if removed:
        logger.info("lens_evals: removed %d hand-off files of dead processes from %s", len(removed), directory)
    return removed


# ----------------------------------------------------------------- worker side
@dataclass
class _WorkerFiles:
    seen: dict[tuple[str, str], bool]  # (directory, token) -> the marker is visible here
    made: set[str]  # files made and perhaps not claimed yet (removed at exit)
    pools: dict[str, SharedPool]  # token -> the pool for that frontend
    prune_at: int = 1024


_files = _WorkerFiles({}, set(), {})


def _cleanup_unclaimed() -> None:
    """At the worker's exit: its files, and what frontends that died (SIGKILL: the worker exits
    because its engine's frontend is gone) left in their directories, their markers above all."""
    for path in list(_files.made) + [path for pool in _files.pools.values() for path in pool.segment_paths()]:
        _remove(path)
    for directory in {pool.directory for pool in _files.pools.values()}:
        sweep_stale(directory)


atexit.register(_cleanup_unclaimed)


def pool_for(target: HandoffAddressWire | dict[str, Any] | None) -> SharedPool | None:
    """The pool for the frontend at ``target`` (None: rows go inline: hand-off off, or a
    directory this worker does not share). A frontend in this process gets one too where the
    directory is in memory (tmpfs): its regions are memory touched before, where new bytes for
    every block are fresh pages (a first write there runs at a tenth of the speed); on a disk's
    file system the bytes stay in memory instead. Worker's main thread only."""
    if not target or not _enabled():
        return None
    directory, token = str(target.get("dir")), str(target.get("token"))
    if target.get("pid") == os.getpid() and not in_memory(directory):
        return None
    if not re.fullmatch(r"[0-9a-f]{32}", token):
        return None
    seen = _files.seen.get((directory, token))
    if seen is None:
        seen = _files.seen[(directory, token)] = own_file_exists(os.path.join(directory, marker_name(token)))
    if not seen:
        return None
    for other, old_pool in list(_files.pools.items()):  # frontends that exited: their pools go
        if other != token and not own_file_exists(old_pool.marker):
            _cleanup_pool(_files.pools.pop(other))
    pool = _files.pools.get(token)
    if pool is None:
        pool = _files.pools[token] = SharedPool(directory, os.path.join(directory, marker_name(token)))
        trimmer.start(lambda: list(_files.pools.values()))
    return pool


def early_sink_for(address: HandoffAddressWire | dict[str, Any] | None) -> PartialSink | None:
    """Where a worker may write a finished request's rows before the fetch (``early_write``):
    the frontend's pool (blocks of at least ``LENS_EVALS_HANDOFF_MIN_BYTES`` while it has room,
    never a file of their own: a request never fetched leaves nothing behind but its region),
    or, for a frontend in this process, its pool and where that has no room the inline bytes its
    fetch would make. None: the rows wait for the fetch."""
    if not address or not _enabled():
        return None
    pool = pool_for(address)
    min_bytes = settings.HANDOFF_MIN_BYTES.get()
    if address.get("pid") == os.getpid():
        return lambda rows: (pool.write(rows) if pool is not None and rows.nbytes >= min_bytes else None) or inline(rows)
    if pool is None:
        return None
    return lambda rows: pool.write(rows) if rows.nbytes >= min_bytes else None


def recall(packed: dict[str, Any], address: HandoffAddressWire | dict[str, Any], keep: bool = True) -> dict[str, Any]:
    """Rows written early into the pool of the frontend at ``address``, for a fetch that wants
    them elsewhere (an abort's fetch sends no target): the bytes inline, the region free again.
    ``keep=False``: the rows are dropped (the memory bound): the region is freed unread."""
    if "pool" not in packed:
        return packed
    pool = _files.pools.get(str(address.get("token")))
    if pool is None:
        raise ValueError("rows written early into a hand-off pool that is gone (its frontend exited)")
    rest = {key: value for key, value in packed.items() if key not in ("pool", "offset", "nbytes")}
    data = pool.read_back(packed, keep)
    return rest if data is None else rest | {"data": data}


def release_regions(target: HandoffTargetWire | dict[str, Any] | None) -> int:
    """Regions the frontend at ``target`` no longer uses, sent before a fetch (an offline call's
    start, ``frontend_attach.release_offline``) so that the call's early writes reuse them; how
    many were freed. Worker's main thread."""
    pool = pool_for(target)
    return 0 if pool is None or target is None else pool.release(target.get("free"))


def pooled_bytes(allocated: bool = False) -> int:
    """The bytes of every hand-off pool segment this worker holds (all frontends; ``allocated``:
    the bytes their files hold pages for, less what idle pools gave back, ``SharedPool.trim``)."""
    return sum(pool.allocated_bytes() if allocated else pool.pooled_bytes for pool in _files.pools.values())


def sink_for(target: HandoffTargetWire | dict[str, Any] | None) -> Sink:
    """Where a worker puts the reply's row blocks for a frontend described by ``target``. Called
    once per fetch on the worker's main thread; the sink itself may run on several threads."""
    pool = pool_for(target)
    if pool is None or target is None:
        return inline
    directory, same_process = str(target.get("dir")), target.get("pid") == os.getpid()
    min_bytes = settings.HANDOFF_MIN_BYTES.get()
    pool.release(target.get("free"))
    if len(_files.made) >= _files.prune_at:  # forget the files frontends have claimed
        _files.made = {path for path in _files.made if os.path.exists(path)}
        _files.prune_at = max(1024, 2 * len(_files.made))

    def to_shared(rows: Rows) -> dict[str, Any]:
        if rows.nbytes < min_bytes:
            return inline(rows)
        pooled = pool.write(rows)
        if pooled is not None:
            return pooled
        if same_process or free_bytes(directory) < rows.nbytes + ROOM_MARGIN:  # a file: fresh pages too, and a mapping
            return inline(rows)
        return _write_file(directory, rows)

    return to_shared


def _cleanup_pool(pool: SharedPool) -> None:
    for path in pool.segment_paths():
        _remove(path)
    pool.close()


def _write_all(fd: int, blocks: list[Any]) -> int:
    """Write the blocks in order, up to IOV_MAX of them per system call; the bytes written."""
    views = [memoryview(block).cast("B") for block in blocks]
    total = 0
    for first in range(0, len(views), _IOV_MAX):
        group = views[first : first + _IOV_MAX]
        written = os.writev(fd, group)
        total += written
        for view in group:  # after a short write: the rest of the group, block by block
            if written >= view.nbytes:
                written -= view.nbytes
                continue
            rest, written = view[written:], 0
            while rest:
                count = os.write(fd, rest)
                rest = rest[count:]
                total += count
    return total


def _write_file(directory: str, rows: Rows) -> dict[str, Any]:
    """The blocks written into a new file (plain writes: a full directory is an error now, not a
    SIGBUS later as with a mapping); inline bytes if the directory is full."""
    name = new_name(ROWS_PREFIX)
    path = os.path.join(directory, name)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError as exc:  # e.g. out of file descriptors, or the directory went away
        logger.warning("lens_evals: cannot create a hand-off file in %s (%s); sending the rows inline", directory, exc)
        return inline(rows)
    try:
        written = _write_all(fd, rows.blocks)
    except OSError as exc:
        _remove(path)
        logger.warning("lens_evals: hand-off file of %d bytes in %s failed (%s); sending the rows inline", rows.nbytes, directory, exc)
        return inline(rows)
    finally:
        os.close(fd)
    if written != rows.nbytes:
        _remove(path)
        raise ValueError(f"row blocks hold {written} bytes, expected {rows.nbytes}")
    _files.made.add(path)
    return {"file": name, "nbytes": rows.nbytes}
