"""Capture to disk against the disk's own bandwidth (issue #47): ``lens-evals bench --workload
capture-disk`` (or ``python -m benchmarks.capture_disk``). In one process, on the prefill workload's
prompts at every layer of the bench model, into ``--out``'s own directory (so the same disk):

1. the disk alone: the capture's byte count written sequentially in 64 MiB writes from an aligned
   buffer and fsynced, through ``O_DIRECT`` and through the page cache (``dd``'s two modes);
2. the writer alone: the same rows, made once in memory, through ``lens-evals capture``'s shard
   writer (shard images, writer threads, manifest) without an engine: its speed against (1);
   and again with twice the writer threads;
3. ``lens-evals capture`` itself (``run_capture`` on an engine opened first, so its start is apart;
   first with the shard buffers it had before 2026-12-08, writers + 1, then as it is),
   with the same prompts' plain prefill (no capture) on the same engine as the compute floor, and
   the same batches' capture held in memory and dropped (the engine's part: capture = its time and
   the writer's, overlapped); peak host RSS (VmHWM) and device memory of the capture.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import shutil
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from benchmarks.config import BenchConfig
from benchmarks.process_stats import peak_rss_gib, reset_peak_rss

CHUNK = 64 << 20
GB = 1e9


def disk_bandwidth(directory: Path, n_bytes: int, direct: bool) -> float:
    """Bytes per second of writing ``n_bytes`` to a new file in ``directory`` and fsyncing it."""
    path = directory / f"disk-probe-{'direct' if direct else 'buffered'}.bin"
    buffer = mmap.mmap(-1, CHUNK)  # page-aligned, as O_DIRECT needs
    buffer.write(os.urandom(1 << 20) * (CHUNK >> 20))
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if direct else 0)
    start = time.perf_counter()
    fd = os.open(path, flags, 0o644)
    try:
        written = 0
        while written < n_bytes:
            written += os.write(fd, memoryview(buffer)[: min(CHUNK, -(-(n_bytes - written) // 4096) * 4096)])
        os.fsync(fd)
    finally:
        os.close(fd)
    seconds = time.perf_counter() - start
    path.unlink()
    return written / seconds


def _manifest(cfg: BenchConfig, prompts: Path, layers: list[int]) -> Any:
    from lens_evals.capture.inputs import source_sha256
    from lens_evals.capture.manifest import CaptureManifest

    return CaptureManifest(
        model=cfg.model_dir, layers=layers, source=str(prompts), source_sha256=source_sha256(prompts), n_prompts=len(cfg.prompts)
    )


def writer_alone(cfg: BenchConfig, prompts: Path, out: Path, settings: Any) -> tuple[float, int]:
    """Seconds and bytes of the shard writer fed the capture's rows from memory (no engine)."""
    from lens_evals.capture.manifest import write_manifest
    from lens_evals.capture.runner import _ShardSink

    layers = list(range(cfg.num_layers))
    longest = max(len(p) for p in cfg.prompts)
    rows = torch.randn(len(layers), longest, cfg.hidden_size).to(getattr(torch, cfg.dtype))
    manifest = _manifest(cfg, prompts, layers)
    out.mkdir(parents=True)
    write_manifest(out, manifest)
    start = time.perf_counter()
    with tqdm(total=len(cfg.prompts), disable=True) as progress, _ShardSink(out, manifest, settings, progress) as sink:
        for index, ids in enumerate(cfg.prompts):
            sink.add(index, ids, rows[:, : len(ids)])
    seconds = time.perf_counter() - start
    n_bytes = sum(shard.n_bytes for shard in manifest.shards)
    shutil.rmtree(out)
    return seconds, n_bytes


