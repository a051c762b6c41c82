"""Read a capture written by ``lens-evals capture`` without loading it whole: rows one prompt at a
time, or ``(features, prompt_index)`` batches of one layer. Shards are memory-mapped (safetensors)
one at a time; before a shard is first read its size and SHA-256 are checked against the manifest,
and a mismatch names the shard."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open

from lens_evals.capture.manifest import CaptureError, CaptureManifest, RowRecord, read_manifest
from lens_evals.capture.shards import check_shard_file


@dataclass(frozen=True)
class CaptureRow:
    prompt_index: int
    token_ids: list[int]
    activations: torch.Tensor  # (n_layers, n_tokens, hidden), the layers asked for, ascending


class CaptureReader:
    """``CaptureReader(out_dir)``; ``verify=False`` skips the SHA-256 check (the size is always checked)."""

    def __init__(self, out_dir: str | Path, verify: bool = True) -> None:
        self.out_dir = Path(out_dir)
        manifest = read_manifest(self.out_dir)
        if manifest is None:
            raise CaptureError(f"{self.out_dir} holds no capture manifest (manifest.json)")
        self.manifest: CaptureManifest = manifest
        self.verify = verify
        self._checked: set[str] = set()
        self._shards = {shard.name: shard for shard in manifest.shards}

    def __len__(self) -> int:
        return len(self.manifest.rows)

    @property
    def layers(self) -> list[int]:
        return list(self.manifest.layers)

    def check_shard(self, name: str) -> Path:
        """The shard's path once its size (and, with ``verify``, SHA-256) match the manifest."""
        path = self.out_dir / name
        if name in self._checked:
            return path
        check_shard_file(path, self._shards[name], self.verify)
        self._checked.add(name)
        return path

    def verify_all(self) -> None:
        """Check every shard now (otherwise each is checked when first read)."""
        for shard in self.manifest.shards:
            self.check_shard(shard.name)

    def _layer_names(self, layers: Sequence[int] | None) -> list[str]:
        chosen = self.layers if layers is None else sorted(set(layers))
        if not chosen:
            raise CaptureError("name at least one layer")
        missing = [layer for layer in chosen if layer not in self.manifest.layers]
        if missing:
            raise CaptureError(f"layers {missing} were not captured (captured: {self.manifest.layers})")
        return [self.manifest.tensor_name(layer) for layer in chosen]

    def _by_shard(self, rows: Sequence[RowRecord]) -> Iterator[tuple[object, list[RowRecord]]]:
        order: dict[str, list[RowRecord]] = {}
        for row in rows:
            order.setdefault(row.shard, []).append(row)
        for name, shard_rows in order.items():
            with safe_open(self.check_shard(name), framework="pt") as handle:
                yield handle, shard_rows

    def rows(self, layers: Sequence[int] | None = None, prompt_indices: Sequence[int] | None = None) -> Iterator[CaptureRow]:
        """Rows in the order written (or only ``prompt_indices``), one shard open at a time."""
        names = self._layer_names(layers)
        wanted = None if prompt_indices is None else set(prompt_indices)
        selected = [r for r in self.manifest.rows if wanted is None or r.prompt_index in wanted]
        for handle, shard_rows in self._by_shard(selected):
            slices = [handle.get_slice(name) for name in names]  # type: ignore[attr-defined]
            for row in shard_rows:
                stream = torch.stack([s[row.offset : row.offset + row.n_tokens] for s in slices])
                yield CaptureRow(row.prompt_index, row.token_ids, stream)

    def batches(self, layer: int, batch_tokens: int = 4096) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """``(features (n, hidden) float32, prompt_index (n,))`` batches of about ``batch_tokens``
        token rows of one layer, in the order written; a prompt's rows may span two batches."""
        if batch_tokens < 1:
            raise CaptureError(f"batch_tokens must be at least 1, got {batch_tokens}")
        (name,) = self._layer_names([layer])
        for handle, shard_rows in self._by_shard(self.manifest.rows):
            tensor = handle.get_slice(name)  # type: ignore[attr-defined]
            n_tokens = sum(r.n_tokens for r in shard_rows)
            owner = np.concatenate([np.full(r.n_tokens, r.prompt_index, dtype=np.int64) for r in shard_rows])
            for begin in range(0, n_tokens, batch_tokens):
                end = min(begin + batch_tokens, n_tokens)
                yield tensor[begin:end].float().numpy(), owner[begin:end]

    def features(self, layer: int, prompt_indices: Sequence[int]) -> list[np.ndarray]:
        """Per prompt, ``(n_tokens, hidden)`` float32 of one layer: the list the probe trainer's
        ``fit_pipeline`` takes (in memory: pick the prompts you train on)."""
        by_index = {row.prompt_index: row.activations[0].float().numpy() for row in self.rows([layer], prompt_indices)}
        missing = [i for i in prompt_indices if i not in by_index]
        if missing:
            raise CaptureError(f"prompts {missing[:10]} are not in the capture at {self.out_dir}")
        return [by_index[i] for i in prompt_indices]
