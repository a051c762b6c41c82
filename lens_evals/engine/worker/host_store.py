"""Host memory on the worker for captured rows and probe scores, step by step, until a request
is fetched (the frontend reads what arrives with ``frontend.rows``).

A step copies everything it captured to the host in ONE asynchronous copy (a ``StepBuffer``;
the copy and its pinned memory: ``host_copy``);
each request of the step keeps only a small ``Piece`` that says where its rows are in that
buffer. No per-request tensor work happens while the engine steps: the rows are cut out and
joined when the request is fetched (``assemble``).

A buffer stays alive while any of its pieces does, so memory is accounted per whole buffer.
When a request is released and a buffer it shared is left less than a quarter used, the other
requests' rows are copied out of it (each row at most once), so a long request in a batch of
short ones does not keep the whole batch's rows alive.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from lens_evals.engine.transport import timing
from lens_evals.engine.transport.handoff import Sink, inline
from lens_evals.engine.transport.protocol import PackedRows, PackedRowsWire
from lens_evals.engine.worker.host_copy import PinnedArena

COMPACT_BELOW = 0.25


class StepBuffer:
    """One step's captures ``(n_layers, n_rows, hidden)`` or probe scores ``(n_pairs,)`` on the
    host. ``ready`` is the CUDA event of the copy (None on CPU or once waited for); ``chunk``
    the arena chunk its pinned memory belongs to (None: memory of its own).

    A run segment (``segment``): the steps of one decode run (the same requests, one plan, each
    request one step further every step) one after another, ``(capacity, ...)`` of the above;
    ``steps`` are filled, each request keeps ONE piece for all of them (``Piece.steps``), and
    ``ready`` is the event of the last step's copy (copies on one stream complete in order)."""

    __slots__ = ("data", "ready", "units", "live_units", "live_pieces", "holds", "pieces", "_array", "chunk", "segment", "steps")

    def __init__(self, data: torch.Tensor, ready: Any, units: int, chunk: Any = None, segment: bool = False) -> None:
        self.data = data
        self.ready = ready
        self.chunk = chunk
        self.segment = segment
        self.steps = 1 if segment else 0
        self.units = units
        self.live_units = 0
        self.live_pieces = 0
        self.holds = 0  # released pieces still being written on another thread (``PieceStore.unhold``)
        self.pieces: list[Piece] = []  # every piece ever added (see ``alive``)
        self._array: np.ndarray | None = None

    @property
    def nbytes(self) -> int:
        """The bytes held: a segment's filled steps only (the memory bound counts rows, not room)."""
        if self.segment:
            return self.data[0].numel() * self.data.element_size() * self.steps
        return self.data.numel() * self.data.element_size()

    def array(self) -> np.ndarray:
        """The host data as numpy (bfloat16 viewed as int16: numpy has no bfloat16)."""
        ready = self.ready  # read once: a writer thread may read the same buffer
        if ready is not None:
            with timing.phase(timing.DETAIL + "fetch: wait for device copies"):
                ready.synchronize()
            if not self.segment:  # a segment's next step sets a new event: waiting again costs nothing
                self.ready = None
        if self._array is None:
            data = self.data.view(torch.int16) if self.data.dtype == torch.bfloat16 else self.data
            self._array = data.numpy()
        return self._array


