"""Where the decode overhead of our features goes (issue #47): plain requests against capture of
one layer, steering and three probes, in paired rounds on ONE in-process engine (graph mode
unless ``--eager``), with the plugin's host time per decode step by phase, and optionally a
cProfile of our code and a torch.profiler summary of the top ops, one extra round per feature.

The engine runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so the worker's phase
timers (``engine/transport/timing.py``) are read here after every round. Per feature the report
gives the median paired ratio (feature time / plain time of the same round), the wall time per
decode step, and "ours": the plugin's host time per step on the engine's thread (every timed
phase but the forward itself, plus the eager taps that run inside it; not the writer thread's
rows, which run beside the steps). What a feature adds per step is then split into
our host work (d ours) and the rest (d wall - d ours: device work queued by us, syncs, vLLM's
own extra work for the request); the per-phase table says which phase the host part is.

CPU (tiny Llama, torch.compile on, no CUDA graphs; ~2 min)::

    PYTHONPATH=$PWD .venv/bin/python scripts/decode_profile.py --prompts 64 --max-tokens 64

GPU, the issue's workload (random Llama-8B shape, bf16, 256 prompts x 128 tokens, layer 16,
CUDA graphs + torch.compile; engine start ~150 s, then ~1 min of rounds and profiles)::

    bash scripts/gpu_decode_profile.sh     (installs the package for vLLM's plugin loader; see its header)
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # benchmarks/ lives at the repo root
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the worker in this process: its timers are read here
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; a shared 2-core host has little to spare

from benchmarks.config import BenchConfig  # noqa: E402
from benchmarks.interleaved import rotated, summarise  # noqa: E402
from benchmarks.systems import System  # noqa: E402
from lens_evals import settings  # noqa: E402
from lens_evals.engine.transport.timing import DETAIL  # noqa: E402  (a phase inside another: shown, not summed)
from lens_evals.engine.worker import stream_write  # noqa: E402

FEATURES = ("plain", "capture-1", "steer-1", "probe")
OLD = ":old"  # a feature's rounds with the worker's pre-#47 paths (``--compare-old``)
THREADS = ":threads"  # capture rounds whose fetch writes on ``--write-threads`` threads (LENS_EVALS_WRITE_THREADS)
AT_FETCH = ":at-fetch"  # capture rounds whose rows are all written at the fetch, none while decoding (``stream_write``)
STEP = "layout and admission"  # timed once at every step that schedules requests
FORWARD = ("forward (queued)", "forward with taps (queued)")  # the model itself (eager taps are timed inside: ours)
PER_ROUND = ("fetch:", "release:", "early:", "admit:")  # once per call (or per request), not per step
WRITER = ("early: write rows", "stream: write rows")  # on the writer thread, beside the steps: shown, not ours


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpu", action="store_true", help="the random Llama-8B shape in bf16 on CUDA (benchmarks/gpu_model.py)")
    parser.add_argument("--model", default=None, help="model name or directory (default: tiny-llama on CPU)")
    parser.add_argument("--gpu-model-dir", default="/tmp/lens-evals-bench-llama8b")
    parser.add_argument("--gpu-layers", type=int, default=32)
    parser.add_argument("--prompts", type=int, default=None, help="default: 256 on the GPU, 64 on CPU")
    parser.add_argument("--max-tokens", type=int, default=None, help="default: 128 on the GPU, 64 on CPU")
    parser.add_argument("--layer", type=int, default=None, help="default: the middle layer")
    parser.add_argument("--probes", type=int, default=3, help="probes per request of the probe feature")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--eager", action="store_true", help="eager hooks instead of graph mode")
    parser.add_argument("--features", default=",".join(FEATURES))
    parser.add_argument(
        "--compare-old", action="store_true", help="also each feature with the pre-#47 worker paths (no decode runs, probe pairs), paired"
    )
    parser.add_argument(
        "--write-threads", type=int, default=0, help="also capture rounds whose fetch writes the rows on this many threads, paired"
    )
    parser.add_argument(
        "--compare-stream",
        action="store_true",
        help="also capture rounds with every row written at the fetch (none while decoding), paired",
    )
    parser.add_argument("--cprofile", action="store_true", help="one more round per feature under cProfile (ours only)")
    parser.add_argument("--torch-profile", action="store_true", help="one more round per feature under torch.profiler")
    parser.add_argument("--profile-tokens", type=int, default=16, help="tokens per request in the profiled rounds")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    parser.add_argument("--out", default="logs/decode-profile")
    return parser.parse_args(argv)


def model_dir(args: argparse.Namespace) -> Path:
    if args.gpu:
        built = subprocess.run(
            [sys.executable, "-m", "benchmarks.gpu_model", args.gpu_model_dir, str(args.gpu_layers)],
            check=True, capture_output=True, text=True, cwd=Path(__file__).resolve().parent.parent,
        )  # fmt: skip
        return Path(built.stdout.strip().splitlines()[-1])
    from lens_evals.models.registry import resolve_model

    return Path(resolve_model(args.model or "tiny-llama"))


def bench_config(args: argparse.Namespace, path: Path) -> BenchConfig:
    from benchmarks.prompts import make_prompts

    config = json.loads((path / "config.json").read_text())
    num_layers, hidden = int(config["num_hidden_layers"]), int(config["hidden_size"])
    n_prompts = args.prompts or (256 if args.gpu else 64)
    prompts = make_prompts(n_prompts, path, int(config["vocab_size"]))
    return BenchConfig(
        model_dir=str(path),
        prompts=prompts,
        max_tokens=args.max_tokens or (128 if args.gpu else 64),
        layer=num_layers // 2 if args.layer is None else args.layer,
        num_layers=num_layers,
        hidden_size=hidden,
        device="cuda" if args.gpu else "cpu",
        dtype="bfloat16" if args.gpu else "float32",
        probe_count=args.probes,
        gpu_memory_utilization=args.gpu_memory_utilization,
    )


def start_engine(args: argparse.Namespace, cfg: BenchConfig) -> Any:
    from benchmarks.vllm_systems import engine_options
    from lens_evals.engine.plugin import require_plugin

    require_plugin()
    system = System("decode-profile", "decode-profile", "vllm-mixed", lens="plain", cuda_graphs=not args.eager)
    options = engine_options(system, cfg)
    if not args.eager:
        options["additional_config"] = {"lens_evals": {"graph_layers": [cfg.layer]}}
    from vllm import LLM

    return LLM(**options)


class Rounds:
    """The features' paired rounds on one engine, with the plugin's phase totals per feature."""

    def __init__(self, llm: Any, cfg: BenchConfig, features: list[str], write_threads: int = 0) -> None:
        from benchmarks.vllm_systems import engine_prompts, lens_extra_args, sampling_params

        self.llm, self.cfg, self.features = llm, cfg, features
        self.prompts = engine_prompts(cfg.prompts)
        extras = {f: lens_extra_args(System(f, f, "vllm", lens=f.split(":")[0]), cfg) for f in features}
        self.params = {f: sampling_params(cfg, cfg.max_tokens, extra) for f, extra in extras.items()}
        self.short = {f: sampling_params(cfg, 4, extra) for f, extra in extras.items()}
        self.times: dict[str, list[float]] = {f: [] for f in features}
        self.phases: dict[str, dict[str, list[float]]] = {f: {} for f in features}  # name -> [seconds, calls]
        self.tokens: dict[str, list[list[int]]] = {}
        self.write_threads = write_threads  # the ``:threads`` rounds' writer threads

    def generate(self, feature: str, params: Any = None) -> list[Any]:
        old = feature.endswith(OLD)
        if old:
            self.llm.collective_rpc(_new_paths, args=(False,))
        threads = {settings.WRITE_THREADS.name: str(self.write_threads)} if feature.endswith(THREADS) else {}
        at_fetch = 1 << 62 if feature.endswith(AT_FETCH) else stream_write.MIN_BYTES
        try:
            # the worker is in this process: its fetch reads the variable, its rounds the constant
            with mock.patch.dict(os.environ, threads), mock.patch.object(stream_write, "MIN_BYTES", at_fetch):
                outputs: list[Any] = self.llm.generate(self.prompts, params or self.params[feature], use_tqdm=False)
        finally:
            if old:
                self.llm.collective_rpc(_new_paths, args=(True,))
        return outputs

    def warm_up(self) -> None:
        from lens_evals.engine.transport import timing

        for feature in self.features:
            self.llm.generate(self.prompts[:8], self.short[feature], use_tqdm=False)
        timing.take()

    def run(self, rounds: int) -> None:
        from lens_evals.engine.transport import timing

        for index in range(rounds):
            for feature in rotated(tuple(self.features), index):
                timing.take()
                began = time.perf_counter()
                outputs = self.generate(feature)
                self.times[feature].append(time.perf_counter() - began)
                for name, (seconds, calls) in timing.take().items():
                    total = self.phases[feature].setdefault(name, [0.0, 0])
                    total[0] += seconds
                    total[1] += calls
                self.tokens[feature] = [list(o.outputs[0].token_ids) for o in outputs]


def _new_paths(worker: Any, on: bool) -> bool:
    """On the worker (``collective_rpc``): decode runs and probe matrices on or off (off: one
    piece per request per step and probe pairs gathered, as before issue #47)."""
    from lens_evals.engine.compat.worker import runner_from_worker
    from lens_evals.engine.worker.state import get_state

    core = get_state(runner_from_worker(worker)).core
    core.stores.end_runs()
    core.decode_runs = core.planner.probe_matrix = on
    return on


def step_table(r: Rounds) -> tuple[list[str], dict[str, Any]]:
    """Lines of the report and its JSON: ratios, wall and our host time per decode step."""
    summary = summarise(r.times)
    per: dict[str, dict[str, float]] = {}
    for feature in r.features:
        phases = r.phases[feature]
        steps = phases.get(STEP, [0.0, 1])[1] or 1
        wall = sum(r.times[feature]) / steps
        top = {
            name: value for name, value in phases.items() if not name.startswith(DETAIL) and name not in WRITER
        }  # details are inside these
        ours = sum(s for name, (s, _) in top.items() if name not in FORWARD and not name.startswith(PER_ROUND))
        per_round = sum(s for name, (s, _) in top.items() if name.startswith(PER_ROUND))
        per[feature] = {"steps": steps / len(r.times[feature]), "wall_ms": 1e3 * wall, "ours_ms": 1e3 * ours / steps}
        per[feature]["per_call_ms"] = 1e3 * per_round / len(r.times[feature])
    base = per[r.features[0]]
    lines = [
        "feature | paired ratio, median (range) | steps/round | wall ms/step | ours ms/step | d wall | d ours | rest | per call (admit, fetch) ms",
        "---|---|---|---|---|---|---|---|---",
    ]
    for feature in r.features:
        p, s = per[feature], summary[feature]
        d_wall, d_ours = p["wall_ms"] - base["wall_ms"], p["ours_ms"] - base["ours_ms"]
        p.update(d_wall_ms=d_wall, d_ours_ms=d_ours, paired_median=s["x_plain_paired_median"])
        lines.append(
            f"{feature} | {s['x_plain_paired_median']:.3f}x ({s['x_plain_paired_min']:.3f}-{s['x_plain_paired_max']:.3f}) | "
            f"{p['steps']:.0f} | {p['wall_ms']:.3f} | {p['ours_ms']:.3f} | {d_wall:+.3f} | {d_ours:+.3f} | {d_wall - d_ours:+.3f} | "
            f"{p['per_call_ms']:.1f}"
        )
    names = sorted({name for f in r.features for name in r.phases[f]})
    lines += [
        "",
        "phase, ms per decode step (per call for admit:, fetch:, release:, early: but the writer thread's rows) | "
        + " | ".join(r.features),
        "---|" + "---|" * len(r.features),
    ]
    for name in names:
        cells = []
        for feature in r.features:
            seconds = r.phases[feature].get(name, [0.0, 0])[0]
            per_call = name.removeprefix(DETAIL).startswith(PER_ROUND) and name not in WRITER
            divisor = len(r.times[feature]) if per_call else per[feature]["steps"] * len(r.times[feature])
            cells.append(f"{1e3 * seconds / divisor:.4f}")
        lines.append(f"{name} | " + " | ".join(cells))
    for feature in r.features[1:]:
        same = sum(a == b for a, b in zip(r.tokens[feature], r.tokens[r.features[0]]))
        lines.append(f"\n{feature}: tokens equal plain on {same}/{len(r.prompts)} prompts (last round)")
    return lines, {"summary": summary, "per_step": per, "phases": r.phases, "times": r.times}


def profiled_round(r: Rounds, feature: str, out: Path, use_cprofile: bool, use_torch: bool, tokens: int) -> list[str]:
    """One untimed round of ``feature`` under cProfile (our functions) and/or torch.profiler."""
    from benchmarks.vllm_systems import sampling_params

    params = sampling_params(r.cfg, tokens, r.params[feature].extra_args)
    lines: list[str] = []
    if use_cprofile:
        profile = cProfile.Profile()
        profile.enable()
        try:
            r.generate(feature, params)
        finally:
            profile.disable()
        text = io.StringIO()
        stats = pstats.Stats(profile, stream=text)
        stats.sort_stats("tottime").print_stats(25)
        stats.sort_stats("cumulative").print_stats("lens_evals", 30)
        (out / f"cprofile-{feature}.txt").write_text(text.getvalue())
        lines.append(f"cProfile: {out / f'cprofile-{feature}.txt'}")
    if use_torch:
        lines += torch_profiled(lambda: r.generate(feature, params), out / f"torch-{feature}.txt", r.cfg.device == "cuda")
    return lines


def torch_profiled(run: Callable[[], Any], path: Path, cuda: bool) -> list[str]:
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        run()
    averages = prof.key_averages()
    text = "\n".join(
        averages.table(sort_by=key, row_limit=20) for key in (["self_cuda_time_total"] if cuda else []) + ["self_cpu_time_total"]
    )
    path.write_text(text)
    if cuda:
        torch.cuda.synchronize()
    return [f"torch.profiler: {path}"]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    from lens_evals.engine.transport import timing

    timing.collect()
    path = model_dir(args)
    cfg = bench_config(args, path)
    features = [f.strip() for f in args.features.split(",") if f.strip()]
    if features[0] != "plain":
        raise SystemExit("--features must start with plain (the pairing's reference)")
    if args.compare_old:
        features += [f + OLD for f in features[1:] if f != "steer-1"]  # steering stores no rows: the same paths
    if args.write_threads:
        features += [f + THREADS for f in features[1:] if f.startswith("capture") and ":" not in f]
    if args.compare_stream:
        features += [f + AT_FETCH for f in features[1:] if f.startswith("capture") and ":" not in f]
    began = time.perf_counter()
    llm = start_engine(args, cfg)
    started = time.perf_counter() - began
    rounds = Rounds(llm, cfg, features, args.write_threads)
    rounds.warm_up()
    rounds.run(args.rounds)
    mode = "eager" if args.eager else "graph mode"
    header = [
        f"# decode profile: {path.name}, {cfg.dtype}, {cfg.device}, {mode}, layer {cfg.layer}, {len(cfg.prompts)} prompts x "
        f"{cfg.max_tokens} tokens, {args.rounds} rounds, {args.probes} probes; engine start {started:.0f} s; "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
        "",
    ]
    lines, report = step_table(rounds)
    for feature in [f for f in features if ":" not in f] if (args.cprofile or args.torch_profile) else []:
        lines += profiled_round(rounds, feature, out, args.cprofile, args.torch_profile, args.profile_tokens)
    text = "\n".join(header + lines)
    print(text)
    (out / "decode-profile.md").write_text(text + "\n")
    (out / "decode-profile.json").write_text(json.dumps({"mode": mode, "device": cfg.device, **report}, indent=1, default=str))
    llm.llm_engine.engine_core.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