def engine_capture(cfg: BenchConfig, prompts: Path, out: Path, settings: Any) -> dict[str, Any]:
    """``run_capture`` on an engine opened here (start timed apart); plain prefill of the same prompts first."""
    from vllm import SamplingParams

    from lens_evals.capture.runner import run_capture
    from lens_evals.engine.frontend.offline import close_offline_engine, open_offline_engine
    from lens_evals.request.spec import CAPTURE_KEY

    start = time.perf_counter()
    engine_args: dict[str, Any] = {"dtype": cfg.dtype, "max_model_len": cfg.max_model_len, "skip_tokenizer_init": True}
    engine_args["enforce_eager"] = True
    if cfg.device == "cuda":
        engine_args.update(gpu_memory_utilization=cfg.gpu_memory_utilization, load_format="dummy")
    llm = open_offline_engine(cfg.model_dir, in_process=True, **engine_args)
    result: dict[str, Any] = {"engine_start_s": time.perf_counter() - start}
    try:
        inputs = [{"prompt_token_ids": ids} for ids in cfg.prompts]
        params = SamplingParams(max_tokens=1, temperature=0.0)
        llm.generate(inputs[: settings.batch_size], params, use_tqdm=False)  # warm-up
        start = time.perf_counter()
        for begin in range(0, len(inputs), settings.batch_size):  # the capture's batches, without capture
            llm.generate(inputs[begin : begin + settings.batch_size], params, use_tqdm=False)
        result["plain_prefill_s"] = time.perf_counter() - start
        held = SamplingParams(max_tokens=1, temperature=0.0, extra_args={CAPTURE_KEY: list(range(cfg.num_layers))})
        start = time.perf_counter()
        for begin in range(0, len(inputs), settings.batch_size):  # the capture's engine part: rows to the host, dropped
            outputs = llm.generate(inputs[begin : begin + settings.batch_size], held, use_tqdm=False)
            assert all(output.activations["residual_stream"].shape[0] == cfg.num_layers for output in outputs)
            del outputs
        result["capture_in_memory_s"] = time.perf_counter() - start
        before = replace(settings, buffers=settings.writers + 1)  # the shard buffers before 2026-12-08
        start = time.perf_counter()
        run_capture(prompts, cfg.model_dir, range(cfg.num_layers), out / "before", llm=llm, settings=before, show_progress=False)
        result["capture_few_buffers_s"] = time.perf_counter() - start
        shutil.rmtree(out / "before")
        reset_peak_rss()  # the peaks reported are the capture's own, below
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        manifest = run_capture(prompts, cfg.model_dir, range(cfg.num_layers), out, llm=llm, settings=settings, show_progress=False)
        result["capture_s"] = time.perf_counter() - start
        result["capture_bytes"] = sum(shard.n_bytes for shard in manifest.shards)
        result["capture_shards"] = len(manifest.shards)
        result["peak_rss_gib"] = peak_rss_gib()
        result["peak_device_gib"] = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None
    finally:
        close_offline_engine(llm)
        shutil.rmtree(out, ignore_errors=True)
    return result


def run(cfg: BenchConfig, out_dir: Path, label: str, batch_size: int, writers: int, probe_gib: float) -> dict[str, Any]:
    """Everything at the capture's size, except the page-cache measurements (several times slower
    on some hosts) at most ``probe_gib``."""
    from lens_evals.capture.runner import CaptureSettings

    out_dir.mkdir(parents=True, exist_ok=True)
    prompts = out_dir / "capture-disk-prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt_token_ids": ids}) + "\n" for ids in cfg.prompts))
    settings = CaptureSettings(batch_size=batch_size, writers=writers)
    element = torch.empty((), dtype=getattr(torch, cfg.dtype)).element_size()
    n_bytes = cfg.prompt_tokens * cfg.num_layers * cfg.hidden_size * element
    result: dict[str, Any] = {"model": label, "prompts": len(cfg.prompts), "tokens": cfg.prompt_tokens, "layers": cfg.num_layers}
    result["disk_direct_Bps"] = disk_bandwidth(out_dir, n_bytes, direct=True)
    small = int(min(n_bytes, probe_gib * 2**30))
    result["disk_buffered_Bps"] = disk_bandwidth(out_dir, small, direct=False)
    some = replace(cfg, prompts=cfg.prompts[: max(1, int(len(cfg.prompts) * small / n_bytes))])
    runs = (("writer", True, cfg, writers), ("writer_more", True, cfg, 2 * writers), ("writer_buffered", False, some, writers))
    for mode, direct, work, threads in runs:
        seconds, written = writer_alone(work, prompts, out_dir / "writer-alone", CaptureSettings(writers=threads, direct_io=direct))
        result[f"{mode}_s"], result[f"{mode}_Bps"] = seconds, written / seconds
    print(f"[capture-disk] before the engine: {json.dumps(result)}", flush=True)  # kept if the run is cut
    result.update(engine_capture(cfg, prompts, out_dir / "capture", settings))
    result["capture_Bps"] = result["capture_bytes"] / result["capture_s"]
    (out_dir / "capture-disk.json").write_text(json.dumps(result, indent=1))
    text = report(result, writers, batch_size)
    (out_dir / "capture-disk.md").write_text(text)
    print(text)
    return result


