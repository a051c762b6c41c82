"""`lens-evals capture` under faults found by a bug hunt: a manifest edited by hand, a resume with a
damaged directory or another engine dtype, a second run on the same directory, out-of-vocabulary
token ids, a kill while marking the capture complete, a full disk while recording a shard, and
input files the readers must refuse clearly. One tiny-Llama engine for the module."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from conftest import TINY_PROMPTS
from test_capture_cmd import write_jsonl

from lens_evals.capture import CaptureError, CaptureReader, CaptureStopped, run_capture
from lens_evals.capture import runner as capture_runner
from lens_evals.capture.inputs import read_prompts, source_sha256
from lens_evals.capture.manifest import CaptureManifest, read_manifest, write_manifest
from lens_evals.capture.runner import CaptureSettings
from lens_evals.cli.app import main as cli_main

LAYERS = [1, 2]
ONE_PER_SHARD = CaptureSettings(batch_size=2, shard_rows=1)


def capture(llm: Any, root: Path, settings: CaptureSettings = ONE_PER_SHARD) -> tuple[Path, Path]:
    """The first 4 tiny prompts into ``root/out`` (one shard each unless ``settings`` say otherwise)."""
    root.mkdir(parents=True, exist_ok=True)
    prompts = write_jsonl(root / "p.jsonl", [{"prompt": p} for p in TINY_PROMPTS[:4]])
    try:
        run_capture(prompts, "tiny-llama", LAYERS, root / "out", llm=llm, settings=settings, show_progress=False)
    except CaptureStopped:
        pass
    return prompts, root / "out"


@pytest.fixture(scope="module")
def complete(llm: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return capture(llm, tmp_path_factory.mktemp("complete"))[1]


def snapshot(out: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(out.iterdir())}


def edit(manifest: dict[str, Any], change: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    change(manifest)
    return manifest


def drop_middle_shard(m: dict[str, Any]) -> None:
    m["complete"] = False
    del m["shards"][1], m["rows"][1]


EDITS: list[tuple[str, Callable[[dict[str, Any]], None], str]] = [
    ("row in an unknown shard", lambda m: m["rows"][1].update(shard="shard-00009.safetensors"), r"rows do not follow"),
    ("offset past the shard", lambda m: m["rows"][1].update(offset=100), r"rows do not follow"),
    ("more tokens than the shard", lambda m: m["rows"][1]["token_ids"].extend([5, 6]), r"shard-00001.* records \d+ tokens"),
    ("a path out of the directory", lambda m: m["shards"][0].update(name="../secret.safetensors"), r"named '\.\./secret"),
    ("a recorded shard dropped", drop_middle_shard, r"shard 1 is named 'shard-00002"),
    ("a prompt twice", lambda m: m["rows"][2].update(prompt_index=1), r"ascending, each once"),
    ("another format", lambda m: m.update(format_version=7), r"format_version 7"),
]


@pytest.mark.parametrize("label, change, message", EDITS, ids=[e[0] for e in EDITS])
def test_inconsistent_manifest_is_refused(
    llm: Any, complete: Path, tmp_path: Path, label: str, change: Callable[[dict[str, Any]], None], message: str
) -> None:
    """Before: the loader read such manifests as wrong rows (0 or 2 tokens for a prompt of 6, a file
    outside the directory) or failed with 'generator raised StopIteration'; a resume after a dropped
    shard wrote a new shard-00002 over the recorded one."""
    out = shutil.copytree(complete, tmp_path / "out")
    manifest = out / "manifest.json"
    manifest.write_text(json.dumps(edit(json.loads(manifest.read_text()), change)))
    before = snapshot(out)
    with pytest.raises(CaptureError, match=rf"manifest\.json is not a valid capture manifest: .*{message}"):
        CaptureReader(out)
    with pytest.raises(CaptureError, match=r"not a valid capture manifest"):
        run_capture(complete.parent / "p.jsonl", "tiny-llama", LAYERS, out, llm=llm, settings=ONE_PER_SHARD)
    assert snapshot(out) == before  # nothing written over or removed


@pytest.mark.parametrize("damage", ["missing", "truncated"])
def test_resume_refuses_a_damaged_recorded_shard(llm: Any, tmp_path: Path, damage: str) -> None:
    """Before: the resume wrote the remaining prompts and marked the capture complete around a
    recorded shard that was gone (the loader failed only later)."""
    prompts, out = capture(llm, tmp_path, CaptureSettings(batch_size=2, shard_rows=1, max_shards=2))
    shard = out / "shard-00001.safetensors"
    if damage == "missing":
        shard.unlink()
    else:
        shard.write_bytes(shard.read_bytes()[:-8])
    before = snapshot(out)
    expected = "is missing" if damage == "missing" else r"is corrupted: \d+ bytes, the manifest records"
    with pytest.raises(CaptureError, match=rf"shard-00001\.safetensors {expected}.*cannot be resumed"):
        run_capture(prompts, "tiny-llama", LAYERS, out, llm=llm, settings=ONE_PER_SHARD, show_progress=False)
    assert snapshot(out) == before


def test_resume_with_another_dtype_is_refused(llm: Any, tmp_path: Path) -> None:
    """A capture started in bfloat16 (``--dtype bfloat16``) resumed by this float32 engine. Before:
    float32 shards were added to a manifest that says bfloat16."""
    prompts, out = capture(llm, tmp_path, CaptureSettings(batch_size=2, shard_rows=1, max_shards=1))
    manifest = out / "manifest.json"
    manifest.write_text(json.dumps({**json.loads(manifest.read_text()), "dtype": "bfloat16"}))
    before = snapshot(out)
    with pytest.raises(CaptureError, match=r"holds bfloat16 captures of width 128; this engine captures float32 of width 128"):
        run_capture(prompts, "tiny-llama", LAYERS, out, llm=llm, settings=ONE_PER_SHARD, show_progress=False)
    assert snapshot(out) == before


def test_second_run_on_the_same_directory_is_refused(llm: Any, tmp_path: Path) -> None:
    """Another capture holds the directory (its lock). Before: this run went ahead, deleting the
    other's shard written but not yet recorded and writing the same shard names."""
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "the cat"}])
    out = tmp_path / "out"
    out.mkdir()
    other = CaptureManifest(model="tiny-llama", layers=LAYERS, source=str(prompts), source_sha256=source_sha256(prompts), n_prompts=1)
    write_manifest(out, other)  # as the other run wrote it at its start
    (out / "shard-00000.safetensors").write_bytes(b"the other run's shard, about to be recorded")
    before = snapshot(out)
    fd = os.open(out, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        with pytest.raises(CaptureError, match=rf"another capture is writing to {out}"):
            run_capture(prompts, "tiny-llama", LAYERS, out, llm=llm, show_progress=False)
        assert snapshot(out) == before
    finally:
        os.close(fd)
    run_capture(prompts, "tiny-llama", LAYERS, out, llm=llm, show_progress=False)  # the lock is gone with its holder
    assert [row.prompt_index for row in CaptureReader(out).rows()] == [0]


def test_out_of_vocabulary_token_id_is_named_before_the_engine_runs(llm: Any, tmp_path: Path) -> None:
    """Before: vLLM's VLLMValidationError (no CaptureError, exit 1) after a shard was written; an
    engine without a tokenizer (``skip_tokenizer_init``) does not check ids at all."""
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "the cat"}] * 3 + [{"prompt_token_ids": [5, 512]}])
    with pytest.raises(CaptureError, match=r"prompt 3 has token id 512, outside the model's vocabulary \(0\.\.511\)"):
        run_capture(prompts, "tiny-llama", LAYERS, tmp_path / "out", llm=llm, settings=ONE_PER_SHARD, show_progress=False)
    assert not list((tmp_path / "out").glob("shard-*"))


