"""A running request's captured rows written for the frontend while it still decodes.

Early writes (``early_write``) write a request's rows once vLLM finishes it. In a decode batch
whose requests all finish together (an eval's 256 prompts x 128 tokens) that is every row at
once, after the last step, overlapped with nothing: on the H100 profile (issue #47) the fetch of
436 MB was most of the capture's decode overhead. Yet a row is final once its step's copy has
landed. So after a decode-run segment closes (``decode_runs``, every ``STREAM_STEPS`` steps;
see ``StreamWrites.due`` for requests that come and go, and steps without runs) the worker
releases the final pieces of each running request whose lens request says where its rows go
(every piece but the open segment's: the prompt's, the closed segments') and writes them on the
early writer thread into the request's block (``StreamedRows``): laid out as the reply's
``(ids, positions, ...)``, in the frontend's pool (a frontend in the worker's process has one
too), or as bytes where the pool has no room, with room for twice the rows so far (at most the request's most: prompt + max_tokens,
``rows_at_most``), grown as needed. The pieces' buffers are freed once written. The rows the request still holds when it finishes are written by its early
write or its fetch (``TakenResult.stream``), which then closes the block to the rows it has: each
id's rows moved up behind the one before (a memmove in memory just written) and the tail freed.

Everything but ``StreamedRows.write`` and ``close`` runs on the worker's main thread. Writes of
one block happen one after another on the one writer thread, before the request's early write
(submitted later to the same thread); a fetch on another thread waits for them first.
"""

from __future__ import annotations

import ctypes
import logging
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from lens_evals.engine.transport import handoff, timing
from lens_evals.engine.transport.handoff_pool import SharedPool
from lens_evals.engine.transport.protocol import PackedRows
from lens_evals.engine.worker.host_store import Piece, PieceStore, gaps_error

logger = logging.getLogger("lens_evals")
STREAM_STEPS = 16  # steps between rounds of writes (the capture runs' segment length while rows stream)
MIN_BYTES = 64 << 10  # a request's final rows are written once they hold this much (one 8B layer: 8 steps)
_thread: ThreadPoolExecutor | None = None


def writer() -> ThreadPoolExecutor:
    """The worker process's one writer thread: early writes and streamed ones, in the order
    submitted (``EarlyWrites.reap`` and a block's last write before its close rely on it)."""
    global _thread
    if _thread is None:
        _thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lens_evals-early")
    return _thread


