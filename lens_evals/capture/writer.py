"""Shards written on writer threads while the engine runs the next batch. Each filled
:class:`ShardImage` is written (temporary name, fsync, rename) by one of several threads, so the
disk sees large writes back to back; its SHA-256 is taken from memory on a hashing thread of its
own while the writer writes it (hash and write both release the GIL: a shard then takes the
longer of the two, not their sum, and hashing spreads over cores); shards are
*recorded* (the caller's ``record``: the manifest rewritten) strictly in shard order, so the manifest
on disk always lists a prefix of whole shards. Host memory is bounded by the image pool: a caller
that fills images faster than the disk takes them waits for a free one. After shard k fails, the
shards before it are still written and recorded, none after it; every shard file not recorded is
removed. Of several failures (two writers out of disk at once) the lowest-numbered is reported."""

from __future__ import annotations

import logging
import os
import queue
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path

from lens_evals.capture.manifest import RowRecord, ShardRecord
from lens_evals.capture.shard_file import ShardImage, sha256_of, write_file

logger = logging.getLogger(__name__)

Record = Callable[[ShardRecord, list[RowRecord]], None]


@dataclass
class PendingRow:
    prompt_index: int
    token_ids: list[int]
    offset: int


@dataclass
class _Job:
    number: int
    name: str
    image: ShardImage
    rows: list[PendingRow]
    release: Callable[[ShardImage], None] | None  # gives a pooled image back


class ImagePool:
    """At most ``size`` images, made on first need; :meth:`take` waits for one given back."""

    def __init__(self, size: int, make: Callable[[], ShardImage]) -> None:
        self.size, self._make, self._made = size, make, 0
        self._free: queue.SimpleQueue[ShardImage] = queue.SimpleQueue()

    def take(self) -> ShardImage:
        if self._free.empty() and self._made < self.size:
            self._made += 1
            return self._make()
        image = self._free.get()
        image.reset()
        return image

    def give_back(self, image: ShardImage) -> None:
        self._free.put(image)


class ShardWriter:
    """``submit`` filled images; ``close`` waits for every one and raises the lowest-numbered
    failure as :class:`ShardWriteError` (its shard's name and cause)."""

    def __init__(self, out_dir: Path, first_number: int, record: Record, n_writers: int, direct: bool) -> None:
        self.out_dir, self.record, self.direct = out_dir, record, direct
        self._first, self._next_number, self._next_record = first_number, first_number, first_number
        self._submitted: list[str] = []
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._turn = threading.Condition()
        self._failed: tuple[int, str, BaseException] | None = None  # number, name, cause
        self._closed = False
        self.direct_used: bool | None = None  # whether the last shard went through O_DIRECT
        self._hashers = ThreadPoolExecutor(n_writers, thread_name_prefix="shard-hash")  # one hash beside each write
        self._threads = [threading.Thread(target=self._work, name=f"shard-writer-{i}", daemon=True) for i in range(n_writers)]
        for thread in self._threads:
            thread.start()

    def submit(
        self, name_of: Callable[[int], str], image: ShardImage, rows: list[PendingRow], release: Callable[[ShardImage], None] | None
    ) -> None:
        assert not self._closed, "submit after close"
        name = name_of(self._next_number)
        self._submitted.append(name)
        self._jobs.put(_Job(self._next_number, name, image, rows, release))
        self._next_number += 1

    @property
    def failure(self) -> tuple[str, BaseException] | None:
        return None if self._failed is None else self._failed[1:]

    def raise_failure(self) -> None:
        if self._failed is not None:
            raise ShardWriteError(*self._failed[1:])

    def _stopped_before(self, number: int) -> bool:
        """Whether a shard before ``number`` failed (then ``number`` is neither written nor recorded)."""
        return self._failed is not None and self._failed[0] < number

    def close(self) -> None:
        """Wait for every submitted shard; then raise the first failure, if any (after removing
        every shard file that was not recorded). Again: raises the same failure."""
        if not self._closed:
            self._closed = True
            for _ in self._threads:
                self._jobs.put(None)
            for thread in self._threads:
                thread.join()
            self._hashers.shutdown()
        if self._failed is not None:
            for name in self._submitted[self._next_record - self._first :]:
                for path in (self.out_dir / name, self.out_dir / (name + ".tmp")):
                    path.unlink(missing_ok=True)
            self.raise_failure()

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            try:
                if not self._stopped_before(job.number):
                    self._write_and_record(job)
            except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread by close/submit
                with self._turn:
                    if self._failed is None or job.number < self._failed[0]:
                        self._failed = (job.number, job.name, exc)
                    self._turn.notify_all()
            finally:
                if job.release is not None:
                    job.release(job.image)

    def _write_and_record(self, job: _Job) -> None:
        path = self.out_dir / job.name
        tmp = path.with_name(path.name + ".tmp")
        view = job.image.file_view()
        hashed = self._hashers.submit(sha256_of, view)
        try:
            self.direct_used = write_file(tmp, view, self.direct)
            sha256 = hashed.result()
            n_bytes = len(view)
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        finally:
            wait([hashed])  # it reads the view: done (or failed) before the view is released
            view.release()
        _fsync_dir(self.out_dir)
        shard = ShardRecord(name=job.name, n_bytes=n_bytes, sha256=sha256, n_rows=len(job.rows), n_tokens=job.image.used)
        rows = [RowRecord(prompt_index=r.prompt_index, shard=job.name, offset=r.offset, token_ids=r.token_ids) for r in job.rows]
        with self._turn:
            self._turn.wait_for(lambda: self._stopped_before(job.number) or self._next_record == job.number)
            if self._stopped_before(job.number):
                path.unlink(missing_ok=True)
                return
            try:
                self.record(shard, rows)
            except BaseException:
                path.unlink(missing_ok=True)  # written but not recorded: not kept
                raise
            self._next_record += 1
            self._turn.notify_all()


class ShardWriteError(RuntimeError):
    """Writing or recording shard ``name`` failed with ``cause``."""

    def __init__(self, name: str, cause: BaseException) -> None:
        super().__init__(f"{name}: {cause}")
        self.name, self.cause = name, cause


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
