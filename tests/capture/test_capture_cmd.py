"""`lens-evals capture`: resume without duplicated rows, the loader against an in-memory capture
of the same prompts (LLM.generate / LLM.chat with the same extra_args), bounded host memory on a
capture several times the bound, and clear errors for a corrupted shard, a full disk and bad input.
One tiny-Llama engine for the module."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Self

import numpy as np
import psutil
import pytest
import torch
from conftest import TINY_PROMPTS, capture, gpu_share, greedy, on_gpu
from tolerance import assert_stream_close

from lens_evals.capture import CaptureError, CaptureReader, CaptureStopped, run_capture
from lens_evals.capture.runner import CaptureSettings
from lens_evals.cli.app import main as cli_main

LAYERS = [0, 1, 2, 3]  # every layer of the tiny Llama
CHATS = [
    [{"role": "user", "content": "the cat reads a book."}, {"role": "assistant", "content": "a model finds the truth."}],
    [{"role": "user", "content": "my friend"}],
]


def write_jsonl(path: Path, records: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return path


def mixed_prompts(path: Path) -> Path:
    """12 prompts: the tiny prompts as text, two chats, and two as token ids."""
    records: list[dict[str, Any]] = [{"prompt": p} for p in TINY_PROMPTS]
    records += [{"messages": chat} for chat in CHATS]
    records += [{"prompt_token_ids": [5, 6, 7, 8, 9]}, {"prompt_token_ids": list(range(20, 60))}]
    return write_jsonl(path, records)


def reference_streams(llm: Any, records: list[dict[str, Any]]) -> list[tuple[list[int], torch.Tensor]]:
    """Each prompt captured alone by the engine's own entry points (its own tokenisation)."""
    params = greedy(1, output_residual_stream=LAYERS)
    result = []
    for record in records:
        if "messages" in record:
            (out,) = llm.chat(record["messages"], params, add_generation_prompt=False, use_tqdm=False)
        elif "prompt" in record:
            (out,) = llm.generate(record["prompt"], params, use_tqdm=False)
        else:
            (out,) = llm.generate({"prompt_token_ids": record["prompt_token_ids"]}, params, use_tqdm=False)
        result.append((list(out.prompt_token_ids), capture(out)))
    return result


