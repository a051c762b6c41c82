"""The worker's host store of captured rows (no engine): per-step buffers shared by requests,
assembly by absolute position, compaction of mostly-empty buffers, memory accounting.
Reference: the same rows sliced directly out of the step tensors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lens_evals.engine.frontend.rows import result_tensors
from lens_evals.engine.transport.handoff import inline
from lens_evals.engine.transport.protocol import PackedRows
from lens_evals.engine.worker.host_store import Piece, PieceStore, assemble, row_blocks


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
        packed, gaps = assemble(store.release(f"k{request}"))
        rows = PackedRows.decode(packed)
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
    packed, gaps = assemble(store.release("k7"))
    rows = PackedRows.decode(packed)
    assert gaps == [] and torch.equal(rows, torch.stack([step[:, 7] for step in steps], dim=1))
    assert store.held_bytes == 0


def test_held_pieces_keep_their_arena_region_until_unheld() -> None:
    """A request written on another thread (``early_write``) is released with ``hold``: while
    the rest of its step buffer is released and compacted and later steps take arena memory, its
    rows stay as they were (without the hold the chunk would be reused at offset 0)."""
    from lens_evals.engine.worker.host_copy import PinnedArena

    store = PieceStore()
    store.arena = PinnedArena(chunk_bytes=4096, pin=False, max_spare_bytes=2**20)  # bookkeeping only: no pinning on a CPU machine

    def step_buffer(step: torch.Tensor):
        region, chunk = store.arena.take(step.numel() * step.element_size())
        data = region.view(step.dtype).view(step.shape)
        data.copy_(step)
        return store.new_buffer(data, None, step.shape[1], chunk)

    first = _steps(1, 8, torch.float32)[0]  # (2 layers, 8 requests, hidden 8): 512 bytes
    buffer = step_buffer(first)
    for request in range(8):
        store.add(f"k{request}", Piece(buffer, request, 1, 0, None))
    held = store.release("k0", hold=True)
    for request in range(1, 7):
        store.release(f"k{request}")
    store.compact()  # k7's row copied out of the mostly-empty buffer; the buffer stays for k0
    assert store.held_bytes == buffer.nbytes + 2 * 8 * 4
    for later in _steps(12, 8, torch.float32):  # 6 KB more than the 4 KB chunk: would wrap onto it
        store.add("other", Piece(step_buffer(later + 100), 0, 8, 0, None))
        store.release("other")
        store.compact()
    rows = PackedRows.decode(assemble(held)[0])
    assert torch.equal(rows, first[:, :1])
    store.unhold(held)
    assert store.held_bytes == 2 * 8 * 4  # k7's own copy only
    store.release("k7")
    assert store.held_bytes == 0 and store.arena.used_bytes == 0


def test_recomputed_rows_overwrite_and_missing_positions_are_reported() -> None:
    data = torch.arange(2 * 6 * 3, dtype=torch.float32).reshape(2, 6, 3)
    store = PieceStore()
    first = store.new_buffer(data.clone(), None, 6)
    again = store.new_buffer(data.clone() + 1000, None, 6)
    store.add("k", Piece(first, 0, 4, 0, None))  # positions 0-3
    store.add("k", Piece(again, 0, 2, 2, None))  # positions 2-3 recomputed (preemption)
    store.add("k", Piece(again, 2, 1, 5, None))  # position 5; 4 never computed
    pieces = store.release("k")
    assert assemble(pieces) == (None, [4])  # nothing is written for rows with gaps
    blocks = row_blocks(pieces)  # (the rows as joined, to check the overwriting)
    rows = PackedRows.decode(blocks.write(inline))
    assert blocks.gaps == [4]
    np.testing.assert_array_equal(rows[:, :2], data[:, :2])
    np.testing.assert_array_equal(rows[:, 2:4], data[:, :2] + 1000)
    np.testing.assert_array_equal(rows[:, 5], data[:, 2] + 1000)


def test_probe_score_pieces_read_each_probe_from_its_offset() -> None:
    flat = torch.arange(12, dtype=torch.float32)  # layer A pairs 0-5, layer B pairs 6-11
    store = PieceStore()
    buffer = store.new_buffer(flat.clone(), None, 12)
    store.add("k0", Piece(buffer, 0, 3, 0, (0, 6)))  # two probes, three rows each
    store.add("k1", Piece(buffer, 0, 3, 0, (3, 9)))
    rows = PackedRows.decode(assemble(store.release("k1"))[0])
    assert torch.equal(rows, torch.tensor([[3.0, 4.0, 5.0], [9.0, 10.0, 11.0]]))
    store.compact()  # k0 holds half the buffer: not compacted
    rows = PackedRows.decode(assemble(store.release("k0"))[0])
    assert torch.equal(rows, torch.tensor([[0.0, 1.0, 2.0], [6.0, 7.0, 8.0]]))
    assert store.held_bytes == 0


def test_worker_data_path_with_plan_reuse_and_a_request_leaving() -> None:
    """The worker's step path without an engine (plan, layer ops, store, fetch): three requests
    decode; one leaves after 3 steps (the plan is rebuilt, its buffers compacted later). Every
    request gets exactly its own rows of each step's stream, probe scores equal w.h+b."""
    from lens_evals.engine.compat.worker import BatchLayout
    from lens_evals.engine.worker.core import WorkerCore
    from lens_evals.engine.worker.requests import WorkerLensRequest, WorkerProbe
    from lens_evals.engine.worker.taps import run_layer

    hidden_size, layer = 8, 2
    weights = torch.randn(hidden_size, generator=torch.Generator().manual_seed(1))
    core = WorkerCore(torch.device("cpu"), torch.float32, {0, 1, 2, 3})
    core.ledger.track("a", WorkerLensRequest(key="ka", capture_layers=[layer]))
    core.ledger.track("b", WorkerLensRequest(key="kb", capture_layers=[layer], probes=[WorkerProbe(0, layer, "w", weights, 0.5)]))
    core.ledger.track("c", WorkerLensRequest(key="kc", capture_layers=[layer]))
    streams: dict[str, list[torch.Tensor]] = {"a": [], "b": [], "c": []}
    generator = torch.Generator().manual_seed(0)
    previous_plan = None
    for step in range(6):
        names = ["a", "b", "c"] if step < 3 else ["a", "b"]
        rows = [2 if step == 0 else 1 for _ in names]  # a 2-token prefill, then decode
        hidden = torch.randn(sum(rows), hidden_size, generator=generator)
        residual = torch.randn(sum(rows), hidden_size, generator=generator)
        plan = core.plan_step(BatchLayout(names, rows, [0 if step == 0 else step + 1] * len(names)), None)
        if step == 2:
            assert plan is previous_plan  # same requests and row counts: reused
        previous_plan = plan
        step_context = core.begin_step(plan)
        run_layer(step_context, layer, hidden, residual)
        core.store_step(step_context)
        offset = 0
        for name, n in zip(names, rows):
            streams[name].append((hidden + residual)[offset : offset + n])
            offset += n
        if step == 2:
            result = core.pop_result("kc")  # fetched as it finishes, like the frontend does
            core.finish("c")
    results = {"c": result, "a": core.pop_result("ka"), "b": core.pop_result("kb")}
    for name, result in results.items():
        tensors = result_tensors(result)
        want = torch.cat(streams[name])
        assert torch.equal(tensors["residual_stream"][0], want), name
        if name == "b":
            torch.testing.assert_close(tensors["probe_scores"][0], want @ weights + 0.5)
    assert core.held_bytes == 0


