"""Decode runs: the steps of one batch composition kept as ONE piece per request.

A decode step with the same requests and row counts as the last one reuses its plan
(``planners.StepPlanner``). While that lasts, and each request's rows follow its rows of the
step before (no rejected speculative tokens, no recomputation), the steps' copies go one after
another into a run segment (``host_store.StepBuffer`` with ``segment``), and each request keeps
one ``Piece`` for the whole segment instead of one per step: the per-step host work no longer
grows with the batch (no piece per request per step, no loop over the requests), and a fetch
reads a request's rows of a segment in one strided copy instead of one slice per step.

A run ends when the composition or a request's positions change, when the ledger changes (a
request fails or is fetched: ``version``), when its segment is full, or before any piece is
released (``StepStores.release``: readers then see every step's rows). Ending finalises each
piece's extent (``Piece.extend_to``): the only loop over the requests, once per segment.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from lens_evals.engine.transport import timing
from lens_evals.engine.worker.host_copy import PlainCopy
from lens_evals.engine.worker.host_store import Piece, PieceStore, StepBuffer

SEGMENT_BYTES = 64 * 2**20  # host bytes of one segment at most (the arena's chunk size)
MAX_SEGMENT_STEPS = 64


class DecodeRun:
    """One kind of rows (captures or probe scores) of the decode run in progress, if any."""

    def __init__(self, store: PieceStore, copier: PlainCopy) -> None:
        self.store, self.copier = store, copier
        self.plan: Any = None  # the last step's plan and ledger version, and its requests' positions
        self.version = -1
        self.index = np.zeros(0, dtype=np.int64)  # the slots' places in the layout
        self.rows = np.zeros(0, dtype=np.int64)  # the slots' rows per step
        self.last_starts = np.zeros(0, dtype=np.int64)
        self.segment: StepBuffer | None = None
        self.pieces: list[Piece] = []
        self.capacity = 0
        self.max_steps = MAX_SEGMENT_STEPS  # a segment's steps at most (fewer while rows stream: ``stream_write``)
        self.closed = 0  # segments closed so far

    def continues(self, plan: Any, version: int, starts: np.ndarray) -> bool:
        """The step is the next of the last one's run: the same plan and ledger, each request
        one step further."""
        return (
            plan is self.plan
            and version == self.version
            and len(self.index) > 0
            and np.array_equal(starts[self.index], self.last_starts + self.rows)
        )

    def follow(self, plan: Any, version: int, starts: np.ndarray, slots: list[Any]) -> None:
        """Remember the step just stored (for the next step's ``continues``)."""
        if plan is not self.plan:
            self.index = np.fromiter((slot.batch_index for slot in slots), dtype=np.int64, count=len(slots))
            self.rows = np.fromiter((slot.num_rows for slot in slots), dtype=np.int64, count=len(slots))
        self.plan, self.version = plan, version
        self.last_starts = starts[self.index]

    def append(self, step: torch.Tensor, units: int, slots: list[Any], new_piece: Callable[[StepBuffer, Any], Piece | None]) -> bool:
        """Copy ``step`` into the open segment, or into a new one (then each slot's request gets
        its piece, ``new_piece``). False: a segment would hold fewer than two steps (no run)."""
        segment = self.segment
        if segment is not None and (segment.steps >= self.capacity or segment.live_pieces != len(self.pieces)):
            self.end()
            segment = None
        if segment is None:
            step_bytes = step.numel() * step.element_size()
            capacity = min(self.max_steps, MAX_SEGMENT_STEPS, SEGMENT_BYTES // max(step_bytes, 1))
            most = self.copier.segment_step_bytes
            if capacity < 2 or (most is not None and step_bytes > most):
                return False
            data, chunk = self.copier.host_segment((capacity, *step.shape), step.dtype, self.store.arena)
            segment = self.store.new_buffer(data, None, units, chunk, segment=True)  # one step filled, counted held
            self.segment, self.capacity = segment, capacity
            with timing.phase(timing.DETAIL + "pieces"):
                self.pieces = [piece for slot in slots if (piece := new_piece(segment, slot)) is not None]
            with timing.phase(timing.DETAIL + "copy to host"):
                segment.ready = self.copier.copy_into(step, segment.data[0])
            return True
        with timing.phase(timing.DETAIL + "copy to host"):
            segment.ready = self.copier.copy_into(step, segment.data[segment.steps]) or segment.ready
        segment.steps += 1
        self.store.held_bytes += step.numel() * step.element_size()
        return True

    def end(self) -> None:
        """Close the open segment: each piece covers every step of it."""
        segment, self.segment = self.segment, None
        if segment is None:
            return
        segment.units *= segment.steps
        with timing.phase(timing.DETAIL + "end run"):
            for piece in self.pieces:
                if piece.alive:
                    segment.live_units += piece.extend_to(segment.steps)
        self.pieces = []
        self.closed += 1
        self.store.drop_unused(segment)

    def reset(self) -> None:
        """End the segment and forget the last step: the next step starts afresh."""
        self.end()
        self.plan = None