class NoEngine:
    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"the engine was used ({name})")


def test_a_directory_of_files_without_a_manifest_is_refused_untouched(tmp_path: Path) -> None:
    """Before: a run into a directory holding files but no manifest.json (another tool's shards,
    a manifest deleted by hand) deleted every file named like a shard or a temporary file there
    as leftovers of a killed run, then started capturing."""
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "the cat"}])
    out = tmp_path / "out"
    out.mkdir()
    files = {
        "shard-00000.safetensors": b"not ours",
        "shard-00001.safetensors.tmp": b"nor this",
        "manifest.json.tmp": b"{",
        "notes.txt": b"x",
    }
    for name, data in files.items():
        (out / name).write_bytes(data)
    message = (
        rf"{re.escape(str(out))} holds files \(manifest\.json\.tmp, notes\.txt, shard-00000\.safetensors and 1 more\) but no manifest\.json"
    )
    with pytest.raises(CaptureError, match=message):
        run_capture(prompts, "tiny-llama", LAYERS, out, llm=NoEngine(), show_progress=False)
    assert snapshot(out) == files


def test_a_run_killed_before_its_first_shard_was_recorded_resumes(tmp_path: Path) -> None:
    """The manifest is written before any shard, so the refusal above never blocks our own resume:
    the unrecorded shard of a run killed at its first shard is removed as before."""
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "the cat"}])
    out = tmp_path / "out"
    with pytest.raises(AssertionError, match="the engine was used"):  # the run "killed" at its engine
        run_capture(prompts, "tiny-llama", LAYERS, out, llm=NoEngine(), show_progress=False)
    assert read_manifest(out) is not None and not read_manifest(out).shards
    (out / "shard-00000.safetensors").write_bytes(b"written, not recorded")
    with pytest.raises(AssertionError, match="the engine was used"):
        run_capture(prompts, "tiny-llama", LAYERS, out, llm=NoEngine(), show_progress=False)
    assert sorted(snapshot(out)) == ["manifest.json"]


