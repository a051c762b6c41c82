"""The worker's host copies of every step's captures and probe scores, per request key, and
the bytes they hold (the memory bound is enforced by the worker core, which knows the ledger)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from lens_evals.engine.transport import timing
from lens_evals.engine.worker.decode_runs import DecodeRun
from lens_evals.engine.worker.host_copy import PlainCopy
from lens_evals.engine.worker.host_store import Piece, PieceStore, StepBuffer
from lens_evals.engine.worker.plan import CaptureSlot, ScoreSlot, StepPlan


class StepStores:
    def __init__(self, max_held_bytes: int, copier: PlainCopy | None = None) -> None:
        self.copier = copier if copier is not None else PlainCopy()  # ``host_copy.host_copier`` for the device
        self.captures = PieceStore()  # captured rows per request key
        self.scores = PieceStore(arena_chunk_bytes=4 * 2**20)  # probe scores per request key
        self.max_held_bytes = max_held_bytes
        # decode runs (``decode_runs``): one piece per request for many steps of one composition
        self.capture_run = DecodeRun(self.captures, self.copier)
        self.score_run = DecodeRun(self.scores, self.copier)

    @property
    def held_bytes(self) -> int:
        return self.captures.held_bytes + self.scores.held_bytes

    def over_bound(self) -> bool:
        return self.held_bytes > self.max_held_bytes

    def keys(self) -> set[str]:
        """Every request key with rows held."""
        return self.captures.keys() | self.scores.keys()

    def end_runs(self) -> None:
        """Close the open run segments (their pieces then cover every step stored)."""
        self.capture_run.reset()
        self.score_run.reset()

    def release(self, key: str, hold: bool = False) -> tuple[list[Piece], list[Piece]]:
        """Forget a request's (captured, scored) pieces and return them (still readable;
        ``hold``: their buffers kept until ``PieceStore.unhold``)."""
        self.end_runs()
        return self.captures.release(key, hold), self.scores.release(key, hold)

    def store(
        self,
        plan: StepPlan,
        captured: dict[int, torch.Tensor],
        scored: dict[int, torch.Tensor],
        keeps: Callable[[str], bool],
        block: torch.Tensor | None = None,
        version: int = -1,
    ) -> None:
        """One device-to-host copy for the step's captures and one for its probe scores; each
        request ``keeps`` wants gets a Piece (where its rows are), nothing is cut per request here.
        ``block``: the step's (L, R, H) captures when the taps gathered several layers into it.
        ``version``: the ledger's (``RequestLedger.version``); a step of a decode run with the
        same version as the last is appended to the run's segment (``decode_runs``); -1: never."""
        self.captures.compact()
        self.scores.compact()
        starts = plan.start_positions
        kept = version >= 0 and (plan.capture_slots or plan.score_slots)
        starts_np = np.asarray(starts, dtype=np.int64) if kept else None
        if plan.capture_slots and len(captured) == len(plan.capture_layers):
            layers = [captured[layer] for layer in plan.capture_layers]
            if len(layers) == 1:
                stacked = layers[0].unsqueeze(0)
            elif block is not None and block.shape[0] == len(layers):
                stacked = block  # each layer was gathered into its slot: nothing more to copy
            else:
                stacked = torch.stack(layers)  # (L, R, H), a new tensor

            def capture_piece(buffer: StepBuffer, slot: CaptureSlot) -> Piece | None:
                if not keeps(slot.key):
                    return None
                piece = Piece(buffer, slot.row_start, slot.num_rows, starts[slot.batch_index], slot.capture_layer_indices)
                self.captures.add(slot.key, piece)
                return piece

            self._store_kind(self.capture_run, plan, plan.capture_slots, stacked, stacked.shape[1], capture_piece, version, starts_np)
        if plan.score_slots and len(scored) == len(plan.probes):
            flat = torch.cat([scored[layer] for layer in plan.probes])  # float32 scores of every (row, probe) pair

            def score_piece(buffer: StepBuffer, slot: ScoreSlot) -> Piece | None:
                if not keeps(slot.key):
                    return None
                piece = Piece(buffer, 0, slot.num_rows, starts[slot.batch_index], slot.flat_offsets)
                self.scores.add(slot.key, piece)
                return piece

            self._store_kind(self.score_run, plan, plan.score_slots, flat, flat.shape[0], score_piece, version, starts_np)

    def _store_kind(
        self,
        run: DecodeRun,
        plan: StepPlan,
        slots: list[Any],
        step: torch.Tensor,
        units: int,
        new_piece: Callable[[StepBuffer, Any], Piece | None],
        version: int,
        starts: np.ndarray | None,
    ) -> None:
        """The step's rows of one kind: appended to the decode run when the step continues it,
        else one buffer of their own with a piece per request."""
        if starts is None:
            run.reset()
        elif run.continues(plan, version, starts) and run.append(step, units, slots, new_piece):
            run.follow(plan, version, starts, slots)
            return
        run.end()
        store = run.store
        with timing.phase(timing.DETAIL + "copy to host"):
            data, ready, chunk = self.copier.to_host(step, store.arena)
        buffer = store.new_buffer(data, ready, units, chunk)
        with timing.phase(timing.DETAIL + "pieces"):
            for slot in slots:
                new_piece(buffer, slot)
        store.drop_unused(buffer)
        if starts is not None:
            run.follow(plan, version, starts, slots)
