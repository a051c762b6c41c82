"""Run a capture: prompts in batches through the offline engine, rows into shards, the manifest
rewritten atomically after each shard. Restarting with the same arguments skips every prompt the
manifest already holds; files a killed run left behind (temporary files, a shard written but not
yet recorded) are removed first, so no row is ever written twice. A capture starts only in an
empty directory and writes its manifest there before any shard: a directory holding files but no
manifest is refused untouched (they are not ours to remove)."""

from __future__ import annotations

import fcntl
import logging
import os
import re
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import torch
from tqdm.auto import tqdm

from lens_evals.capture.inputs import PromptItem, read_prompts, source_sha256
from lens_evals.capture.manifest import (
    MANIFEST_NAME,
    CaptureError,
    CaptureManifest,
    RowRecord,
    ShardRecord,
    is_disk_full,
    manifest_path,
    read_manifest,
    shard_name,
    write_manifest,
)
from lens_evals.capture.shard_file import ShardImage
from lens_evals.capture.shards import ShardBuffer, check_shard_file, single_row_image
from lens_evals.capture.writer import PendingRow, ShardWriteError, ShardWriter
from lens_evals.models.lookup import model_config

logger = logging.getLogger(__name__)

STALE_FILE = re.compile(r"(shard-\d{5,}\.safetensors(\.tmp)?|manifest\.json\.tmp)")


class CaptureStopped(CaptureError):
    """The run stopped on purpose after ``max_shards`` shards (everything written is recorded)."""


@dataclass
class CaptureSettings:
    batch_size: int = 16  # prompts per engine call: one batch's captures are in memory at a time
    shard_rows: int = 256  # prompts per shard at most
    shard_bytes: int = 256 << 20  # capture bytes per shard at most (the shard buffer's size)
    max_shards: int | None = None  # stop (CaptureStopped) after writing this many shards in this run
    writers: int = 2  # writer threads: shards written (and hashed) while the engine runs the next batch
    direct_io: bool = True  # O_DIRECT where the filesystem takes it (the page cache where not)
    # shard buffers: one per writer and one being filled, and as many again (None): a batch's rows
    # (a few shards at every layer) go into free buffers and the engine runs on while they are written
    buffers: int | None = None

    def __post_init__(self) -> None:
        counts = {"batch_size": self.batch_size, "shard_rows": self.shard_rows, "shard_bytes": self.shard_bytes, "writers": self.writers}
        for name in ("max_shards", "buffers"):
            if (value := getattr(self, name)) is not None:
                counts[name] = value
        bad = [f"{name} {value}" for name, value in counts.items() if value < 1]
        if bad:
            raise CaptureError(f"capture settings must be at least 1: {', '.join(bad)}")


def _start_manifest(prompts_path: Path, model: str, layers: list[int], out_dir: Path, n_prompts: int) -> CaptureManifest:
    sha256 = source_sha256(prompts_path)
    manifest = read_manifest(out_dir)
    if manifest is None:
        manifest = CaptureManifest(model=model, layers=layers, source=str(prompts_path), source_sha256=sha256, n_prompts=n_prompts)
        _start_in_empty(out_dir, manifest)
        return manifest
    mine = {"model": model, "layers": layers, "source_sha256": sha256}
    theirs = {"model": manifest.model, "layers": manifest.layers, "source_sha256": manifest.source_sha256}
    if mine != theirs:
        differ = ", ".join(f"{k} {theirs[k]!r} (now {mine[k]!r})" for k in mine if mine[k] != theirs[k])
        raise CaptureError(
            f"{out_dir} holds a capture with other settings: {differ}; resume with the same "
            "model, layers and prompt set, or choose another --out"
        )
    return manifest


