"""The worker's host copies of every step's captures and probe scores, per request key, and
the bytes they hold (the memory bound is enforced by the worker core, which knows the ledger)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from lens_evals.engine.worker.host_copy import PlainCopy
from lens_evals.engine.worker.host_store import Piece, PieceStore
from lens_evals.engine.worker.plan import StepPlan


class StepStores:
    def __init__(self, max_held_bytes: int, copier: PlainCopy | None = None) -> None:
        self.copier = copier if copier is not None else PlainCopy()  # ``host_copy.host_copier`` for the device
        self.captures = PieceStore()  # captured rows per request key
        self.scores = PieceStore(arena_chunk_bytes=4 * 2**20)  # probe scores per request key
        self.max_held_bytes = max_held_bytes

    @property
    def held_bytes(self) -> int:
        return self.captures.held_bytes + self.scores.held_bytes

    def over_bound(self) -> bool:
        return self.held_bytes > self.max_held_bytes

    def keys(self) -> set[str]:
        """Every request key with rows held."""
        return self.captures.keys() | self.scores.keys()

    def release(self, key: str, hold: bool = False) -> tuple[list[Piece], list[Piece]]:
        """Forget a request's (captured, scored) pieces and return them (still readable;
        ``hold``: their buffers kept until ``PieceStore.unhold``)."""
        return self.captures.release(key, hold), self.scores.release(key, hold)

    def store(
        self,
        plan: StepPlan,
        captured: dict[int, torch.Tensor],
        scored: dict[int, torch.Tensor],
        keeps: Callable[[str], bool],
        block: torch.Tensor | None = None,
    ) -> None:
        """One device-to-host copy for the step's captures and one for its probe scores; each
        request ``keeps`` wants gets a Piece (where its rows are), nothing is cut per request here.
        ``block``: the step's (L, R, H) captures when the taps gathered several layers into it."""
        self.captures.compact()
        self.scores.compact()
        starts = plan.start_positions
        if plan.capture_slots and len(captured) == len(plan.capture_layers):
            layers = [captured[layer] for layer in plan.capture_layers]
            if len(layers) == 1:
                stacked = layers[0].unsqueeze(0)
            elif block is not None and block.shape[0] == len(layers):
                stacked = block  # each layer was gathered into its slot: nothing more to copy
            else:
                stacked = torch.stack(layers)  # (L, R, H), a new tensor
            data, ready, chunk = self.copier.to_host(stacked, self.captures.arena)
            buffer = self.captures.new_buffer(data, ready, stacked.shape[1], chunk)
            for slot in plan.capture_slots:
                if keeps(slot.key):
                    self.captures.add(
                        slot.key, Piece(buffer, slot.row_start, slot.num_rows, starts[slot.batch_index], slot.capture_layer_indices)
                    )
            self.captures.drop_unused(buffer)
        if plan.score_slots and len(scored) == len(plan.probes):
            flat = torch.cat([scored[layer] for layer in plan.probes])  # float32 scores of every (row, probe) pair
            data, ready, chunk = self.copier.to_host(flat, self.scores.arena)
            buffer = self.scores.new_buffer(data, ready, flat.shape[0], chunk)
            for score_slot in plan.score_slots:
                if keeps(score_slot.key):
                    piece = Piece(buffer, 0, score_slot.num_rows, starts[score_slot.batch_index], score_slot.flat_offsets)
                    self.scores.add(score_slot.key, piece)
            self.scores.drop_unused(buffer)