@pytest.fixture(scope="module")
def resumed_capture(llm: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A capture stopped after 2 of 4 shards, with the leftovers of a kill mid-write planted, then resumed."""
    root = tmp_path_factory.mktemp("capture")
    prompts, out = mixed_prompts(root / "prompts.jsonl"), root / "out"
    settings = CaptureSettings(batch_size=4, shard_rows=3, max_shards=2)
    with pytest.raises(CaptureStopped, match="stopped after 2 shards"):
        run_capture(prompts, "tiny-llama", LAYERS, out, llm=llm, settings=settings, show_progress=False)
    first = CaptureReader(out).manifest
    assert (len(first.shards), len(first.rows), first.complete) == (2, 6, False)
    (out / "shard-00002.safetensors").write_bytes(b"half a shard written when the run was killed")
    (out / "manifest.json.tmp").write_bytes(b"{")
    run_capture(prompts, "tiny-llama", LAYERS, out, llm=llm, settings=CaptureSettings(batch_size=4, shard_rows=3), show_progress=False)
    return out


def test_resume_writes_every_prompt_once(resumed_capture: Path) -> None:
    manifest = CaptureReader(resumed_capture).manifest
    assert manifest.complete and len(manifest.shards) == 4
    assert [row.prompt_index for row in manifest.rows] == list(range(12))  # each once, in order
    assert not list(resumed_capture.glob("*.tmp"))
    assert sorted(p.name for p in resumed_capture.glob("shard-*")) == [s.name for s in manifest.shards]
    # Complete: a rerun returns without opening an engine (llm=None would start one).
    again = run_capture(resumed_capture.parent / "prompts.jsonl", "tiny-llama", LAYERS, resumed_capture, show_progress=False)
    assert len(again.rows) == 12
    with pytest.raises(CaptureError, match=r"other settings: layers \[0, 1, 2, 3\] \(now \[1\]\)"):
        run_capture(resumed_capture.parent / "prompts.jsonl", "tiny-llama", [1], resumed_capture)


def test_loader_equals_in_memory_capture(llm: Any, resumed_capture: Path) -> None:
    records = [json.loads(line) for line in (resumed_capture.parent / "prompts.jsonl").read_text().splitlines()]
    reference = reference_streams(llm, records)
    reader = CaptureReader(resumed_capture)
    assert reader.manifest.dtype == "float32" and reader.manifest.hidden_size == 128
    rows = list(reader.rows())
    assert len(rows) == len(reference)
    for row, (token_ids, stream) in zip(rows, reference):
        assert row.token_ids == token_ids, f"prompt {row.prompt_index}: token ids differ from the engine's"
        assert_stream_close(row.activations, stream, f"prompt {row.prompt_index}")
    # One layer, streamed in batches that cut across prompts and shards: exactly the rows read above
    # (which equal the engine's within the backend's bound: on a GPU the capture's batches of 4 and
    # the prompts alone round differently).
    batches = list(reader.batches(2, batch_tokens=7))
    features = np.concatenate([f for f, _ in batches])
    owners = np.concatenate([o for _, o in batches])
    assert max(len(f) for f, _ in batches) <= 7
    np.testing.assert_array_equal(features, np.concatenate([row.activations[2].numpy() for row in rows]))
    np.testing.assert_array_equal(owners, np.concatenate([np.full(len(t), i) for i, (t, _) in enumerate(reference)]))
    picked = reader.features(3, [9, 2])
    np.testing.assert_array_equal(picked[0], rows[9].activations[3].numpy())
    np.testing.assert_array_equal(picked[1], rows[2].activations[3].numpy())


def test_corrupted_shard_is_named(resumed_capture: Path, tmp_path: Path) -> None:
    out = shutil.copytree(resumed_capture, tmp_path / "copy")
    shard = out / "shard-00001.safetensors"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    reader = CaptureReader(out)
    with pytest.raises(CaptureError, match=r"shard .*shard-00001\.safetensors is corrupted: its SHA-256"):
        list(reader.rows())
    assert len(list(CaptureReader(out).rows(prompt_indices=[0, 1, 2]))) == 3  # the other shards still read
    shard.write_bytes(bytes(data[:-10]))
    with pytest.raises(CaptureError, match=r"shard-00001\.safetensors is corrupted: \d+ bytes, the manifest records"):
        CaptureReader(out, verify=False).verify_all()


@pytest.mark.parametrize(
    "content, message",
    [
        ('{"prompt": "the cat"}\n{"prompt": "a model\n', r"prompts\.jsonl:2: not valid JSON"),
        (
            '{"prompt": "the cat"}\n{"text": "a model"}\n',
            r"prompts\.jsonl:2: needs exactly one of prompt, messages, prompt_token_ids \(found text\)",
        ),
        ('{"messages": [{"role": "user"}]}\n', r"prompts\.jsonl:1: each message needs a string 'role' and a string 'content'"),
        ('{"prompt_token_ids": [1, -2]}\n', r"prompts\.jsonl:1: 'prompt_token_ids' must be a non-empty list"),
        ("\n\n", r"prompts\.jsonl holds no prompts"),
    ],
)
def test_bad_input_file_is_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str], content: str, message: str) -> None:
    """Checked before any engine starts (no llm is passed: none is opened)."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(content)
    with pytest.raises(CaptureError, match=message):
        run_capture(prompts, "tiny-llama", [1], tmp_path / "out")
    assert cli_main(["capture", str(prompts), "--model", "tiny-llama", "--layers", "1", "--out", str(tmp_path / "o")]) == 2
    assert "lens-evals capture: " in capsys.readouterr().err


def test_prompt_too_long_names_it(llm: Any, tmp_path: Path) -> None:
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "the truth"}, {"prompt_token_ids": [5] * 1100}])
    with pytest.raises(CaptureError, match=r"prompt 1 has 1100 tokens; this engine takes 1\.\.1023"):
        run_capture(prompts, "tiny-llama", [1], tmp_path / "out", llm=llm)
    with pytest.raises(CaptureError, match=r"layers \[7\] are outside the model's 4 layers"):
        run_capture(prompts, "tiny-llama", [1, 7], tmp_path / "out2", llm=llm)


def random_token_prompts(path: Path, n_prompts: int, n_tokens: int, vocab: int, seed: int = 0) -> Path:
    rng = np.random.default_rng(seed)
    return write_jsonl(path, [{"prompt_token_ids": rng.integers(10, vocab, n_tokens).tolist()} for _ in range(n_prompts)])


def share_args() -> list[str]:
    """``--engine-arg`` options for :func:`gpu_share` (none on CPU): a command-line capture's engine
    is a fresh process, which the conftest's engine defaults do not reach."""
    return [arg for key, value in gpu_share().items() for arg in ("--engine-arg", f"{key}={value}")]