def test_packed_rows_refuse_unknown_dtypes_and_wrong_lengths() -> None:
    good = PackedRows.header(torch.float32, (2, 3)) | {"data": bytearray(2 * 3 * 4)}
    assert PackedRows.decode(good).shape == (2, 3)
    assert PackedRows.decode({**good, "data": bytes(24)}).shape == (2, 3)  # bytes (msgpack) work too
    with pytest.raises(ValueError, match="dtype"):
        PackedRows.decode({**good, "dtype": "object"})
    with pytest.raises(ValueError, match="shape"):
        PackedRows.decode({**good, "shape": [2, 4]})


def test_arena_regions_never_overlap_while_live_and_chunks_are_reused() -> None:
    from lens_evals.engine.worker.host_copy import PinnedArena

    arena = PinnedArena(chunk_bytes=4096, pin=False, max_spare_bytes=2**20)  # bookkeeping only: no pinning on a CPU machine
    live: list[tuple[torch.Tensor, object]] = []
    for size in (1000, 1500, 1200, 3000, 5000):  # the 5000-byte step gets a chunk of its own size
        region, chunk = arena.take(size)
        region.fill_(len(live) + 1)
        live.append((region, chunk))
    for index, (region, _) in enumerate(live):  # every region still holds what was written to it
        assert region.numel() in (1000, 1500, 1200, 3000, 5000) and bool((region == index + 1).all())
    pinned = arena.pinned_bytes
    assert pinned == 4096 * 2 + 5120  # two 4 KiB chunks and one of the big step's size (aligned)
    for _, chunk in live:
        arena.give_back(chunk)
    again = [arena.take(1000) for _ in range(8)]  # 8 KB more: served from the freed chunks
    assert arena.pinned_bytes == pinned
    starts = sorted((c.data.data_ptr(), r.data_ptr()) for r, c in again)
    assert len({ptr for _, ptr in starts}) == 8  # eight distinct regions