class StreamedRows:
    """One request's captured rows as the reply's block ``(ids, positions, ...)``, written piece
    by piece into memory with room for ``capacity`` positions (grown as needed: ``_room_for``);
    ``covered``: positions ``0..covered`` of every id are written."""

    def __init__(self, key: str, rows_at_most: int | None, pool: SharedPool | None, token: str) -> None:
        self.key, self.rows_at_most, self.pool, self.token = key, rows_at_most, pool, token
        self.capacity = 0
        self.memory: bytearray | None = None  # the block as bytes (no pool region)
        self.region: tuple[str, int] | None = None  # else (segment, offset) in the pool
        self.dest: np.ndarray | None = None  # (ids, capacity, ...) of either
        self.streamed_bytes = 0  # bytes of the pieces submitted (main thread)
        self.counted = 0  # of those, counted as held bytes (``StreamWrites.inline_bytes``; main thread)
        self.dtype: torch.dtype | None = None
        self.covered = 0
        self.gap: int | None = None  # the first position no piece covered (then nothing more is written)
        self.last: Future[None] | None = None  # the last write submitted
        self.error: str | None = None  # a write failed: nothing more is written

    # ------------------------------------------------------------- the writer thread
    def write(self, pieces: list[Piece]) -> None:
        """The pieces' rows into place, in order (a later piece's rows of a position win, as
        after a recomputation)."""
        for piece in pieces:
            if self.gap is not None or self.error is not None:
                return
            views = piece.id_views()  # waits for the piece's device copy
            first, n = piece.first_position, piece.num_rows
            if first > self.covered:
                self.gap = self.covered
                return
            if self.dest is None:
                trailing = views[0].shape[2:] if piece.buffer.segment else views[0].shape[1:]
                self._make(len(views), trailing, views[0].dtype, piece.buffer.data.dtype, self._room_for(first + n))
            elif first + n > self.capacity:
                self._grow(self._room_for(first + n))
            assert self.dest is not None
            for index, view in enumerate(views):
                self.dest[index, first : first + n].reshape(view.shape)[...] = view
            self.covered = max(self.covered, first + n)

    def _room_for(self, need: int) -> int:
        """Positions to make room for when ``need`` are: twice as many (a block grows a few
        times at most), at most the request's most, unless it needs more (a speculative step
        past its end; or a request whose most is unknown). Not simply its most: ``max_tokens``
        may be its model's length while the request stops after a few tokens."""
        room = max(2 * need, need + 4 * STREAM_STEPS)
        most = self.rows_at_most
        return room if most is None or need > most else max(need, min(room, most))

    def _make(self, ids: int, trailing: tuple[int, ...], dtype: np.dtype, torch_dtype: torch.dtype, capacity: int) -> None:
        nbytes = ids * capacity * int(np.prod(trailing, dtype=np.int64)) * dtype.itemsize
        taken = self.pool.take_region(nbytes) if self.pool is not None else None
        if taken is None:  # no pool here, or a full one: bytes (sent inline)
            self.memory, self.region = bytearray(nbytes), None
            raw = np.frombuffer(self.memory, dtype=np.uint8)
        else:
            name, offset, raw = taken
            self.memory, self.region = None, (name, offset)
        self.capacity, self.dtype = capacity, torch_dtype
        self.dest = raw.view(dtype).reshape(ids, capacity, *trailing)

    def _grow(self, capacity: int) -> None:
        """More positions than the block has room for: a larger block, the rows so far copied
        over (memory written just before: at copy speed)."""
        old, old_region = self.dest, self.region
        assert old is not None and self.dtype is not None
        self._make(old.shape[0], old.shape[2:], old.dtype, self.dtype, capacity)
        assert self.dest is not None
        self.dest[:, : self.covered] = old[:, : self.covered]
        del old
        self._give(old_region)

    def _give(self, region: tuple[str, int] | None) -> None:
        if region is not None and self.pool is not None:
            self.pool.give_region(*region)

    def close(self, pieces: list[Piece], keep_in_pool: bool) -> dict[str, Any]:
        """The rest of the rows written and the block cut to the rows it has: the reply's
        packed rows (``{"error": ...}`` for a gap). ``keep_in_pool``: the fetch's frontend is
        the one whose pool holds the block (else the bytes come back inline)."""
        if self.last is not None:
            with timing.phase("fetch: wait for streamed writes"):
                self.last.result()
        self.write(pieces)
        if self.gap is not None or self.error is not None:
            self.discard()
            return {"error": self.error or gaps_error("residual_stream", [self.gap or 0])}
        dest = self.dest
        assert dest is not None and self.dtype is not None
        ids, n = dest.shape[0], self.covered
        per_id = n * int(np.prod(dest.shape[2:], dtype=np.int64)) * dest.dtype.itemsize
        base = dest.ctypes.data
        for index in range(1, ids):  # each id's rows right behind the last's (overlapping: memmove)
            ctypes.memmove(base + index * per_id, dest[index].ctypes.data, per_id)
        nbytes = ids * per_id
        header: dict[str, Any] = dict(PackedRows.header(self.dtype, (ids, n, *dest.shape[2:])))
        self.dest = None
        if self.region is None:
            memory, self.memory = self.memory, None
            del dest  # its export of ``memory``: a bytearray with exports cannot be resized
            assert memory is not None
            del memory[nbytes:]
            return header | {"data": memory}
        (name, offset), self.region = self.region, None
        assert self.pool is not None
        if keep_in_pool:
            self.pool.shrink(name, offset, nbytes)
            return header | {"pool": name, "offset": offset, "nbytes": nbytes}
        data = bytearray(dest.reshape(-1).view(np.uint8)[:nbytes])
        self.pool.give_region(name, offset)
        return header | {"data": data}

    def discard(self) -> None:
        """Nothing of the block is wanted (the request failed or was dropped): its memory back."""
        region, self.memory, self.region, self.dest = self.region, None, None, None
        self._give(region)


def _write_all(batch: list[tuple[StreamedRows, list[Piece]]]) -> None:
    with timing.phase("stream: write rows"):
        for block, pieces in batch:
            try:
                block.write(pieces)
            except Exception as exc:  # noqa: BLE001 - this request's rows are lost, not the others'
                logger.exception("lens_evals: writing the rows of %s as it runs failed", block.key)
                block.error = block.error or f"writing the rows failed: {type(exc).__name__}: {exc}"


