"""The worker-to-frontend hand-off of row blocks through files (no engine: the engine path is in
test_engine_modes.py). Reference: the same rows assembled into inline bytes."""

from __future__ import annotations

import os

import pytest
import torch

from lens_evals.engine import handoff
from lens_evals.engine.handoff import HandoffTarget, sink_for, claim, claim_all
from lens_evals.engine.store import Piece, PieceStore, assemble, result_tensors


@pytest.fixture
def target(tmp_path, monkeypatch) -> dict:
    """A frontend hand-off target in ``tmp_path``, as another process would send it."""
    monkeypatch.setenv(handoff.DIR_ENV, str(tmp_path))
    monkeypatch.setenv(handoff.MIN_BYTES_ENV, "0")  # the test's small blocks go to files too
    monkeypatch.setattr(HandoffTarget, "_current", None)
    sent = HandoffTarget.for_this_process()
    assert sent is not None and sent["dir"] == str(tmp_path)
    yield {**sent, "pid": -1}  # as if the frontend were another process
    os.unlink(HandoffTarget._current.marker)


def _pieces(dtype: torch.dtype, request: str = "k") -> list[Piece]:
    store = PieceStore()
    generator = torch.Generator().manual_seed(1)
    for step in range(3):
        rows = torch.randn(2, 4, 300, generator=generator).to(dtype)  # (layers, rows, hidden)
        buffer = store.new_buffer(rows, None, 4)
        store.add(request, Piece(buffer, 1, 2, 2 * step, None))
    return store.release(request)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_through_a_file_equal_inline_rows_and_the_file_is_gone(tmp_path, target, dtype) -> None:
    pieces = _pieces(dtype)
    inline_packed, _ = assemble(pieces)
    packed, gaps = assemble(pieces, sink_for(target))
    assert gaps == [] and "file" in packed and "data" not in packed
    assert len(list(tmp_path.glob(handoff.ROWS_PREFIX + "*"))) == 1
    reply = [{"k": {"residual_stream": packed, "layers": [3, 5]}}]
    claim_all(reply)
    assert list(tmp_path.glob(handoff.ROWS_PREFIX + "*")) == []  # unlinked on claim, still mapped
    rows = result_tensors(reply[0]["k"])["residual_stream"]
    want = result_tensors({"residual_stream": inline_packed, "layers": [3, 5]})["residual_stream"]
    assert rows.shape == (2, 6, 300) and torch.equal(rows, want)
    rows += 1  # writable, like inline rows
    assert torch.equal(rows, want + 1)


def test_small_blocks_same_process_and_unseen_markers_stay_inline(target, monkeypatch) -> None:
    pieces = _pieces(torch.float32)
    monkeypatch.setenv(handoff.MIN_BYTES_ENV, str(10**9))
    assert "data" in assemble(pieces, sink_for(target))[0]
    monkeypatch.setenv(handoff.MIN_BYTES_ENV, "0")
    assert "data" in assemble(pieces, sink_for({**target, "pid": os.getpid()}))[0]
    assert "data" in assemble(pieces, sink_for({**target, "token": "0" * 32}))[0]  # no such marker
    assert "data" in assemble(pieces, sink_for(None))[0]
    monkeypatch.setenv(handoff.HANDOFF_ENV, "0")
    assert "data" in assemble(pieces, sink_for(target))[0]


def test_claim_refuses_foreign_names_and_missing_files(target) -> None:
    for name in ("../etc/passwd", "lens_evals-rows-xyz", handoff.MARKER_PREFIX + target["token"]):
        with pytest.raises(ValueError, match="unexpected hand-off file name"):
            claim({"file": name, "nbytes": 0, "dtype": "float32", "shape": [0]})
    with pytest.raises(ValueError, match="is gone"):
        claim({"file": handoff.ROWS_PREFIX + "0" * 32, "nbytes": 4, "dtype": "float32", "shape": [1]})
    packed, _ = assemble(_pieces(torch.float32), sink_for(target))
    with pytest.raises(ValueError, match="bytes, the reply says"):
        claim({**packed, "nbytes": packed["nbytes"] + 4})


def test_short_writes_are_finished_block_by_block(tmp_path, monkeypatch) -> None:
    """writev may write less than asked (signals, size limits): the rest still lands in order."""
    blocks = [bytes([i]) * (1000 + i) for i in range(5)]
    real_writev = os.writev

    def short_writev(fd: int, views: list) -> int:  # the kernel writing only 1500 bytes
        return os.write(fd, b"".join(bytes(v) for v in views)[:1500]) if len(views) > 1 else real_writev(fd, views)

    monkeypatch.setattr(handoff.os, "writev", short_writev)
    path = tmp_path / "rows"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT)
    try:
        assert handoff._write_all(fd, blocks) == sum(map(len, blocks))
    finally:
        os.close(fd)
    assert path.read_bytes() == b"".join(blocks)
