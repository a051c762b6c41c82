"""The capture-to-disk bench's parts that need no engine: the disk probe leaves nothing behind and
the shard writer alone writes the bytes of every row it is given (what it writes reads back as
the rows: tests/capture/test_shard_writer.py)."""

from __future__ import annotations

from pathlib import Path

from benchmarks.capture_disk import disk_bandwidth, writer_alone
from benchmarks.config import BenchConfig
from lens_evals.capture.runner import CaptureSettings


def test_disk_probe_measures_and_cleans_up(tmp_path: Path) -> None:
    for direct in (True, False):
        assert disk_bandwidth(tmp_path, (3 << 20) + 5, direct) > 0
    assert list(tmp_path.iterdir()) == []


def test_writer_alone_writes_every_row(tmp_path: Path) -> None:
    prompts = [[1] * n for n in (40, 7, 300, 5)]
    cfg = BenchConfig(model_dir="m", prompts=prompts, max_tokens=1, layer=0, num_layers=3, hidden_size=64)
    source = tmp_path / "p.jsonl"
    source.write_text("{}\n")
    seconds, n_bytes = writer_alone(cfg, source, tmp_path / "w", CaptureSettings(shard_bytes=64 << 10, writers=2))
    rows = sum(len(p) for p in prompts) * 3 * 64 * 4
    assert seconds > 0 and rows < n_bytes < rows + 4 * 4096 * 4  # the rows, and a header page per shard
    assert not (tmp_path / "w").exists()