def test_token_id_prompts_need_no_tokenizer(llm: Any, tiny_path: Path, tmp_path: Path) -> None:
    """A model directory without tokenizer files, opened with ``--engine-arg
    skip_tokenizer_init=true`` (how the GPU host's 44 GB capture runs): token-id prompts are
    captured as the tokenizer-backed engine captures them."""

    model = tmp_path / "no-tokenizer"
    model.mkdir()
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        shutil.copy(tiny_path / name, model / name)
    prompts = random_token_prompts(tmp_path / "p.jsonl", 3, 20, len(llm.get_tokenizer()))
    out = tmp_path / "out"
    args = ["capture", str(prompts), "--model", str(model), "--layers", ",".join(map(str, LAYERS)), "--out", str(out)]
    # in a process of its own: a second in-process engine would tear down vLLM's parallel groups,
    # which this module's engine (``llm``) still uses
    command = [sys.executable, "-m", "lens_evals.cli", *args, "--dtype", "float32", "--engine-arg", "skip_tokenizer_init=true"]
    command += share_args()  # beside ``llm`` on a GPU
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    reference = reference_streams(llm, [json.loads(line) for line in prompts.read_text().splitlines()])
    rows = list(CaptureReader(out).rows())
    assert [row.token_ids for row in rows] == [token_ids for token_ids, _ in reference]
    for row, (_, stream) in zip(rows, reference, strict=True):
        assert_stream_close(row.activations, stream, f"prompt {row.prompt_index}")
    with pytest.raises(SystemExit, match="expected KEY=VALUE"):
        cli_main([*args, "--engine-arg", "skip_tokenizer_init"])


def test_disk_full_keeps_what_was_written(llm: Any, tmp_path: Path) -> None:
    """A real full disk: a 1 MiB tmpfs; each 1-prompt shard is ~400 KiB, so the third does not fit."""
    mount = tmp_path / "small_disk"
    mount.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], capture_output=True, text=True)
    if mounted.returncode != 0 and on_gpu():  # the lent GPU machine's sandbox may refuse mounts; CI's machine must not
        pytest.skip(f"cannot mount a 1 MiB tmpfs on this machine: {mounted.stderr.strip()[:200]}")
    assert mounted.returncode == 0, mounted.stderr
    try:
        prompts = random_token_prompts(tmp_path / "p.jsonl", 5, 200, len(llm.get_tokenizer()))
        out = mount / "out"
        with pytest.raises(
            CaptureError,
            match=rf"disk full in {out} while writing shard-00002\.safetensors: "
            r"kept 2 complete shards \(2 of 5 prompts\) recorded in .*manifest\.json; free space",
        ):
            # one writer: with two, two shards' temporary files compete for the last free space and
            # the run may keep one shard fewer (the message says how many; the writer's own tests
            # cover failures with several writers)
            settings = CaptureSettings(shard_rows=1, writers=1)
            run_capture(prompts, "tiny-llama", LAYERS, out, llm=llm, settings=settings, show_progress=False)
        reader = CaptureReader(out)
        reader.verify_all()
        assert [row.prompt_index for row in reader.rows()] == [0, 1]
        assert sorted(p.name for p in out.iterdir()) == ["manifest.json", "shard-00000.safetensors", "shard-00001.safetensors"]
    finally:
        subprocess.run(["umount", str(mount)], check=True)


class PeakRss:
    """Peak resident set size of this process, sampled every 2 ms in a thread."""

    def __init__(self) -> None:
        self.process, self.peak, self._stop = psutil.Process(), 0, threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.process.memory_info().rss)
            time.sleep(0.002)

    def __enter__(self) -> Self:
        self.start = self.process.memory_info().rss
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    @property
    def growth(self) -> int:
        return self.peak - self.start


MIB = 1 << 20
# 3 shard images of 4 MiB (one filling, one per writer thread) + one batch of 8 prompts (~3.8 MiB)
# + allocator slack
RSS_BOUND = 40 * MIB


def test_host_memory_stays_bounded(llm: Any, tmp_path: Path) -> None:
    """~164 MiB of captures (4.1x the bound) written while peak RSS grows by less than the bound."""
    n_tokens, vocab = 240, len(llm.get_tokenizer())
    settings = CaptureSettings(batch_size=8, shard_rows=64, shard_bytes=4 * MIB)
    warm = random_token_prompts(tmp_path / "warm.jsonl", 16, n_tokens, vocab, seed=1)
    run_capture(warm, "tiny-llama", LAYERS, tmp_path / "warm", llm=llm, settings=settings, show_progress=False)
    prompts = random_token_prompts(tmp_path / "p.jsonl", 350, n_tokens, vocab)
    with PeakRss() as rss:
        manifest = run_capture(prompts, "tiny-llama", LAYERS, tmp_path / "out", llm=llm, settings=settings, show_progress=False)
    written = sum(shard.n_bytes for shard in manifest.shards)
    print(f"capture of {written / MIB:.1f} MiB in {len(manifest.shards)} shards: peak RSS growth {rss.growth / MIB:.1f} MiB")
    assert written > 4 * RSS_BOUND
    assert rss.growth < RSS_BOUND, f"peak RSS grew {rss.growth / MIB:.1f} MiB while writing {written / MIB:.1f} MiB"
    assert len(manifest.rows) == 350


