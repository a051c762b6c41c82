"""The capture manifest: what was captured and where each row lies. Written atomically (temp file,
fsync, rename) after each shard, so a killed run leaves the last complete state on disk."""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Self

from pydantic import BaseModel, Field, ValidationError, model_validator

MANIFEST_NAME = "manifest.json"
FORMAT_VERSION = 1
SHARD_PATTERN = "shard-{:05d}.safetensors"


def shard_name(number: int) -> str:
    return SHARD_PATTERN.format(number)


class CaptureError(RuntimeError):
    """A capture or a load that cannot go on; the message says why and what was kept."""


class RowRecord(BaseModel):
    """One prompt's capture: tokens ``offset .. offset + len(token_ids)`` of each layer tensor of ``shard``."""

    prompt_index: int
    shard: str
    offset: int
    token_ids: list[int]

    @property
    def n_tokens(self) -> int:
        return len(self.token_ids)


class ShardRecord(BaseModel):
    name: str
    n_bytes: int
    sha256: str
    n_rows: int
    n_tokens: int


class CaptureManifest(BaseModel):
    format_version: int = FORMAT_VERSION
    model: str
    layers: list[int]
    dtype: str | None = None  # set by the first shard (the engine's capture dtype)
    hidden_size: int | None = None
    source: str
    source_sha256: str
    n_prompts: int
    complete: bool = False
    shards: list[ShardRecord] = Field(default_factory=list)
    rows: list[RowRecord] = Field(default_factory=list)

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        """A manifest read back (perhaps edited by hand) must describe what the writer writes:
        shards named in sequence (no path leaves the capture directory), each shard's rows one
        after another from offset 0 in shard order, every prompt once, ascending."""
        if self.format_version != FORMAT_VERSION:
            raise ValueError(f"format_version {self.format_version}: this lens-evals reads version {FORMAT_VERSION}")
        if self.shards and (self.dtype is None or self.hidden_size is None):
            raise ValueError("shards are recorded but dtype or hidden_size is not")
        rows = iter(self.rows)
        for number, shard in enumerate(self.shards):
            if shard.name != shard_name(number):
                raise ValueError(f"shard {number} is named {shard.name!r}, expected {shard_name(number)!r}")
            offset = 0
            for _ in range(shard.n_rows):
                row = next(rows, None)
                if row is None or row.shard != shard.name or row.offset != offset:
                    raise ValueError(f"{shard.name} records {shard.n_rows} rows; its rows do not follow one another from offset 0")
                offset += row.n_tokens
            if offset != shard.n_tokens:
                raise ValueError(f"{shard.name} records {shard.n_tokens} tokens, its rows hold {offset}")
        if next(rows, None) is not None:
            raise ValueError(f"{len(self.rows)} rows but the shards record {sum(s.n_rows for s in self.shards)}")
        indices = [row.prompt_index for row in self.rows]
        if any(not 0 <= i < self.n_prompts for i in indices) or indices != sorted(set(indices)):
            raise ValueError(f"prompt indices must be ascending, each once, in 0..{self.n_prompts - 1}")
        return self

    def done_prompts(self) -> set[int]:
        return {row.prompt_index for row in self.rows}

    def tensor_name(self, layer: int) -> str:
        return f"layer.{layer}"


def manifest_path(out_dir: Path) -> Path:
    return Path(out_dir) / MANIFEST_NAME


def read_manifest(out_dir: Path) -> CaptureManifest | None:
    path = manifest_path(out_dir)
    if not path.exists():
        return None
    try:
        return CaptureManifest.model_validate_json(path.read_bytes())
    except ValidationError as exc:  # each problem's place and message (not pydantic's echo of the whole input)
        problems = "; ".join(".".join(map(str, e["loc"])) + ": " + e["msg"] if e["loc"] else e["msg"] for e in exc.errors())
        raise CaptureError(f"{path} is not a valid capture manifest: {problems}") from None


def is_disk_full(exc: BaseException) -> bool:
    """ENOSPC from Python I/O, or from safetensors' writer (which reports it as text)."""
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    return "No space left on device" in str(exc) or "os error 28" in str(exc)


def write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that a reader sees the old file or the new one, never a part."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_manifest(out_dir: Path, manifest: CaptureManifest) -> None:
    write_atomic(manifest_path(out_dir), manifest.model_dump_json().encode())