class Piece:
    """A request's rows in one step buffer. Captures: rows ``start:start+num_rows`` of the
    buffer's layer entries ``slots`` (None: all of them, in order). Scores: ``num_rows`` scores
    from each flat offset in ``slots`` (one per probe)."""

    __slots__ = ("buffer", "start", "num_rows", "first_position", "slots", "alive", "units", "steps", "step_rows")

    def __init__(self, buffer: StepBuffer, start: int, num_rows: int, first_position: int, slots: tuple[int, ...] | None) -> None:
        self.buffer = buffer
        self.start = start
        self.num_rows = num_rows  # every step's rows together (a run piece: steps x step_rows)
        self.first_position = first_position
        self.slots = slots
        self.alive = True
        self.steps = 1  # in a run segment: the segment's first ``steps`` steps, ``step_rows`` rows each
        self.step_rows = num_rows
        self.units = num_rows if slots is None or self._captures else num_rows * len(slots)

    @property
    def _captures(self) -> bool:
        return self.buffer.data.dim() > (2 if self.buffer.segment else 1)

    @property
    def nbytes(self) -> int:
        """The bytes of this piece's rows (read from nothing: no wait for the step's copy)."""
        data = self.buffer.data
        if self._captures:
            layer_axis = 1 if self.buffer.segment else 0
            ids = data.shape[layer_axis] if self.slots is None else len(self.slots)
            return ids * self.num_rows * math.prod(data.shape[layer_axis + 2 :]) * data.element_size()
        return self.units * data.element_size()

    def extend_to(self, steps: int) -> int:
        """Cover the first ``steps`` steps of its run segment (each request's rows follow its
        rows of the step before): the units added."""
        added = (steps - self.steps) * (self.step_rows if self.slots is None or self._captures else self.step_rows * len(self.slots))
        self.steps = steps
        self.num_rows = steps * self.step_rows
        self.units += added
        return added

    def rows(self) -> np.ndarray:
        """Captures ``(n_layers, num_rows, hidden)``; scores ``(n_probes, num_rows)``."""
        buffer = self.buffer
        data = buffer.array()
        if buffer.segment:
            return self._segment_rows()
        n = self.num_rows
        if data.ndim > 1:
            if self.slots is None:
                return data[:, self.start : self.start + n]
            return data[list(self.slots), self.start : self.start + n]
        assert self.slots is not None
        if len(self.slots) == 1:
            offset = self.slots[0]
            return data[None, offset : offset + n]
        return np.stack([data[offset : offset + n] for offset in self.slots])

    def _segment_rows(self) -> np.ndarray:
        """Rows of a run segment ``(steps, ...)``: step after step (a copy; ``id_views`` reads
        them without one)."""
        views = self.id_views()
        return np.stack([view.reshape(self.num_rows, *view.shape[2:]) for view in views])

    def id_views(self) -> list[np.ndarray]:
        """Each layer's or probe's rows, in order, as views of the step buffer (nothing is
        copied): ``(num_rows, ...)``, or ``(steps, step_rows, ...)`` in a run segment, whose C
        order is the same rows step after step (written by ``RowBlocks.copy_into`` in one
        strided copy per id straight to where they go)."""
        buffer = self.buffer
        data = buffer.array()
        start = self.start
        if buffer.segment:
            k, n = self.steps, self.step_rows
            if data.ndim > 2:  # (steps, n_layers, rows, hidden)
                ids = range(data.shape[1]) if self.slots is None else self.slots
                return [data[:k, i, start : start + n] for i in ids]
            assert self.slots is not None
            return [data[:k, offset : offset + n] for offset in self.slots]
        n = self.num_rows
        if data.ndim > 1:
            ids = range(data.shape[0]) if self.slots is None else self.slots
            return [data[i, start : start + n] for i in ids]
        assert self.slots is not None
        return [data[offset : offset + n] for offset in self.slots]


