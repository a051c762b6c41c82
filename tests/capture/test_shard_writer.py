"""The shard writer without an engine: a shard image written through O_DIRECT and through the page
cache reads back (safetensors' own reader) as the rows put in, with the SHA-256 of the file on disk;
writer threads record shards strictly in order however their writes finish; a failure keeps the
recorded prefix and removes every later shard file."""

from __future__ import annotations

import errno
import hashlib
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from lens_evals.capture import shard_file
from lens_evals.capture import writer as writer_module
from lens_evals.capture.manifest import RowRecord, ShardRecord, shard_name
from lens_evals.capture.shard_file import FileBytes, ShardImage, sha256_of, write_file
from lens_evals.capture.writer import PendingRow, ShardWriteError, ShardWriter

LAYERS = [0, 3, 7]


def filled_image(dtype: torch.dtype, lengths: list[int], hidden: int = 37, capacity: int = 100) -> tuple[ShardImage, list[torch.Tensor]]:
    image, streams = ShardImage(LAYERS, dtype, capacity, hidden), []
    for n in lengths:
        stream = torch.randn(len(LAYERS), n, hidden).to(dtype)
        assert image.put(stream) == sum(s.shape[1] for s in streams)
        streams.append(stream)
    return image, streams


@pytest.mark.parametrize("direct", [True, False])
@pytest.mark.parametrize("dtype, hidden", [(torch.float32, 37), (torch.bfloat16, 37), (torch.bfloat16, 4096)])
def test_image_file_reads_back_as_the_rows_put_in(tmp_path: Path, dtype: torch.dtype, hidden: int, direct: bool) -> None:
    """Rows of 37 values: the layers moved together; of 4,096 bf16 values (8 KiB, whole blocks):
    each layer written from its own slot."""
    image, streams = filled_image(dtype, [10, 25, 1], hidden)
    view = image.file_view()
    assert len(view.spans) == (1 + len(LAYERS) if hidden == 4096 else 1)
    path = tmp_path / "shard.safetensors"
    write_file(path, view, direct)
    data = path.read_bytes()
    assert len(data) == len(view) and hashlib.sha256(data).hexdigest() == sha256_of(view)
    with safe_open(path, framework="pt") as handle:
        assert sorted(handle.keys()) == sorted(f"layer.{layer}" for layer in LAYERS)
        for i, layer in enumerate(LAYERS):
            assert torch.equal(handle.get_tensor(f"layer.{layer}"), torch.cat([s[i] for s in streams]))


def test_a_filesystem_refusing_o_direct_gets_the_page_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Some filesystems (older tmpfs, some network ones) refuse O_DIRECT with EINVAL at open: the
    same bytes are written through the page cache. (This machine's filesystems all take it, so
    the refusal is simulated at ``os.open``.)"""
    image, _ = filled_image(torch.float32, [5])
    view, real_open = image.file_view(), shard_file.os.open

    def refusing_open(path: Path, flags: int, mode: int = 0o777) -> int:
        if flags & shard_file.os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, mode)

    monkeypatch.setattr(shard_file.os, "open", refusing_open)
    path = tmp_path / "shard.safetensors"
    assert write_file(path, view, direct=True) is False
    monkeypatch.undo()
    assert path.read_bytes() == bytes(view)
    assert write_file(tmp_path / "direct.safetensors", view, direct=True) is True  # this disk takes it


class Recorder:
    def __init__(self) -> None:
        self.shards: list[ShardRecord] = []
        self.rows: list[RowRecord] = []

    def __call__(self, shard: ShardRecord, rows: list[RowRecord]) -> None:
        self.shards.append(shard)
        self.rows.extend(rows)


def submit_shards(writer: ShardWriter, n: int) -> list[list[torch.Tensor]]:
    contents = []
    for k in range(n):
        image, streams = filled_image(torch.float32, [3 + k, 4])
        writer.submit(shard_name, image, [PendingRow(2 * k, [1] * (3 + k), 0), PendingRow(2 * k + 1, [2] * 4, 3 + k)], None)
        contents.append(streams)
    return contents


def test_shards_are_recorded_in_order_when_later_ones_finish_first(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real_write, first = shard_file.write_file, threading.Event()

    def slow_first(path: Path, view: FileBytes, direct: bool) -> bool:
        if path.name.startswith(shard_name(0)) and not first.is_set():
            first.set()
            time.sleep(0.3)  # shards 1.. are written meanwhile by the other threads
        return real_write(path, view, direct)

    monkeypatch.setattr(writer_module, "write_file", slow_first)
    record = Recorder()
    writer = ShardWriter(tmp_path, 0, record, n_writers=3, direct=True)
    contents = submit_shards(writer, 5)
    writer.close()
    assert [s.name for s in record.shards] == [shard_name(k) for k in range(5)]
    assert [r.prompt_index for r in record.rows] == list(range(10))
    for shard, streams in zip(record.shards, contents):
        assert hashlib.sha256((tmp_path / shard.name).read_bytes()).hexdigest() == shard.sha256
        with safe_open(tmp_path / shard.name, framework="pt") as handle:
            assert torch.equal(handle.get_tensor("layer.7"), torch.cat([s[2] for s in streams]))


def run_with_failure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, n: int, failing: int, slow: int, delay: float
) -> tuple[str, list[str]]:
    """``n`` shards on 3 writers; shard ``failing`` raises ENOSPC, shard ``slow`` first waits
    ``delay`` s. Returns the failure's shard name and the names recorded (asserted on disk too)."""
    real_write = shard_file.write_file

    def write(path: Path, view: FileBytes, direct: bool) -> bool:
        if path.name.startswith(shard_name(slow)):
            time.sleep(delay)
        if path.name.startswith(shard_name(failing)):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(path, view, direct)

    monkeypatch.setattr(writer_module, "write_file", write)
    record = Recorder()
    writer = ShardWriter(tmp_path, 0, record, n_writers=3, direct=True)
    submit_shards(writer, n)
    with pytest.raises(ShardWriteError) as caught:
        writer.close()
    assert isinstance(caught.value.cause, OSError)
    recorded = [s.name for s in record.shards]
    assert sorted(p.name for p in tmp_path.iterdir()) == recorded
    return caught.value.name, recorded


def test_a_failed_shard_keeps_the_recorded_prefix_and_removes_later_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Shard 2 fails after shards 3 and 4 reached the disk: they are removed, 0 and 1 kept."""
    assert run_with_failure(tmp_path, monkeypatch, 5, failing=2, slow=2, delay=0.2) == (shard_name(2), [shard_name(0), shard_name(1)])


def test_shards_before_a_failed_one_are_still_recorded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Shard 1 fails while shard 0 is still being written: shard 0 is kept and recorded, and the
    failure named is shard 1's (what a synchronous writer would have reported)."""
    assert run_with_failure(tmp_path, monkeypatch, 4, failing=1, slow=0, delay=0.3) == (shard_name(1), [shard_name(0)])
