"""Opening, mapping and deleting the hand-off's files in a directory others can write to.

The hand-off directory is usually ``/dev/shm``: every user and every container started with
``--ipc=host`` may put anything there under a name like ours. So a hand-off file is looked at
with ``lstat`` and opened with ``O_NOFOLLOW | O_NONBLOCK`` (a symlink is not followed, a FIFO
does not block the open), then ``fstat``-checked: only a regular file owned by this user is
read, mapped or deleted; anything else is skipped (the sweep) or refused for that block alone
(a claim), never fatal for the process.

Every hand-off name carries ``NAMESPACE``, a token of this host's boot and this process's pid
namespace: the pids in our names mean something only there, so a process (the sweep, a worker
looking for its frontend's marker, a frontend mapping a segment) considers only names with its
own token, and containers sharing the directory never touch each other's files. A name without
a token (older lens-evals) or with another is never read, mapped or deleted; a worker in another
pid namespace than its frontend does not find the frontend's marker and sends its rows inline.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import mmap
import os
import re
import socket
import stat
import uuid

logger = logging.getLogger("lens_evals")
_SAFE_FLAGS = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
MARKER_PREFIX = "lens_evals-host-"
ROWS_PREFIX = "lens_evals-rows-"
SEGMENT_PREFIX = "lens_evals-pool-"
WEIGHTS_PREFIX = "lens_evals-weights-"  # readout weights a frontend wrote for its workers (readout_files.py)


def _pid_namespace() -> str:
    info = os.stat("/proc/self/ns/pid")  # the namespace's own inode
    return f"{info.st_dev}:{info.st_ino}"


def _boot_id() -> str:
    with open("/proc/sys/kernel/random/boot_id") as handle:
        return handle.read().strip()


def namespace_token() -> str:
    """16 hex digits from this pid namespace (its inode), the boot id and the host name."""
    parts = []
    for read in (_pid_namespace, _boot_id):
        try:
            parts.append(read())
        except OSError as exc:  # no /proc (not Linux): the other parts still tell hosts apart
            logger.debug("lens_evals: hand-off namespace token without %s (%s)", read.__name__, exc)
            parts.append("")
    parts.append(socket.gethostname())
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


NAMESPACE = namespace_token()
MARKER_NAME = re.compile(rf"^{MARKER_PREFIX}{NAMESPACE}-[0-9a-f]{{32}}$")  # the frontend's token; holds its pid
ROWS_NAME = re.compile(rf"^{ROWS_PREFIX}{NAMESPACE}-([0-9]+)-[0-9a-f]{{32}}$")  # the writer's pid, then a uuid
SEGMENT_NAME = re.compile(rf"^{SEGMENT_PREFIX}{NAMESPACE}-([0-9]+)-[0-9a-f]{{32}}$")  # the worker's pid, then a uuid
OWNED_NAME = re.compile(  # the owner's pid; weights files end in their digest (and a writer's partial file in more)
    rf"^(?:(?:{ROWS_PREFIX}|{SEGMENT_PREFIX}){NAMESPACE}-([0-9]+)-[0-9a-f]{{32}}"
    rf"|{WEIGHTS_PREFIX}{NAMESPACE}-([0-9]+)-[0-9a-f]{{64}}(?:\.[0-9a-f]{{8}}\.partial)?)$"
)


def marker_name(token: str) -> str:
    """The marker file of the frontend whose token (32 hex digits) is ``token``."""
    return f"{MARKER_PREFIX}{NAMESPACE}-{token}"


def new_name(prefix: str) -> str:
    """A fresh row file or pool segment name (``ROWS_PREFIX`` / ``SEGMENT_PREFIX``) of this process."""
    return f"{prefix}{NAMESPACE}-{os.getpid()}-{uuid.uuid4().hex}"


class ForeignFile(ValueError):
    """A name like ours that is not a regular file of this user (a link, a FIFO, another user's)."""


def is_own_file(info: os.stat_result) -> bool:
    return stat.S_ISREG(info.st_mode) and info.st_uid == os.geteuid()


def own_file_exists(path: str) -> bool:
    """Whether ``path`` is a regular file of this user (not followed if a link)."""
    try:
        return is_own_file(os.lstat(path))
    except OSError:
        return False


def open_own(path: str, flags: int) -> int:
    """``path`` opened (a descriptor) if it is a regular file of this user; ForeignFile if not
    (nothing but a regular file is ever opened: special files are refused before ``open``),
    OSError if it cannot be opened."""
    if not is_own_file(os.lstat(path)):
        raise ForeignFile(f"hand-off file {path} is not a regular file of this user")
    fd = os.open(path, flags | _SAFE_FLAGS)
    try:
        if not is_own_file(os.fstat(fd)):  # replaced between the lstat and the open
            raise ForeignFile(f"hand-off file {path} is not a regular file of this user")
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_pid(path: str) -> int | None:
    """The pid a marker file holds; None where it holds none (an older marker) or is not a
    regular file of this user, or cannot be read."""
    try:
        fd = open_own(path, os.O_RDONLY)
    except (OSError, ForeignFile) as exc:
        logger.debug("lens_evals: hand-off marker %s skipped (%s)", path, exc)
        return None
    try:
        text = os.read(fd, 32).decode("ascii", "replace").strip()
    except OSError as exc:
        logger.debug("lens_evals: hand-off marker %s skipped (%s)", path, exc)
        return None
    finally:
        os.close(fd)
    return int(text) if text.isdigit() else None


def remove(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):  # already claimed / removed: nothing to do
        os.unlink(path)


def remove_if_own(path: str) -> bool:
    """Delete ``path`` if it is a regular file of this user; whether it was deleted (another
    user's file, a link, a directory: kept, and said at debug level)."""
    try:
        if not is_own_file(os.lstat(path)):
            logger.debug("lens_evals: %s is not a regular file of this user; left alone", path)
            return False
        os.unlink(path)
    except OSError as exc:  # gone meanwhile, or a directory we may not write to
        logger.debug("lens_evals: %s not removed (%s)", path, exc)
        return False
    return True


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def map_and_unlink(path: str) -> mmap.mmap | bytearray:
    """Map a hand-off file and delete its name: from now on only the mappings hold it. A name
    that is not a regular file of this user is a ValueError (the block's request fails alone)."""
    try:
        fd = open_own(path, os.O_RDWR)
    except FileNotFoundError:
        raise ValueError(f"hand-off file {path} is gone (deleted before the frontend claimed it)") from None
    except OSError as exc:  # ELOOP (a link), EACCES ...
        raise ValueError(f"hand-off file {path} cannot be opened ({exc})") from None
    try:
        os.unlink(path)
        size = os.fstat(fd).st_size
        return mmap.mmap(fd, size) if size else bytearray()
    finally:
        os.close(fd)


MEMORY_FILESYSTEMS = ("tmpfs", "ramfs", "hugetlbfs")


@functools.cache
def in_memory(directory: str) -> bool:
    """Whether ``directory`` is on a file system held in memory (tmpfs: ``/dev/shm``), from the
    longest mount point above it in ``/proc/self/mounts``; False where that cannot be read."""
    try:
        with open("/proc/self/mounts", encoding="utf-8") as mounts:
            entries = [line.split()[1:3] for line in mounts if len(line.split()) > 2]
    except OSError:
        return False
    path = os.path.realpath(directory)
    best, kind = "", ""
    for point, fstype in entries:
        point = point.replace("\\040", " ")  # /proc/mounts escapes spaces
        if (path == point or path.startswith(point.rstrip("/") + "/")) and len(point) > len(best):
            best, kind = point, fstype
    return kind in MEMORY_FILESYSTEMS
