"""A shard as one page-aligned host buffer laid out exactly as its safetensors file: the 8-byte
header length, the JSON header padded with spaces to a whole number of pages, then one tensor per
layer, ``layer.{L}`` of shape ``(n_tokens, hidden)``, back to back. Rows are copied in once (into
per-layer slots of the buffer's full capacity); at the write the layers are moved together in
place (not even that where a row is a whole number of blocks) and the file is written in large
sequential writes straight from the buffer, with
``O_DIRECT`` where the filesystem takes it (the page cache of a busy host writes several times
slower than the disk, see docs/capture.md), hashed from memory (no read-back)."""

from __future__ import annotations

import ctypes
import errno
import hashlib
import json
import mmap
import os
from pathlib import Path

import torch

ALIGN = 4096  # O_DIRECT needs offsets, lengths and addresses aligned to the device's block (<= a page)
WRITE_CHUNK = 64 << 20  # bytes per write call: large and sequential
SAFETENSORS_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64"}


def round_up(n: int, to: int = ALIGN) -> int:
    return -(-n // to) * to


def _header(layers: list[int], dtype: torch.dtype, n_tokens: int, hidden: int, element_size: int) -> bytes:
    layer_bytes = n_tokens * hidden * element_size
    meta = {
        f"layer.{layer}": {
            "dtype": SAFETENSORS_DTYPES[dtype],
            "shape": [n_tokens, hidden],
            "data_offsets": [i * layer_bytes, (i + 1) * layer_bytes],
        }
        for i, layer in enumerate(layers)
    }
    return json.dumps(meta, separators=(",", ":")).encode()


class ShardImage:
    """``(n_layers, capacity_tokens, hidden)`` rows in one page-aligned anonymous mapping, behind a
    header region sized for the longest header this capacity can need."""

    def __init__(self, layers: list[int], dtype: torch.dtype, capacity_tokens: int, hidden: int) -> None:
        if dtype not in SAFETENSORS_DTYPES:
            raise ValueError(f"captures of dtype {dtype} cannot be written as a shard (supported: {list(SAFETENSORS_DTYPES)})")
        self.layers, self.dtype, self.capacity, self.hidden = list(layers), dtype, capacity_tokens, hidden
        self.element_size = torch.empty((), dtype=dtype).element_size()
        self.row_bytes = hidden * self.element_size
        longest = _header(self.layers, dtype, capacity_tokens, hidden, self.element_size)
        self.data_start = round_up(8 + len(longest))
        size = round_up(self.data_start + len(self.layers) * capacity_tokens * self.row_bytes)
        self._map = mmap.mmap(-1, size)  # anonymous: page-aligned, returned to the system on close
        self.bytes = torch.frombuffer(self._map, dtype=torch.uint8)
        data = self.bytes[self.data_start : self.data_start + len(self.layers) * capacity_tokens * self.row_bytes]
        self.rows = data.view(dtype).view(len(self.layers), capacity_tokens, hidden)
        self.used = 0  # tokens filled in every layer's slot
        self._address = self.bytes.data_ptr()

    @property
    def n_bytes(self) -> int:
        return len(self._map)

    def put(self, stream: torch.Tensor) -> int:
        """Copy one prompt's ``(n_layers, n_tokens, hidden)`` after the rows already held; returns its offset."""
        offset, n_tokens = self.used, stream.shape[1]
        self.rows[:, offset : offset + n_tokens].copy_(stream)
        self.used += n_tokens
        return offset

    def file_view(self) -> FileBytes:
        """The shard file's bytes for the rows held, in file order: the padded header, then each
        layer's rows. Where a row is a whole number of blocks (a 4,096-wide bf16 model) each layer
        is written from its own slot; otherwise the layers are first moved together in place (the
        slots are then no longer valid for :meth:`put` until :meth:`reset`)."""
        layer_bytes = self.used * self.row_bytes
        header = _header(self.layers, self.dtype, self.used, self.hidden, self.element_size)
        padded = header + b" " * (self.data_start - 8 - len(header))
        self._map[0:8] = (len(padded)).to_bytes(8, "little")
        self._map[8 : self.data_start] = padded
        slot_bytes = self.capacity * self.row_bytes
        if self.row_bytes % ALIGN == 0:
            spans = [(0, self.data_start)] + [(self.data_start + i * slot_bytes, layer_bytes) for i in range(len(self.layers))]
        else:
            base = self._address + self.data_start
            for i in range(1, len(self.layers)):  # leftwards, in order: each source lies right of its destination
                ctypes.memmove(base + i * layer_bytes, base + i * slot_bytes, layer_bytes)
            spans = [(0, self.data_start + len(self.layers) * layer_bytes)]
        return FileBytes(memoryview(self._map), spans)

    def reset(self) -> None:
        self.used = 0


class FileBytes:
    """A file's bytes as spans of one page-aligned mapping, in file order; every span but the
    last is a whole number of blocks (so each can be written with ``O_DIRECT``)."""

    def __init__(self, mapping: memoryview, spans: list[tuple[int, int]]) -> None:
        self.mapping, self.spans = mapping, spans

    def __len__(self) -> int:
        return sum(length for _, length in self.spans)

    def __bytes__(self) -> bytes:
        return b"".join(bytes(part) for part in self.parts())

    def parts(self, pad_last: bool = False) -> list[memoryview]:
        """The spans as views; with ``pad_last`` the last is extended to a whole block (within the
        mapping, whose length is a whole number of pages: the caller truncates the file after)."""
        views = [self.mapping[start : start + length] for start, length in self.spans]
        if pad_last:
            start, length = self.spans[-1]
            views[-1] = self.mapping[start : start + round_up(length)]
        return views

    def release(self) -> None:
        self.mapping.release()


def _write_all(fd: int, parts: list[memoryview]) -> None:
    for data in parts:
        done = 0
        while done < len(data):
            done += os.write(fd, data[done : done + WRITE_CHUNK])


def write_file(path: Path, view: FileBytes, direct: bool) -> bool:
    """Write ``view`` as ``path`` and fsync it; with ``direct`` through ``O_DIRECT`` if the
    filesystem takes it. Returns whether ``O_DIRECT`` was used (False: the filesystem refused it,
    e.g. tmpfs, and the page cache wrote it)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    if direct and hasattr(os, "O_DIRECT"):
        try:
            fd = os.open(path, flags | os.O_DIRECT, 0o644)
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
        else:
            try:
                _write_all(fd, view.parts(pad_last=True))  # the last block padded: truncated below
                os.ftruncate(fd, len(view))
                os.fsync(fd)
                return True
            except OSError as exc:
                if exc.errno != errno.EINVAL:  # EINVAL: this filesystem takes the flag but not the write
                    raise
            finally:
                os.close(fd)
    fd = os.open(path, flags, 0o644)
    try:
        _write_all(fd, view.parts())
        os.fsync(fd)
    finally:
        os.close(fd)
    return False


def sha256_of(view: FileBytes) -> str:
    """SHA-256 of the file's bytes in memory (hashlib releases the GIL on large updates)."""
    digest = hashlib.sha256()
    for part in view.parts():
        for begin in range(0, len(part), WRITE_CHUNK):
            digest.update(part[begin : begin + WRITE_CHUNK])
    return digest.hexdigest()