def _start_in_empty(out_dir: Path, manifest: CaptureManifest) -> None:
    """Refuse a directory without a manifest that holds anything (another tool's files, a
    manifest deleted by hand: nothing proves this tool wrote them); in an empty one, write the
    manifest at once, so that a run killed before its first shard is recorded resumes."""
    found = sorted(path.name for path in out_dir.iterdir())
    if found:
        shown = ", ".join(found[:3]) + (f" and {len(found) - 3} more" if len(found) > 3 else "")
        raise CaptureError(
            f"{out_dir} holds files ({shown}) but no {MANIFEST_NAME}: a capture starts only in an empty "
            "directory and resumes only one it started; nothing there was changed. Choose another --out"
        )
    try:
        write_manifest(out_dir, manifest)
    except OSError as exc:
        if not is_disk_full(exc):
            raise
        raise CaptureError(f"disk full in {out_dir} before the first shard; free space and rerun the same command") from None


def _remove_stale(out_dir: Path, manifest: CaptureManifest) -> None:
    """Remove what a killed run left; then every recorded shard must be whole (its size: cheap)."""
    recorded = {shard.name for shard in manifest.shards}
    for path in out_dir.iterdir():
        if STALE_FILE.fullmatch(path.name) and path.name not in recorded:
            logger.warning("removing %s left by an interrupted run", path)
            path.unlink()
    for shard in manifest.shards:
        try:
            check_shard_file(out_dir / shard.name, shard, verify=False)
        except CaptureError as exc:
            raise CaptureError(f"{exc}; {out_dir} cannot be resumed, choose another --out") from None


