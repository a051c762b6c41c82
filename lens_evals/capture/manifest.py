"""The capture manifest: what was captured and where each row lies. Written atomically (temp file,
fsync, rename) after each shard, so a killed run leaves the last complete state on disk."""

from __future__ import annotations

import errno
import os
from pathlib import Path

from pydantic import BaseModel, Field

MANIFEST_NAME = "manifest.json"
FORMAT_VERSION = 1


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
    except ValueError as exc:
        raise CaptureError(f"{path} is not a valid capture manifest: {exc}") from None


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