def report(r: dict[str, Any], writers: int, batch_size: int) -> str:
    disk = r["disk_direct_Bps"]

    def rate(bps: float) -> str:
        return f"{bps / GB:.2f} GB/s ({bps / disk:.0%} of the disk)"

    device = f", peak device {r['peak_device_gib']:.2f} GiB" if r.get("peak_device_gib") is not None else ""
    return "\n".join(
        [
            f"capture to disk: {r['model']}, {r['prompts']} prompts ({r['tokens']} tokens) x {r['layers']} layers, "
            f"{r['capture_bytes'] / GB:.2f} GB in {r['capture_shards']} shards; {writers} writers, batches of {batch_size}",
            "",
            "| what | seconds | rate |",
            "|---|---|---|",
            f"| disk alone, O_DIRECT + fsync (the reference) | {r['capture_bytes'] / disk:.2f} | {disk / GB:.2f} GB/s |",
            f"| disk alone, page cache + fsync (at most the probe's size) | - | {rate(r['disk_buffered_Bps'])} |",
            f"| shard writer alone (rows from memory), O_DIRECT | {r['writer_s']:.2f} | {rate(r['writer_Bps'])} |",
            f"| the same with {2 * writers} writers | {r['writer_more_s']:.2f} | {rate(r['writer_more_Bps'])} |",
            f"| shard writer alone, page cache (at most the probe's size) | {r['writer_buffered_s']:.2f} | "
            f"{rate(r['writer_buffered_Bps'])} |",
            f"| plain prefill, same batches (no capture) | {r['plain_prefill_s']:.2f} | - |",
            f"| the same batches' capture, held in memory and dropped (the engine's part) | {r['capture_in_memory_s']:.2f} | "
            f"{rate(r['capture_bytes'] / r['capture_in_memory_s'])} |",
            f"| `lens-evals capture` (engine started apart, {r['engine_start_s']:.0f} s) | {r['capture_s']:.2f} | "
            f"{rate(r['capture_Bps'])}; peak RSS {r['peak_rss_gib']:.2f} GiB{device} |",
            f"| the same with {writers + 1} shard buffers (before 2026-12-08), run just before | {r['capture_few_buffers_s']:.2f} | "
            f"{rate(r['capture_bytes'] / r['capture_few_buffers_s'])} |",
            "",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    from benchmarks.main import add_arguments

    parser = argparse.ArgumentParser(prog="python -m benchmarks.capture_disk", description=__doc__)
    add_arguments(parser)
    parser.add_argument("--capture-batch", type=int, default=16, help="prompts per engine call of the capture")
    parser.add_argument("--writers", type=int, default=2, help="shard writer threads")
    parser.add_argument("--probe-gib", type=float, default=8.0, help="page-cache measurements: at most this many GiB")
    return run_from_args(parser.parse_args(argv))


def config_only_llama(out_dir: Path, num_layers: int) -> Path:
    """The ``--gpu`` shape as a config alone, loaded with vLLM's random ``load_format=dummy``: the
    host's disk (64 GiB) holds the 44 GB capture, not a 16 GB checkpoint beside it."""
    from benchmarks.gpu_model import LLAMA_8B

    out_dir.mkdir(parents=True, exist_ok=True)
    config = {**LLAMA_8B, "num_hidden_layers": num_layers, "architectures": ["LlamaForCausalLM"], "model_type": "llama"}
    (out_dir / "config.json").write_text(json.dumps({**config, "torch_dtype": "bfloat16"}))
    (out_dir / "generation_config.json").write_text(json.dumps({"bos_token_id": 128000, "eos_token_id": 128001}))
    return out_dir


def run_from_args(args: argparse.Namespace) -> int:
    """The bench's arguments (``--gpu``, ``--model``, ``--prompts``, ``--out``) on the prefill prompts."""
    from benchmarks.main import build_config

    args.workload = "prefill"
    gpu, args.gpu = args.gpu, False
    if gpu:
        args.model = str(config_only_llama(Path("/tmp/lens-evals-capture-disk-8b"), args.gpu_layers))
        args.prompts = args.prompts or 1000
    cfg, label = build_config(args)
    if gpu:
        cfg.device, cfg.dtype = "cuda", "bfloat16"
        label = f"random Llama-8B-shaped ({args.gpu_layers} layers, dummy weights), bf16"
    run(cfg, args.out, label, getattr(args, "capture_batch", 16), getattr(args, "writers", 2), getattr(args, "probe_gib", 8.0))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
