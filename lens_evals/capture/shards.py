"""Shards: safetensors files holding one tensor per layer, ``layer.{L}`` of shape
``(n_tokens_in_shard, hidden)``, the rows of several prompts one after another. A shard is filled
in a preallocated image laid out as its file (``shard_file``; images are pooled and reused, so host
memory stays at a few shards), then written by a writer thread (``writer``) to a temporary name,
fsynced and renamed into place."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path

import torch

from lens_evals.capture.manifest import CaptureError, ShardRecord
from lens_evals.capture.shard_file import ShardImage
from lens_evals.capture.writer import ImagePool, PendingRow


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


class ShardBuffer:
    """Rows waiting for the next shard: at most ``max_rows`` prompts and ``max_bytes`` of captures,
    in an image from a pool of ``n_images`` (made on the first row, when dtype and width are known)."""

    def __init__(self, layers: list[int], max_rows: int, max_bytes: int, n_images: int) -> None:
        self.layers, self.max_rows, self.max_bytes, self.n_images = layers, max_rows, max_bytes, n_images
        self.pool: ImagePool | None = None
        self.image: ShardImage | None = None
        self.rows: list[PendingRow] = []

    def capacity_tokens(self, stream: torch.Tensor) -> int:
        n_layers, _, hidden = stream.shape
        return max(1, self.max_bytes // (n_layers * hidden * stream.element_size()))

    def fits(self, stream: torch.Tensor) -> bool:
        used = self.image.used if self.image is not None else 0
        return used + stream.shape[1] <= self.capacity_tokens(stream)

    def add(self, prompt_index: int, token_ids: list[int], stream: torch.Tensor) -> None:
        """Copy one prompt's capture ``(n_layers, n_tokens, hidden)`` into the image (caller checked :meth:`fits`)."""
        if self.pool is None:
            capacity, dtype, hidden = self.capacity_tokens(stream), stream.dtype, stream.shape[2]
            self.pool = ImagePool(self.n_images, lambda: ShardImage(self.layers, dtype, capacity, hidden))
        if self.image is None:
            self.image = self.pool.take()  # waits while every image is being written
        self.rows.append(PendingRow(prompt_index, token_ids, self.image.put(stream)))

    @property
    def full(self) -> bool:
        return self.image is not None and (len(self.rows) >= self.max_rows or self.image.used >= self.image.capacity)

    def take(self) -> tuple[ShardImage, list[PendingRow], Callable[[ShardImage], None]]:
        """The filled image, its rows and how to give it back; the buffer starts a new shard."""
        assert self.image is not None and self.pool is not None and self.rows, "no rows to write"
        taken = (self.image, self.rows, self.pool.give_back)
        self.image, self.rows = None, []
        return taken


def single_row_image(layers: list[int], stream: torch.Tensor) -> ShardImage:
    """One prompt too large for a shard buffer, in an image of its own (not pooled)."""
    image = ShardImage(layers, stream.dtype, stream.shape[1], stream.shape[2])
    image.put(stream)
    return image