def test_datasets_file_gives_the_same_prompts(tmp_path: Path) -> None:
    """A parquet file written by the datasets library reads as the same prompts as its JSONL."""
    import datasets

    from lens_evals.capture.inputs import read_prompts

    records = [{"prompt": p} for p in TINY_PROMPTS] + [{"messages": chat} for chat in CHATS]
    jsonl = write_jsonl(tmp_path / "p.jsonl", records)
    datasets.Dataset.from_list([{"prompt": r.get("prompt"), "messages": r.get("messages")} for r in records]).to_parquet(
        str(tmp_path / "p.parquet")
    )
    assert read_prompts(tmp_path / "p.parquet") == read_prompts(jsonl)


@pytest.mark.slow  # Inspect's start-up alone takes ~40 s on the 2-core machine
def test_inspect_log_gives_its_transcripts(tmp_path: Path) -> None:
    """An Inspect log (a real run on Inspect's mock model): each sample's messages as a chat."""
    from inspect_ai import Task
    from inspect_ai import eval as inspect_eval
    from inspect_ai.dataset import Sample
    from inspect_ai.solver import generate

    from lens_evals.capture.inputs import read_prompts

    (log,) = inspect_eval(
        Task(dataset=[Sample(input=p) for p in TINY_PROMPTS[:3]], solver=generate()),
        model="mockllm/model",
        log_dir=str(tmp_path / "logs"),
        display="none",
    )
    items = read_prompts(log.location)
    assert [item.messages[0] for item in items] == [("user", p) for p in TINY_PROMPTS[:3]]


@pytest.mark.slow  # two engine starts in subprocesses (~2 min on the 2-core machine)
def test_sigkill_then_resume_from_the_command_line(tiny_path: Path, tmp_path: Path) -> None:
    """`lens-evals capture` killed with SIGKILL once two shards are recorded, then run again: every
    prompt once, every shard intact."""
    import os
    import signal

    from transformers import AutoTokenizer

    prompts = random_token_prompts(tmp_path / "p.jsonl", 400, 240, len(AutoTokenizer.from_pretrained(tiny_path)))
    out = tmp_path / "out"
    command = [
        sys.executable,
        "-m",
        "lens_evals.cli",
        "capture",
        str(prompts),
        "--model",
        "tiny-llama",
        "--layers",
        "0,1,2,3",
        "--out",
        str(out),
        "--batch-size",
        "8",
        "--shard-rows",
        "8",
        *share_args(),
    ]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and process.poll() is None:
        manifest = out / "manifest.json"
        if manifest.exists() and len(json.loads(manifest.read_text())["shards"]) >= 2:
            break
        time.sleep(0.05)
    assert process.poll() is None, "the capture ended before it could be killed"
    os.kill(process.pid, signal.SIGKILL)
    process.wait()
    killed = CaptureReader(out).manifest
    assert not killed.complete and 2 <= len(killed.shards) and len(killed.rows) < 400
    subprocess.run(command, check=True, timeout=600, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    reader = CaptureReader(out)
    reader.verify_all()
    assert reader.manifest.complete
    assert [row.prompt_index for row in reader.manifest.rows] == list(range(400))
    assert reader.manifest.rows[: len(killed.rows)] == killed.rows  # the rows kept before the kill are untouched


def test_layers_outside_the_model_are_refused_before_any_engine_starts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Read from the model's config.json (tiny-llama: 4 layers), so a large model's start is not
    waited for; nothing is written to --out. The engine's own check stays for a caller's engine."""
    import lens_evals.engine.frontend.offline

    def no_engine(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("an engine was started for a capture refused by its arguments")

    monkeypatch.setattr(lens_evals.engine.frontend.offline, "engine_for", no_engine)
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "the truth"}])
    with pytest.raises(CaptureError, match=r"layers \[4, 9\] are outside the model's 4 layers \(0\.\.3\)"):
        run_capture(prompts, "tiny-llama", [1, 9, 4], tmp_path / "out")
    assert not (tmp_path / "out").exists()