@contextmanager
def _locked(out_dir: Path) -> Iterator[None]:
    """One run per capture directory: a second run at once would delete the first's unrecorded
    shards as leftovers and write the same shard names."""
    fd = os.open(out_dir, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise CaptureError(f"another capture is writing to {out_dir}; wait for it or stop it first") from None
        yield
    finally:
        os.close(fd)


def _layer_count(llm: Any) -> int | None:
    config = llm.llm_engine.model_config.hf_text_config
    return getattr(config, "num_hidden_layers", None)


def _configured_layer_count(model: str) -> int | None:
    """The model's layer count from its ``config.json`` (``models.lookup.model_config``: a multimodal
    model's text config), before any engine starts; None where it cannot be read (the engine's
    count decides then)."""
    try:
        config = model_config(model) or {}
    except (OSError, ValueError) as exc:
        logger.debug("layer count of %s not read before the engine (%s)", model, exc)
        return None
    count = config.get("num_hidden_layers")
    return count if isinstance(count, int) else None


def _check_layers(layers: Sequence[int], n_layers: int | None) -> None:
    bad_layers = [layer for layer in layers if n_layers is not None and not 0 <= layer < n_layers]
    if bad_layers and n_layers is not None:
        raise CaptureError(f"layers {bad_layers} are outside the model's {n_layers} layers (0..{n_layers - 1})")


def _tokenize(llm: Any, items: Sequence[PromptItem], layers: list[int]) -> list[list[int]]:
    _check_layers(layers, _layer_count(llm))
    # token-id prompts need no tokenizer (an engine may run without one: skip_tokenizer_init)
    tokenizer = llm.get_tokenizer() if any(item.token_ids is None for item in items) else None
    limit = llm.llm_engine.model_config.max_model_len - 1  # one token is generated (max_tokens=1)
    vocab = llm.llm_engine.model_config.get_vocab_size()  # vLLM checks ids only with a tokenizer
    token_ids = []
    for item in items:
        ids = item.tokenize(tokenizer)
        if not 0 < len(ids) <= limit:
            raise CaptureError(
                f"prompt {item.index} has {len(ids)} tokens; this engine takes 1..{limit} (raise --max-model-len or shorten it)"
            )
        if max(ids) >= vocab:
            raise CaptureError(f"prompt {item.index} has token id {max(ids)}, outside the model's vocabulary (0..{vocab - 1})")
        token_ids.append(ids)
    return token_ids


class _ShardSink:
    """Fills shards and hands them to the writer threads, which record them in order; turns a full
    disk into a clear error that says what was kept. A context manager: leaving it waits for every
    shard handed over (on an error too: what was written whole is kept)."""

    def __init__(self, out_dir: Path, manifest: CaptureManifest, settings: CaptureSettings, progress: tqdm) -> None:
        self.out_dir, self.manifest, self.settings, self.progress = out_dir, manifest, settings, progress
        images = settings.buffers or 2 * (settings.writers + 1)
        self.buffer = ShardBuffer(manifest.layers, settings.shard_rows, settings.shard_bytes, images)
        self.writer = ShardWriter(out_dir, len(manifest.shards), self._record, settings.writers, settings.direct_io)
        self.submitted_this_run = 0
        self.closed = False

    def __enter__(self) -> _ShardSink:
        return self

    def __exit__(self, kind: type[BaseException] | None, *rest: object) -> None:
        if kind is None:
            self.flush()
            self.close()
            return
        if self.closed:  # the error is the writer's own, raised by close
            return
        try:
            self.writer.close()
        except ShardWriteError as exc:  # the caller's own error goes on; this one is logged
            logger.error("while stopping on an error, shard %s also failed: %s", exc.name, exc.cause)

    def add(self, prompt_index: int, token_ids: list[int], stream: torch.Tensor) -> None:
        dtype, hidden = str(stream.dtype).removeprefix("torch."), int(stream.shape[-1])
        if self.manifest.dtype is None:
            self.manifest.dtype, self.manifest.hidden_size = dtype, hidden
        elif (dtype, hidden) != (self.manifest.dtype, self.manifest.hidden_size):
            raise CaptureError(
                f"{self.out_dir} holds {self.manifest.dtype} captures of width {self.manifest.hidden_size}; this engine "
                f"captures {dtype} of width {hidden}: resume with the same --dtype and model, or choose another --out"
            )
        if not self.buffer.fits(stream) and self.buffer.rows:
            self.flush()
        if not self.buffer.fits(stream):  # larger than a whole shard buffer: a shard of its own
            self._submit(single_row_image(self.manifest.layers, stream), [PendingRow(prompt_index, token_ids, 0)], None)
            return
        self.buffer.add(prompt_index, token_ids, stream)
        if self.buffer.full:
            self.flush()

    def flush(self) -> None:
        if self.buffer.rows:
            self._submit(*self.buffer.take())

    def close(self) -> None:
        self.closed = True
        try:
            self.writer.close()
        except ShardWriteError as exc:
            self._raise(exc)

    def _submit(self, image: ShardImage, rows: list[PendingRow], release: Callable[[ShardImage], None] | None) -> None:
        if self.writer.failure is not None:  # a shard before this one failed: stop, saying what was kept
            self.close()
        self.writer.submit(shard_name, image, rows, release)
        self.submitted_this_run += 1
        if self.settings.max_shards is not None and self.submitted_this_run >= self.settings.max_shards:
            self.close()
            raise CaptureStopped(
                f"stopped after {self.submitted_this_run} shards as asked; "
                f"{len(self.manifest.rows)} of {self.manifest.n_prompts} prompts are in {self.out_dir}"
            )

    def _record(self, shard: ShardRecord, rows: list[RowRecord]) -> None:
        """On a writer thread, in shard order: the manifest rewritten with this shard."""
        self.manifest.shards.append(shard)
        self.manifest.rows.extend(rows)
        try:
            write_manifest(self.out_dir, self.manifest)
        except BaseException:
            del self.manifest.shards[-1], self.manifest.rows[-len(rows) :]
            raise
        self.progress.set_postfix(shards=len(self.manifest.shards), refresh=False)
        self.progress.update(shard.n_rows)

    def _raise(self, exc: ShardWriteError) -> NoReturn:
        """The writer's failure as the caller sees it: a full disk as a :class:`CaptureError` that
        says what was kept, anything else as it was raised."""
        if not is_disk_full(exc.cause):  # OSError, or safetensors' error that carries ENOSPC as text
            raise exc.cause
        kept = read_manifest(self.out_dir)
        n_shards, n_rows = (len(kept.shards), len(kept.rows)) if kept else (0, 0)
        raise CaptureError(
            f"disk full in {self.out_dir} while writing {exc.name}: kept {n_shards} complete shards "
            f"({n_rows} of {self.manifest.n_prompts} prompts) recorded in {manifest_path(self.out_dir)}; "
            "free space and rerun the same command to resume"
        ) from None


def run_capture(
    prompts_path: str | Path,
    model: str,
    layers: Sequence[int],
    out_dir: str | Path,
    *,
    llm: Any = None,
    settings: CaptureSettings | None = None,
    max_model_len: int = 1024,
    engine_args: dict[str, Any] | None = None,
    show_progress: bool = True,
) -> CaptureManifest:
    """Capture ``layers`` of every prompt of ``prompts_path`` into ``out_dir``; resumes a partial
    capture there. ``llm``: an offline engine to use (otherwise one is opened on ``model``)."""
    settings = settings or CaptureSettings()
    prompts_path, out_dir, layer_list = Path(prompts_path), Path(out_dir), sorted(set(layers))
    if not layer_list:
        raise CaptureError("name at least one layer to capture")
    if llm is None:  # before the engine's start (minutes for a large model) and before --out is made
        _check_layers(layer_list, _configured_layer_count(model))
    items = read_prompts(prompts_path)
    out_dir.mkdir(parents=True, exist_ok=True)
    with _locked(out_dir):
        manifest = _start_manifest(prompts_path, model, layer_list, out_dir, len(items))
        _remove_stale(out_dir, manifest)
        if manifest.complete:
            logger.warning("%s already holds the complete capture", out_dir)
            return manifest
        done = manifest.done_prompts()
        todo = [item for item in items if item.index not in done]
        engine_spec = (model, llm, {"max_model_len": max_model_len, **(engine_args or {})})
        if todo:  # none left: a run killed (or out of disk) while marking the capture complete
            _capture(todo, manifest, out_dir, settings, engine_spec, show_progress)
        _mark_complete(out_dir, manifest)
    return manifest


def _capture(
    todo: list[PromptItem],
    manifest: CaptureManifest,
    out_dir: Path,
    settings: CaptureSettings,
    engine_spec: tuple[str, Any, dict[str, Any]],
    show_progress: bool,
) -> None:
    from vllm import SamplingParams

    from lens_evals.engine.frontend.offline import engine_for
    from lens_evals.request.spec import CAPTURE_KEY

    # an engine opened here is shut down when the capture ends (the caller's ``llm`` stays open)
    with engine_for(*engine_spec) as engine:
        token_ids = _tokenize(engine, todo, manifest.layers)
        params = SamplingParams(max_tokens=1, temperature=0.0, extra_args={CAPTURE_KEY: manifest.layers})
        bar = {"desc": f"capture -> {out_dir}", "unit": "prompt", "disable": not show_progress}
        with tqdm(total=manifest.n_prompts, initial=len(manifest.rows), **bar) as progress:
            with _ShardSink(out_dir, manifest, settings, progress) as sink:
                for begin in range(0, len(todo), settings.batch_size):
                    batch = todo[begin : begin + settings.batch_size]
                    batch_ids = token_ids[begin : begin + settings.batch_size]
                    outputs = engine.generate([{"prompt_token_ids": ids} for ids in batch_ids], params, use_tqdm=False)
                    for item, ids, output in zip(batch, batch_ids, outputs):
                        stream = output.activations["residual_stream"]
                        if stream.shape[1] != len(ids):
                            raise CaptureError(f"prompt {item.index}: captured {stream.shape[1]} rows for {len(ids)} tokens")
                        sink.add(item.index, ids, stream)
                    del outputs


def _mark_complete(out_dir: Path, manifest: CaptureManifest) -> None:
    manifest.complete = True
    try:
        write_manifest(out_dir, manifest)
    except OSError as exc:
        if not is_disk_full(exc):
            raise
        raise CaptureError(
            f"disk full in {out_dir} while marking the capture complete: all {len(manifest.shards)} "
            "shards are recorded; free space and rerun the same command to finish"
        ) from None
