"""Opening, mapping and deleting the hand-off's files in a directory others can write to.

The hand-off directory is usually ``/dev/shm``: every user and every container started with
``--ipc=host`` may put anything there under a name like ours. So a hand-off file is looked at
with ``lstat`` and opened with ``O_NOFOLLOW | O_NONBLOCK`` (a symlink is not followed, a FIFO
does not block the open), then ``fstat``-checked: only a regular file owned by this user is
read, mapped or deleted; anything else is skipped (the sweep) or refused for that block alone
(a claim), never fatal for the process.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import stat

logger = logging.getLogger("lens_evals")
_SAFE_FLAGS = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


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