def test_arena_keeps_spare_chunks_by_bytes_the_last_runs_peak_at_most_the_cap() -> None:
    """A run like the last pins nothing afresh; a smaller run after a large one gives the large
    one's memory back; the cap bounds what is kept whatever the peak."""
    from lens_evals.engine.worker.host_copy import PinnedArena

    def run(arena: PinnedArena, steps: int) -> int:
        """``steps`` step buffers of a chunk each, held at once, then all fetched: how many chunks
        were pinned afresh."""
        pinned = arena.pinned_bytes
        held = [arena.take(4096)[1] for _ in range(steps)]
        fresh = (arena.pinned_bytes - pinned) // 4096
        for chunk in held:
            arena.give_back(chunk)
        return fresh

    arena = PinnedArena(chunk_bytes=4096, pin=False, max_spare_bytes=10 * 4096)
    assert run(arena, 24) == 24  # the first run pins every chunk
    assert arena.used_bytes == 0 and arena.last_peak == 24 * 4096
    assert arena.pinned_bytes == 10 * 4096  # kept: its peak, capped at 10 chunks
    assert run(arena, 8) == 0  # a smaller run: all from the spares ...
    assert arena.pinned_bytes == 8 * 4096  # ... and afterwards only its own peak is kept
    assert run(arena, 8) == 0 and arena.pinned_bytes == 8 * 4096
    assert run(arena, 9) == 1  # one chunk more than the last run had
    assert arena.pinned_bytes == 9 * 4096

    uncapped = PinnedArena(chunk_bytes=4096, pin=False, max_spare_bytes=2**30)
    run(uncapped, 24)
    assert uncapped.pinned_bytes == 24 * 4096 and run(uncapped, 24) == 0  # the old count bound (16) re-pinned 8
    none_kept = PinnedArena(chunk_bytes=4096, pin=False, max_spare_bytes=0)
    run(none_kept, 4)
    assert none_kept.pinned_bytes == 0 and run(none_kept, 4) == 4


def test_arena_spare_bound_is_the_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    from lens_evals.engine.worker.host_copy import PinnedArena

    monkeypatch.setenv("LENS_EVALS_PINNED_SPARE_GIB", "0.5")
    assert PinnedArena(pin=False).max_spare_bytes == 2**29
    monkeypatch.delenv("LENS_EVALS_PINNED_SPARE_GIB")
    assert PinnedArena(pin=False).max_spare_bytes == 4 * 2**30


def test_the_copy_is_chosen_by_device_and_none_is_made_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    from lens_evals.engine.worker.host_copy import PinnedArena, PlainCopy, StreamCopy, host_copier

    copier = host_copier(torch.device("cpu"))
    assert type(copier) is PlainCopy and not copier.overlap and copier.set_overlap(True) is False
    arena = PinnedArena(pin=False)
    rows = torch.randn(2, 3, 8)
    host, ready, chunk = copier.to_host(rows, arena)
    assert host is rows and ready is None and chunk is None and arena.pinned_bytes == 0  # as it is: no copy, nothing pinned
    assert copier.copies == 1 and copier.overlapped == 0
    with pytest.raises(ValueError, match="copier of its device"):
        copier.to_host(torch.empty(2, device="meta"), arena)
    monkeypatch.setenv("LENS_EVALS_COPY_OVERLAP", "0")  # a CUDA device: the stream copy, its mode from the setting
    assert isinstance(host_copier(torch.device("cuda", 0)), StreamCopy) and not host_copier(torch.device("cuda", 0)).overlap
    monkeypatch.delenv("LENS_EVALS_COPY_OVERLAP")
    assert host_copier(torch.device("cuda", 0)).overlap
