"""The worker's host store of captured rows (no engine): per-step buffers shared by requests,
assembly by absolute position, compaction of mostly-empty buffers, memory accounting.
Reference: the same rows sliced directly out of the step tensors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lens_evals.engine.store import Piece, PieceStore, assemble


def _steps(num_steps: int, num_requests: int, dtype: torch.dtype) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randn(2, num_requests, 8, generator=generator).to(dtype) for _ in range(num_steps)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_come_back_by_position_and_memory_returns_to_zero(dtype: torch.dtype) -> None:
    steps = _steps(6, 4, dtype)
    store = PieceStore()
    for step_index, step in enumerate(steps):
        buffer = store.new_buffer(step.clone(), None, step.shape[1])
        for request in range(4):
            # request r keeps layer slots (1,) when odd, both layers otherwise; one row per step
            slots = (1,) if request % 2 else None
            store.add(f"k{request}", Piece(buffer, request, 1, step_index, slots))
    assert store.held_bytes == sum(s.numel() * s.element_size() for s in steps)
    for request in range(4):
        rows, gaps = assemble(store.release(f"k{request}"))
        want = torch.stack([step[:, request] for step in steps], dim=1)
        want = want[1:] if request % 2 else want
        assert gaps == []
        assert rows.dtype == dtype and torch.equal(rows, want)
        store.compact()
    assert store.held_bytes == 0 and store.keys() == set()


def test_a_long_request_does_not_keep_a_whole_batch_alive() -> None:
    steps = _steps(3, 8, torch.float32)
    store = PieceStore()
    for step_index, step in enumerate(steps):
        buffer = store.new_buffer(step.clone(), None, 8)
        for request in range(8):
            store.add(f"k{request}", Piece(buffer, request, 1, step_index, None))
    full = store.held_bytes
    for request in range(7):  # the short ones finish; k7 goes on
        store.release(f"k{request}")
    assert store.held_bytes == full  # nothing copied or freed until the next step ...
    store.compact()
    one_row = 2 * 8 * 4  # two layers x hidden 8 x float32, per step
    assert store.held_bytes == 3 * one_row  # ... then only k7's rows are held
    rows, gaps = assemble(store.release("k7"))
    assert gaps == [] and torch.equal(rows, torch.stack([step[:, 7] for step in steps], dim=1))
    assert store.held_bytes == 0


def test_recomputed_rows_overwrite_and_missing_positions_are_reported() -> None:
    data = torch.arange(2 * 6 * 3, dtype=torch.float32).reshape(2, 6, 3)
    store = PieceStore()
    first = store.new_buffer(data.clone(), None, 6)
    again = store.new_buffer(data.clone() + 1000, None, 6)
    store.add("k", Piece(first, 0, 4, 0, None))  # positions 0-3
    store.add("k", Piece(again, 0, 2, 2, None))  # positions 2-3 recomputed (preemption)
    store.add("k", Piece(again, 2, 1, 5, None))  # position 5; 4 never computed
    rows, gaps = assemble(store.release("k"))
    assert gaps == [4]
    np.testing.assert_array_equal(rows[:, :2], data[:, :2])
    np.testing.assert_array_equal(rows[:, 2:4], data[:, :2] + 1000)
    np.testing.assert_array_equal(rows[:, 5], data[:, 2] + 1000)


def test_probe_score_pieces_read_each_probe_from_its_offset() -> None:
    flat = torch.arange(12, dtype=torch.float32)  # layer A pairs 0-5, layer B pairs 6-11
    store = PieceStore()
    buffer = store.new_buffer(flat.clone(), None, 12)
    store.add("k0", Piece(buffer, 0, 3, 0, (0, 6)))  # two probes, three rows each
    store.add("k1", Piece(buffer, 0, 3, 0, (3, 9)))
    rows, _ = assemble(store.release("k1"))
    assert torch.equal(rows, torch.tensor([[3.0, 4.0, 5.0], [9.0, 10.0, 11.0]]))
    store.compact()  # k0 holds half the buffer: not compacted
    rows, _ = assemble(store.release("k0"))
    assert torch.equal(rows, torch.tensor([[0.0, 1.0, 2.0], [6.0, 7.0, 8.0]]))
    assert store.held_bytes == 0