class PieceStore:
    """Pieces per request key, with the host bytes their buffers keep alive."""

    def __init__(self, arena_chunk_bytes: int = 64 * 2**20) -> None:
        self.by_key: dict[str, list[Piece]] = {}
        self.held_bytes = 0
        self._sparse: dict[int, StepBuffer] = {}  # buffers to compact at the next step
        self.arena = PinnedArena(arena_chunk_bytes)  # pins memory only for device tensors (``host_copy``)

    def new_buffer(self, data: torch.Tensor, ready: Any, units: int, chunk: Any = None, segment: bool = False) -> StepBuffer:
        buffer = StepBuffer(data, ready, units, chunk, segment)
        self.held_bytes += buffer.nbytes
        return buffer

    def _free(self, buffer: StepBuffer) -> None:
        """No piece uses ``buffer`` any more: stop counting its bytes; its arena region may be
        reused by later steps."""
        self.held_bytes -= buffer.nbytes
        if buffer.chunk is not None:
            self.arena.give_back(buffer.chunk)
            buffer.chunk = None

    def add(self, key: str, piece: Piece) -> None:
        buffer = piece.buffer
        buffer.pieces.append(piece)
        buffer.live_units += piece.units
        buffer.live_pieces += 1
        pieces = self.by_key.get(key)
        if pieces is None:
            self.by_key[key] = [piece]
        else:
            pieces.append(piece)

    def drop_unused(self, buffer: StepBuffer) -> None:
        """A buffer no request kept (every request of the step had already failed)."""
        if not buffer.live_pieces:
            self._free(buffer)

    def keys(self) -> set[str]:
        return set(self.by_key)

    def release(self, key: str, hold: bool = False) -> list[Piece]:
        """Forget a request's pieces (returned, still readable). A buffer left empty is freed;
        one left mostly empty is compacted at the next step (``compact``), so a bulk fetch of
        a whole batch copies nothing. ``hold``: the pieces are read on another thread, so their
        buffers are not freed (their pinned memory not reused) until ``unhold``."""
        pieces = self.by_key.pop(key, [])
        self._forget(pieces, hold)
        return pieces

    def release_pieces(self, key: str, pieces: list[Piece]) -> None:
        """Forget some of a request's pieces, held (``stream_write``: read on the writer
        thread, then ``unhold``)."""
        gone = {id(piece) for piece in pieces}
        self.by_key[key] = [piece for piece in self.by_key[key] if id(piece) not in gone]
        self._forget(pieces, hold=True)

    def _forget(self, pieces: list[Piece], hold: bool) -> None:
        for piece in pieces:
            piece.alive = False
            buffer = piece.buffer
            buffer.live_units -= piece.units
            buffer.live_pieces -= 1
            buffer.holds += hold
            if not buffer.live_pieces:
                if not buffer.holds:
                    self._free(buffer)
                    buffer.pieces = []
                self._sparse.pop(id(buffer), None)
            elif buffer.live_units < COMPACT_BELOW * buffer.units:
                self._sparse[id(buffer)] = buffer

    def unhold(self, pieces: list[Piece]) -> None:
        """Pieces released with ``hold`` are read no more: free the buffers nothing else uses."""
        for piece in pieces:
            buffer = piece.buffer
            buffer.holds -= 1
            if not buffer.holds and not buffer.live_pieces and buffer.pieces:
                self._free(buffer)
                buffer.pieces = []

    def compact(self) -> None:
        """Copy the remaining pieces of mostly-empty buffers into buffers of their own."""
        sparse, self._sparse = self._sparse, {}
        for buffer in sparse.values():
            if buffer.live_pieces:
                self._compact(buffer)

    def _compact(self, buffer: StepBuffer) -> None:
        for piece in buffer.pieces:
            if not piece.alive:
                continue
            captures = piece._captures
            rows = np.ascontiguousarray(piece.rows())
            data = torch.from_numpy(rows if captures else rows.reshape(-1))
            if buffer.data.dtype == torch.bfloat16:
                data = data.view(torch.bfloat16)
            own = self.new_buffer(data, None, piece.units)
            piece.buffer, piece.start, piece.steps, piece.step_rows = own, 0, 1, piece.num_rows
            piece.slots = None if captures else tuple(range(0, rows.size, piece.num_rows))
            own.pieces.append(piece)
            own.live_units, own.live_pieces = piece.units, 1
        buffer.live_pieces = 0
        if not buffer.holds:  # else freed by ``unhold``
            buffer.pieces = []
            self._free(buffer)


def gaps_error(what: str, gaps: list[int]) -> str:
    """The error of rows with positions no step stored (the first of them)."""
    return f"{what} has gaps at positions {gaps} (prefix cache or scheduling defect)"