class StreamWrites:
    """The worker's streamed blocks by request key, and the pieces being written into them."""

    def __init__(self, captures: PieceStore) -> None:
        self.captures = captures
        self.blocks: dict[str, StreamedRows] = {}
        self.unwritable: set[str] = set()  # keys whose frontend takes no rows before the fetch (asked once)
        self._writing: deque[tuple[Future[None], list[Piece], list[StreamedRows]]] = deque()
        self.steps = 0  # steps with captures since the last round of writes
        self.closed = 0  # capture-run segments closed as of the last round (``DecodeRun.closed``)
        # rows written, or being written, into blocks that are bytes (no pool region: this process's
        # frontend without a pool, or a pool without room): the worker holds them until the fetch
        self.inline_bytes = 0
        self.written = 0  # rounds of writes (tests and diagnostics)

    def due(self, closed: int) -> bool:
        """Called once per step that stored captures: whether a round of writes is due. After a
        capture-run segment closed (every ``STREAM_STEPS`` steps in a steady decode), but at
        most once per half of that (when requests come and go, segments close at nearly every
        step); without runs (no segment closes), every ``2 * STREAM_STEPS`` steps."""
        self.steps += 1
        if (closed != self.closed and 2 * self.steps >= STREAM_STEPS) or self.steps >= 2 * STREAM_STEPS:
            self.closed, self.steps = closed, 0
            return True
        return False

    def write_round(self, running: Iterable[tuple[str, dict[str, Any], int | None]], final: Callable[[list[Piece]], list[Piece]]) -> None:
        """Write the final pieces (``final`` picks them from a request's pieces) of each running
        request ``(key, address, rows_at_most)`` that holds ``MIN_BYTES`` of them into its block
        (made now, for the frontend at ``address``, if it has none): one task on the writer
        thread for the whole round."""
        batch: list[tuple[StreamedRows, list[Piece]]] = []
        for key, address, rows_at_most in running:
            pieces = self.captures.by_key.get(key)
            ready = final(pieces) if pieces else []
            nbytes = sum(piece.nbytes for piece in ready)
            if not ready or nbytes < MIN_BYTES:
                continue
            block = self.blocks.get(key)
            if block is None and (key in self.unwritable or (block := self._new_block(key, address, rows_at_most)) is None):
                continue
            self.captures.release_pieces(key, ready)
            block.streamed_bytes += nbytes
            if block.region is None:  # bytes, or not made yet: held until known to be a pool region (``reap``)
                block.counted += nbytes
                self.inline_bytes += nbytes
            batch.append((block, ready))
        if not batch:
            return
        future = writer().submit(_write_all, batch)
        for block, _ in batch:
            block.last = future
        self._writing.append((future, [piece for _, ready in batch for piece in ready], [block for block, _ in batch]))
        self.written += len(batch)

    def _new_block(self, key: str, address: dict[str, Any], rows_at_most: int | None) -> StreamedRows | None:
        sink = handoff.early_sink_for(address)
        if sink is None:
            self.unwritable.add(key)
            return None
        pool = handoff.pool_for(address)  # None: bytes
        block = self.blocks[key] = StreamedRows(key, rows_at_most, pool, str(address.get("token")))
        return block

    def reap(self, wait_while: Callable[[], bool] | None = None) -> None:
        """Free the buffers of the pieces written (main thread). ``wait_while``: while it holds
        (the memory bound is exceeded), wait for the writes still running (as
        ``EarlyWrites.reap``: rows on their way out are not worth dropping others for)."""
        while self._writing:
            future, pieces, blocks = self._writing[0]
            if not future.done():
                if wait_while is None or not wait_while():
                    return
                with timing.phase("stream: wait for the writer (memory bound)"):
                    future.exception()
            self._writing.popleft()
            self.captures.unhold(pieces)
            for block in blocks:
                self._recount(block)

    def _recount(self, block: StreamedRows) -> None:
        """Count ``block``'s rows as held bytes or not, by where its writes put them (the writer
        thread made it a pool region or bytes, or grew a region into bytes), once no write of it
        is running; not for a block taken for its close (``take`` uncounted it)."""
        if self.blocks.get(block.key) is not block or (block.last is not None and not block.last.done()):
            return
        held = block.streamed_bytes if block.region is None else 0
        self.inline_bytes += held - block.counted
        block.counted = held

    def take(self, key: str) -> StreamedRows | None:
        """``key``'s block for its early write or fetch (which closes it), if it has one."""
        self.unwritable.discard(key)
        block = self.blocks.pop(key, None)
        if block is not None:
            self.inline_bytes -= block.counted  # counted from now on where the closed block goes
            block.counted = 0
        return block

    def discard(self, key: str) -> None:
        """``key`` failed or was dropped: its block's memory back once its writes are done."""
        block = self.take(key)
        if block is not None:
            self.discard_block(block)

    @staticmethod
    def discard_block(block: StreamedRows) -> None:
        writer().submit(block.discard)
