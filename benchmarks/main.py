"""``python -m benchmarks`` (``lens-evals bench`` from a checkout): prepare the model and prompts, run each system, check, report."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from benchmarks.config import BenchConfig
from benchmarks.systems import ALL_SYSTEMS, resolve
from lens_evals.cli.checks import (
    batch_sizes,
    bench_systems,
    check_layer,
    count,
    layer_index,
    model_name_or_dir,
    positive_float,
    positive_int,
)

CPU_MODEL = "smollm2-135m-instruct"
# On 2 CPU cores SmolLM2's prefill is ~99.8 % model time (22,583 tokens: 99-162 s a run, ours
# 0.3 s); the tiny Llama keeps the run to minutes and makes the plugin's own cost visible.
PREFILL_CPU_MODEL = "tiny-llama"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--workload",
        choices=("decode", "prefill", "capture-disk"),
        default="decode",
        help="decode: 8-64-token prompts, many new tokens; prefill: Alpaca-like 40-400-token prompts, "
        "max_tokens=1, every token captured (issue #21); capture-disk: `lens-evals capture` of the prefill "
        "prompts at every layer against the disk's own bandwidth (benchmarks/capture_disk.py, issue #47)",
    )
    parser.add_argument(
        "--prompts", type=positive_int, default=None, help="number of prompts (decode: CPU 64, GPU 256; prefill: CPU 128, GPU 1000)"
    )
    parser.add_argument(
        "--max-tokens", type=positive_int, default=None, help="generated tokens per prompt (decode: CPU 32, GPU 128; prefill: 1)"
    )
    parser.add_argument("--layer", type=layer_index, default=None, help="hooked layer (default: the middle one)")
    parser.add_argument("--systems", type=bench_systems, default=None, help=f"comma-separated subset of: {', '.join(ALL_SYSTEMS)}")
    parser.add_argument("--out", type=Path, default=Path("logs/bench"), help="output directory")
    parser.add_argument(
        "--model",
        type=model_name_or_dir,
        default=None,
        help=f"CPU: a `lens-evals models` name or a directory (default {CPU_MODEL}; prefill {PREFILL_CPU_MODEL})",
    )
    parser.add_argument("--gpu", action="store_true", help="random Llama-8B-shaped model in bf16 on the GPU")
    parser.add_argument("--gpu-model-dir", type=Path, default=Path("/tmp/lens-evals-bench-llama8b"), help="where --gpu builds its model")
    parser.add_argument("--gpu-layers", type=positive_int, default=32, help="decoder layers of the --gpu model (32: Llama-8B)")
    parser.add_argument("--hf-batch", type=positive_int, default=None, help="batch size of the HF-based systems (CPU 16, GPU 64)")
    parser.add_argument(
        "--hf-batches",
        type=batch_sizes,
        default=None,
        help="hf-forward: batch sizes to try, the fastest is timed (CPU 4,8,16; GPU 16,32,64)",
    )
    parser.add_argument(
        "--engine", choices=("inprocess", "multiprocess"), default=None, help="vLLM engine (CPU inprocess, GPU multiprocess)"
    )
    parser.add_argument("--steer-scale", type=float, default=0.0, help="0 keeps the work of steering and the tokens of pure vLLM")
    parser.add_argument("--check-prompts", type=count, default=2, help="prompts whose captured layer is compared with HF")
    parser.add_argument("--repeats", type=positive_int, default=None, help="timed runs per system, the best reported (decode 1, prefill 2)")
    parser.add_argument(
        "--sync-debug",
        action="store_true",
        help="GPU, --engine inprocess: count host-GPU syncs of each vLLM system (one extra untimed run)",
    )
    parser.add_argument("--resume", action="store_true", help="keep results in --out from an earlier run of the same work")
    parser.add_argument(
        "--tensor-parallel-size", type=positive_int, default=1, help="vLLM systems: tensor parallel workers (CPU: one core each)"
    )
    parser.add_argument("--pipeline-parallel-size", type=positive_int, default=1, help="vLLM systems: pipeline stages")
    parser.add_argument("--timeout", type=positive_float, default=3600.0, help="seconds allowed per system")


def _model(args: argparse.Namespace) -> tuple[Path, str]:
    from benchmarks.launcher import child_env

    if args.gpu:
        out = subprocess.run(
            [sys.executable, "-m", "benchmarks.gpu_model", str(args.gpu_model_dir), str(args.gpu_layers)],
            env=child_env(),
            check=True,
            capture_output=True,
            text=True,
        )
        path = Path(out.stdout.strip().splitlines()[-1])
        return path, f"random Llama-8B-shaped ({args.gpu_layers} layers)"
    from lens_evals.models.registry import resolve_model

    name = args.model or (PREFILL_CPU_MODEL if args.workload == "prefill" else CPU_MODEL)
    return Path(resolve_model(name)), name


def build_config(args: argparse.Namespace) -> tuple[BenchConfig, str]:
    from benchmarks.prefill import prefill_lengths
    from benchmarks.prompts import make_prompts

    model_dir, label = _model(args)
    hf_config = json.loads((model_dir / "config.json").read_text())
    num_layers = int(hf_config["num_hidden_layers"])
    layer = num_layers // 2 if args.layer is None else args.layer
    if not 0 <= layer < num_layers:
        raise ValueError(f"--layer {layer} out of range: the model has {num_layers} layers")
    prefill = args.workload == "prefill"
    n_prompts = args.prompts or ((1000 if args.gpu else 128) if prefill else (256 if args.gpu else 64))
    lengths = prefill_lengths(n_prompts) if prefill else None
    hf_batches = args.hf_batches or ("16,32,64" if args.gpu else "4,8,16")
    cfg = BenchConfig(
        model_dir=str(model_dir),
        prompts=make_prompts(n_prompts, model_dir, int(hf_config["vocab_size"]), lengths=lengths),
        max_tokens=args.max_tokens or (1 if prefill else 128 if args.gpu else 32),
        workload=args.workload,
        probe_count=3 if prefill else 1,
        hf_batches=[int(b) for b in hf_batches.split(",")],
        layer=layer,
        num_layers=num_layers,
        hidden_size=int(hf_config["hidden_size"]),
        device="cuda" if args.gpu else "cpu",
        dtype="bfloat16" if args.gpu else "float32",
        hf_batch=args.hf_batch or (64 if args.gpu else 16),
        check_prompts=min(args.check_prompts, n_prompts),
        steer_scale=args.steer_scale,
        engine=args.engine or ("multiprocess" if args.gpu else "inprocess"),
        timeout_s=args.timeout,
        repeats=args.repeats or (2 if prefill else 1),
        sync_debug=args.sync_debug,
        tensor_parallel_size=args.tensor_parallel_size,
        pipeline_parallel_size=args.pipeline_parallel_size,
    )
    return cfg, label


def run_bench(args: argparse.Namespace) -> int:
    from benchmarks import checks, report
    from benchmarks.launcher import run_systems

    systems = resolve(args.systems.split(",") if args.systems else None, args.gpu, args.workload)
    cfg, label = build_config(args)
    print(
        f"[bench] {cfg.workload}, {label}: {len(cfg.prompts)} prompts ({cfg.prompt_tokens} tokens) x {cfg.max_tokens} new tokens, layer {cfg.layer}",
        flush=True,
    )
    results = run_systems(systems, cfg, args.out, resume=args.resume)
    checks.annotate(results, cfg, args.out)
    text, png = report.write(results, cfg, label, args.out)
    print(text)
    print(f"[bench] wrote {args.out / 'bench.json'}, {args.out / 'bench.md'}" + (f", {png}" if png else ""))
    failed = [r["system"] for r in results if r["status"] == "failed"]
    wrong = [r["system"] for r in results if r.get("tokens_equal") is False and ALL_SYSTEMS[r["system"]].kind == "vllm"]
    if failed or wrong:
        print(f"[bench] failed: {failed}; tokens differ from pure vLLM: {wrong}")
        return 1
    return 0


def build_parser(prog: str = "python -m benchmarks") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description="speed against pure vLLM, HF + hook, nnsight, TransformerLens")
    add_arguments(parser)
    return parser


def main(argv: list[str] | None = None, prog: str = "python -m benchmarks") -> int:
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    if args.workload == "capture-disk":
        from benchmarks.capture_disk import run_from_args

        return run_from_args(args)
    if not args.gpu:
        check_layer(parser, args.model or (PREFILL_CPU_MODEL if args.workload == "prefill" else CPU_MODEL), args.layer)
    return run_bench(args)
