"""The worker's host copies of every step's readout results (``worker/readouts.py``), per
request key: ONE device-to-host copy per step (``host_copy``), each job a ``Piece`` of that flat
buffer (``host_store``: held bytes, release, compaction), joined by absolute position at the
fetch into one small float32 block per readout (inline bytes: readouts are small)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from lens_evals.engine.transport.protocol import PackedRows, ReadoutWire
from lens_evals.engine.worker.host_copy import PlainCopy
from lens_evals.engine.worker.host_store import Piece, PieceStore, gaps_error
from lens_evals.engine.worker.readouts import StepReadouts


@dataclass(frozen=True)
class ReadoutPiece:
    """One job's results: ``num_rows`` positions from ``first_position`` of readout ``index``
    at ``layer``, ``width`` floats per row, in ``piece`` (its flat span)."""

    piece: Piece
    index: int
    layer: int
    first_position: int
    num_rows: int
    width: int


class ReadoutStore:
    def __init__(self, copier: PlainCopy | None = None) -> None:
        self.copier = copier if copier is not None else PlainCopy()
        self.pieces = PieceStore(arena_chunk_bytes=4 * 2**20)
        self.by_key: dict[str, list[ReadoutPiece]] = {}

    @property
    def held_bytes(self) -> int:
        return self.pieces.held_bytes

    def keys(self) -> set[str]:
        return set(self.by_key)

    def store(self, step: StepReadouts, results: list[torch.Tensor], start_positions: list[int], keeps: Callable[[str], bool]) -> None:
        """The step's results (flat, in job order) to the host in one copy; a piece per job kept."""
        self.pieces.compact()
        stored = step.stored_jobs()
        if not stored or sum(r.numel() for r in results) != step.total:
            return
        flat = results[0] if len(results) == 1 else torch.cat(results)
        data, ready, chunk = self.copier.to_host(flat, self.pieces.arena)
        buffer = self.pieces.new_buffer(data, ready, flat.shape[0], chunk)
        for job in stored:
            if not keeps(job.key):
                continue
            size = job.num_rows * job.readout.width
            piece = Piece(buffer, 0, size, 0, (job.offset,))
            self.pieces.add(job.key, piece)
            first = start_positions[job.batch_index]
            entry = ReadoutPiece(piece, job.readout.index, job.layer, first, job.num_rows, job.readout.width)
            self.by_key.setdefault(job.key, []).append(entry)
        self.pieces.drop_unused(buffer)

    def release(self, key: str) -> list[ReadoutPiece]:
        self.pieces.release(key)
        return self.by_key.pop(key, [])


def assemble(entries: list[ReadoutPiece], layers_of: dict[int, tuple[int, ...]]) -> tuple[dict[str, ReadoutWire], str | None]:
    """Per readout index, its ``(n_layers, n_positions, width)`` block joined by position (later
    pieces, a recomputation after preemption, overwrite earlier ones), packed inline; or an error
    naming the positions no piece covered."""
    out: dict[str, ReadoutWire] = {}
    for index, layers in layers_of.items():
        mine = [e for e in entries if e.index == index]
        if not mine:
            continue
        width = mine[0].width
        last = max(e.first_position + e.num_rows for e in mine)
        block = np.zeros((len(layers), last, width), dtype=np.float32)
        covered = np.zeros((len(layers), last), dtype=bool)
        slot = {layer: i for i, layer in enumerate(layers)}
        for e in mine:
            rows = e.piece.rows().reshape(e.num_rows, width)  # a read-only view: waits for the step's copy
            span = slice(e.first_position, e.first_position + e.num_rows)
            block[slot[e.layer], span] = rows
            covered[slot[e.layer], span] = True
        if not covered.all():
            gaps = np.flatnonzero(~covered.all(axis=0))[:10].tolist()
            return {}, gaps_error(f"readout {index}", gaps)
        packed = PackedRows.header(torch.float32, block.shape) | {"data": block.tobytes()}
        out[str(index)] = {"layers": list(layers), "rows": packed}
    return out, None
