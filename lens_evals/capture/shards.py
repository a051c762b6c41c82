"""Shards: safetensors files holding one tensor per layer, ``layer.{L}`` of shape
``(n_tokens_in_shard, hidden)``, the rows of several prompts one after another. A shard is filled
in one preallocated buffer (reused from shard to shard, so host memory stays at one shard), then
written to a temporary name, fsynced, hashed and renamed into place."""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import save_file

from lens_evals.capture.manifest import CaptureError, RowRecord, ShardRecord


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def check_shard_file(path: Path, record: ShardRecord, verify: bool) -> None:
    """A clear :class:`CaptureError` unless ``path`` is the shard ``record`` describes: present, its
    size and (with ``verify``) its SHA-256."""
    if not path.is_file():
        raise CaptureError(f"shard {path} is missing (the manifest records it)")
    size = path.stat().st_size
    if size != record.n_bytes:
        raise CaptureError(f"shard {path} is corrupted: {size} bytes, the manifest records {record.n_bytes}")
    if verify and file_sha256(path) != record.sha256:
        raise CaptureError(f"shard {path} is corrupted: its SHA-256 differs from the manifest's")


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_shard(out_dir: Path, name: str, tensors: dict[str, torch.Tensor]) -> tuple[int, str]:
    """Write ``tensors`` as ``out_dir/name`` atomically; returns (bytes, sha256) of the file."""
    path = out_dir / name
    tmp = path.with_name(path.name + ".tmp")
    try:
        save_file(tensors, tmp)
        with open(tmp, "rb+") as handle:
            os.fsync(handle.fileno())
        sha256 = file_sha256(tmp)
        n_bytes = tmp.stat().st_size
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(out_dir)
    return n_bytes, sha256


@dataclass
class PendingRow:
    prompt_index: int
    token_ids: list[int]
    offset: int


@dataclass
class ShardBuffer:
    """Rows waiting for the next shard: at most ``max_rows`` prompts and ``max_bytes`` of captures."""

    layers: list[int]
    max_rows: int
    max_bytes: int
    buffer: torch.Tensor | None = None  # (n_layers, capacity_tokens, hidden), allocated on the first row
    rows: list[PendingRow] = field(default_factory=list)
    used_tokens: int = 0

    def capacity_tokens(self, stream: torch.Tensor) -> int:
        n_layers, _, hidden = stream.shape
        return max(1, self.max_bytes // (n_layers * hidden * stream.element_size()))

    def fits(self, stream: torch.Tensor) -> bool:
        return self.used_tokens + stream.shape[1] <= self.capacity_tokens(stream)

    def add(self, prompt_index: int, token_ids: list[int], stream: torch.Tensor) -> None:
        """Copy one prompt's capture ``(n_layers, n_tokens, hidden)`` into the buffer (caller checked :meth:`fits`)."""
        if self.buffer is None:
            self.buffer = torch.empty((stream.shape[0], self.capacity_tokens(stream), stream.shape[2]), dtype=stream.dtype)
        n_tokens = stream.shape[1]
        self.buffer[:, self.used_tokens : self.used_tokens + n_tokens].copy_(stream)
        self.rows.append(PendingRow(prompt_index, token_ids, self.used_tokens))
        self.used_tokens += n_tokens

    @property
    def full(self) -> bool:
        return len(self.rows) >= self.max_rows or (self.buffer is not None and self.used_tokens >= self.buffer.shape[1])

    def write(self, out_dir: Path, name: str) -> tuple[ShardRecord, list[RowRecord]]:
        """Write the pending rows as shard ``name`` and empty the buffer (kept for the next shard)."""
        assert self.buffer is not None and self.rows, "no rows to write"
        tensors = {f"layer.{layer}": self.buffer[i, : self.used_tokens] for i, layer in enumerate(self.layers)}
        records = _records(name, self.rows, self.used_tokens, out_dir, tensors)
        self.rows, self.used_tokens = [], 0
        return records


def write_single_row(
    out_dir: Path, name: str, layers: list[int], prompt_index: int, token_ids: list[int], stream: torch.Tensor
) -> tuple[ShardRecord, list[RowRecord]]:
    """One prompt too large for the shard buffer, as a shard of its own (written from its own tensor)."""
    tensors = {f"layer.{layer}": stream[i].contiguous() for i, layer in enumerate(layers)}
    return _records(name, [PendingRow(prompt_index, token_ids, 0)], stream.shape[1], out_dir, tensors)


def _records(
    name: str, rows: list[PendingRow], n_tokens: int, out_dir: Path, tensors: dict[str, torch.Tensor]
) -> tuple[ShardRecord, list[RowRecord]]:
    n_bytes, sha256 = write_shard(out_dir, name, tensors)
    shard = ShardRecord(name=name, n_bytes=n_bytes, sha256=sha256, n_rows=len(rows), n_tokens=n_tokens)
    return shard, [RowRecord(prompt_index=r.prompt_index, shard=name, offset=r.offset, token_ids=r.token_ids) for r in rows]