def test_killed_while_marking_complete_finishes_without_an_engine(complete: Path, tmp_path: Path) -> None:
    """Every prompt recorded, ``complete`` not yet true (killed, or out of disk, at the last step).
    Before: the rerun opened an engine (minutes for a large model) to capture nothing."""
    out = shutil.copytree(complete, tmp_path / "out")
    manifest = out / "manifest.json"
    manifest.write_text(json.dumps({**json.loads(manifest.read_text()), "complete": False}))
    done = run_capture(complete.parent / "p.jsonl", "tiny-llama", LAYERS, out, llm=NoEngine(), show_progress=False)
    assert done.complete and CaptureReader(out).manifest.complete
    assert [row.prompt_index for row in done.rows] == [0, 1, 2, 3]


def test_disk_full_while_recording_a_shard_keeps_the_manifest(llm: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """ENOSPC from the manifest write after shard-00001 is in place: that shard goes, the manifest
    on disk still records shard-00000, and a rerun completes the capture with every prompt once."""
    real_write, calls = capture_runner.write_manifest, []

    def failing_write(out_dir: Path, manifest: Any) -> None:
        calls.append(len(manifest.shards))
        if len(manifest.shards) == 2:  # after the first write (no shard) and shard-00000's
            raise OSError(errno.ENOSPC, "No space left on device")
        real_write(out_dir, manifest)

    monkeypatch.setattr(capture_runner, "write_manifest", failing_write)
    with pytest.raises(CaptureError, match=r"while writing shard-00001\.safetensors: kept 1 complete shards \(1 of 4 prompts\)"):
        capture(llm, tmp_path)
    assert calls == [0, 1, 2]  # the manifest is written once before the first shard
    out = tmp_path / "out"
    assert sorted(snapshot(out)) == ["manifest.json", "shard-00000.safetensors"]
    monkeypatch.undo()
    capture(llm, tmp_path)
    reader = CaptureReader(out)
    reader.verify_all()
    assert reader.manifest.complete and [row.prompt_index for row in reader.manifest.rows] == [0, 1, 2, 3]


def test_loader_arguments_are_checked(complete: Path) -> None:
    reader = CaptureReader(complete)
    with pytest.raises(CaptureError, match="name at least one layer"):
        next(reader.rows(layers=[]))
    with pytest.raises(CaptureError, match="batch_tokens must be at least 1"):
        next(reader.batches(1, batch_tokens=0))


def test_input_encoding_and_token_ids(tmp_path: Path) -> None:
    """A byte-order mark is read past; bytes that are not UTF-8 and JSON booleans as token ids are
    clear errors (before: a UnicodeDecodeError traceback; ``true`` read as token id 1)."""
    path = tmp_path / "p.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"prompt": "the cat"}\n')
    assert [item.prompt for item in read_prompts(path)] == ["the cat"]
    path.write_bytes(b'{"prompt": "the cat"}\n{"prompt": "caf\xe9"}\n')
    with pytest.raises(CaptureError, match=r"p\.jsonl:2: not UTF-8 text \(invalid continuation byte at byte 16\)"):
        read_prompts(path)
    path.write_text('{"prompt_token_ids": [true, 5]}\n')
    with pytest.raises(CaptureError, match=r"p\.jsonl:1: 'prompt_token_ids' must be a non-empty list of non-negative integers"):
        read_prompts(path)


@pytest.mark.parametrize(
    "options, message",
    [
        (["--layers", ""], "name at least one layer"),
        (["--layers", "1", "--batch-size", "0"], "must be at least 1: batch_size 0"),
        (["--layers", "1", "--writers", "0"], "must be at least 1: writers 0"),
    ],
)
def test_bad_command_options_are_clear_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str], options: list[str], message: str) -> None:
    """Exit 2 with a message, no engine (before: a traceback from vLLM, or from ``range``)."""
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "the cat"}])
    assert cli_main(["capture", str(prompts), "--model", "tiny-llama", "--out", str(tmp_path / "o"), *options]) == 2
    assert message in capsys.readouterr().err