@dataclass
class RowBlocks:
    """One request's rows by absolute position, ``(n_ids, n_positions, ...)``, ready to write:
    ``views`` are arrays whose elements, in C order one after another, are the packed rows
    (``nbytes``): views of the step buffers, so nothing is copied until written (``copy_into``
    writes each straight to its place; ``blocks`` makes them contiguous for byte sinks);
    ``gaps`` the first positions no piece covered (then nothing should be written)."""

    header: PackedRowsWire
    nbytes: int
    views: list[np.ndarray]
    gaps: list[int]
    shape: tuple[int, ...]

    @property
    def blocks(self) -> list[np.ndarray]:
        """The views as contiguous arrays (a copy only of those that are strided)."""
        return [np.ascontiguousarray(view) for view in self.views]

    def to_bytearray(self) -> bytearray:
        """The packed rows as bytes: contiguous views joined, strided ones (a run segment's)
        copied straight into place (one copy, not one to make them contiguous and another)."""
        views: list[Any] = self.views  # ndarrays: buffers
        if all(view.flags.c_contiguous for view in views):
            return bytearray().join(views)
        data = bytearray(self.nbytes)
        self.copy_into(memoryview(data))
        return data

    def write(self, sink: Sink) -> PackedRowsWire:
        return self.header | sink(self)  # type: ignore[return-value]  # the sink adds where the bytes are

    def copy_into(self, buffer: Any) -> None:
        """The packed rows into ``buffer`` (``nbytes`` writable bytes): one copy call per id, or
        per view of a run segment (a strided read straight into place)."""
        dest = np.frombuffer(buffer, dtype=self.views[0].dtype, count=int(np.prod(self.shape))).reshape(self.shape)
        if len(self.views) == 1 and self.views[0].shape == self.shape:  # rows joined here (``row_blocks``)
            dest[...] = self.views[0]
            return
        per_id = len(self.views) // self.shape[0]
        for index in range(self.shape[0]):
            views = self.views[index * per_id : (index + 1) * per_id]
            if all(view.ndim == dest.ndim - 1 for view in views):
                np.concatenate(views, axis=0, out=dest[index])
                continue
            at = 0
            for view in views:
                rows = view.shape[0] * view.shape[1] if view.ndim == dest.ndim else view.shape[0]
                dest[index, at : at + rows].reshape(view.shape)[...] = view
                at += rows


def row_blocks(pieces: list[Piece]) -> RowBlocks:
    """Where a request's rows are, in the order they are sent: each id's rows of each piece
    (views of the step buffers, so nothing is copied until written). Later pieces
    (recomputation after preemption) overwrite earlier ones: then the rows are joined here."""
    expected = 0
    contiguous = True
    for piece in pieces:
        if piece.first_position != expected:
            contiguous = False
            break
        expected += piece.num_rows
    if contiguous:
        by_piece = [piece.id_views() for piece in pieces]
        first = by_piece[0][0]
        trailing = first.shape[2:] if pieces[0].buffer.segment else first.shape[1:]
        shape = (len(by_piece[0]), expected, *trailing)
        views = [ids[i] for i in range(shape[0]) for ids in by_piece]
        nbytes = int(np.prod(shape)) * first.dtype.itemsize
        return RowBlocks(PackedRows.header(pieces[0].buffer.data.dtype, shape), nbytes, views, [], shape)
    arrays = [piece.rows() for piece in pieces]
    last = max(piece.first_position + piece.num_rows for piece in pieces)
    shape = (arrays[0].shape[0], last, *arrays[0].shape[2:])
    joined = np.zeros(shape, dtype=arrays[0].dtype)
    covered = np.zeros(last, dtype=bool)
    for piece, rows in zip(pieces, arrays):
        span = slice(piece.first_position, piece.first_position + piece.num_rows)
        joined[:, span] = rows
        covered[span] = True
    gaps = np.flatnonzero(~covered)[:10].tolist()
    nbytes = int(np.prod(shape)) * arrays[0].dtype.itemsize
    return RowBlocks(PackedRows.header(pieces[0].buffer.data.dtype, shape), nbytes, [joined], gaps, shape)


def assemble(pieces: list[Piece], sink: Sink = inline) -> tuple[PackedRowsWire | None, list[int]]:
    """One request's rows packed (see ``PackedRows``), written once by ``sink`` (inline bytes or
    a hand-off file), and the gaps (then nothing is written: None)."""
    rows = row_blocks(pieces)
    return (None if rows.gaps else rows.write(sink)), rows.gaps
