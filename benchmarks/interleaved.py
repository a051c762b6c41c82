"""Our features and plain requests on ONE engine, in alternating rounds (systems ``lens-mixed``
and ``lens-graphs-mixed``).

Separate processes per system (the other rows) compare against pure vLLM with the plugin off,
but two processes of the same work differ by 5-30 % on a shared, host-bound machine. Here every
round runs the plain requests and each feature back to back on the same engine, in an order
that rotates each round, so each feature's time is paired with a plain time taken moments
before or after; the median of those per-round ratios is what the report calls the same-engine
ratio. Plain requests on this engine go through the plugin's step hook with nothing to do (the
``lens-plain`` row measures that against pure vLLM with the plugin off).

``LENS_EVALS_BENCH_PROFILE=DIR``: one more round per feature under cProfile, the top functions
written to ``DIR/<system>-<feature>.txt`` (with the in-process engine this includes the engine
and worker; with the multiprocess engine only the frontend)."""

from __future__ import annotations

import cProfile
import io
import pstats
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any

from benchmarks.config import BenchConfig
from benchmarks.measure import Measured, torch_dtype
from benchmarks.prefill import capture_layers, copy_note
from benchmarks.systems import System
from lens_evals import settings

FEATURES = ("plain", "capture-1", "steer-1", "probe")
PREFILL_FEATURES = ("plain", "capture-1", "capture-8", "steer-1", "probe")  # graph mode taps one layer: no capture-8
# The same capture with the step copies on the compute stream (``LENS_EVALS_COPY_OVERLAP=0``, set
# for the round through the worker method): the side stream's gain, paired on one engine (GPU only)
SYNC = "-sync"


def features_of(system: System, cfg: BenchConfig) -> tuple[str, ...]:
    features: tuple[str, ...] = PREFILL_FEATURES if cfg.workload == "prefill" and not system.graph_mode else FEATURES
    if cfg.workload == "prefill" and cfg.device == "cuda":
        features += tuple(f + SYNC for f in features if f.startswith("capture"))
    return features


@contextmanager
def copy_overlap(llm: Any, feature: str) -> Iterator[None]:
    """A ``-sync`` feature's round runs with the step copies on the compute stream."""
    if not feature.endswith(SYNC):
        yield
        return
    from lens_evals.engine.transport.protocol import COPY_METHOD

    reports = llm.collective_rpc(COPY_METHOD, args=(False,))
    if any(report["overlap"] for report in reports):
        raise RuntimeError(f"{feature}: the worker did not turn the copy overlap off: {reports}")
    try:
        yield
    finally:
        llm.collective_rpc(COPY_METHOD, args=(True,))


def rotated(features: tuple[str, ...], round_index: int) -> list[str]:
    """Round ``i`` starts at feature ``i mod n``: each feature runs first, second, ... equally often."""
    shift = round_index % len(features)
    return list(features[shift:] + features[:shift])


def paired_ratios(times: dict[str, list[float]], feature: str) -> list[float]:
    """The feature's time over the plain time of the same round, per round."""
    return [t / p for t, p in zip(times[feature], times["plain"]) if p > 0]


def summarise(times: dict[str, list[float]]) -> dict[str, dict[str, float]]:
    """Per feature: best and median seconds, the ratio of bests and the median paired ratio."""
    best_plain = min(times["plain"])
    out = {}
    for feature, seconds in times.items():
        ratios = paired_ratios(times, feature)
        out[feature] = {
            "best_s": min(seconds),
            "median_s": statistics.median(seconds),
            "x_plain_best": min(seconds) / best_plain,
            "x_plain_paired_median": statistics.median(ratios),
            "x_plain_paired_min": min(ratios),
            "x_plain_paired_max": max(ratios),
        }
    return out


def _profiled(run: Callable[[], Any], path: Path) -> None:
    profile = cProfile.Profile()
    profile.enable()
    try:
        run()
    finally:
        profile.disable()
    text = io.StringIO()
    stats = pstats.Stats(profile, stream=text).strip_dirs()
    stats.sort_stats("tottime").print_stats(40)
    stats.sort_stats("cumulative").print_stats(40)
    text.write("\n=== ours only (lens_evals/engine), by cumulative time ===\n")
    pstats.Stats(profile, stream=text).sort_stats("cumulative").print_stats("lens_evals/engine", 60)
    path.write_text(text.getvalue())


def delivered(feature: str, outputs: list[Any]) -> int:
    """How many outputs carry what the feature asked for (a capture, probe scores); steering and
    plain outputs carry nothing extra, so all count."""
    if feature.startswith("capture"):
        return sum((getattr(o, "activations", None) or {}).get("residual_stream") is not None for o in outputs)
    if feature == "probe":
        return sum(bool((getattr(o, "activations", None) or {}).get("probe_scores")) for o in outputs)
    return len(outputs)


def run_mixed(system: System, cfg: BenchConfig) -> Measured:
    from benchmarks.vllm_systems import count_syncs, engine_prompts, lens_extra_args, sampling_params, start_engine

    features = features_of(system, cfg)
    extras = {f: lens_extra_args(System(f, f, "vllm", lens=f.removesuffix(SYNC)), cfg) for f in features}
    llm, start_seconds, warm_seconds = start_engine(system, cfg, list(extras.values()))
    prompts = engine_prompts(cfg.prompts)
    params = {f: sampling_params(cfg, cfg.max_tokens, extra) for f, extra in extras.items()}

    def generate(feature: str) -> list[Any]:
        return llm.generate(prompts, params[feature], use_tqdm=False)

    times: dict[str, list[float]] = {f: [] for f in features}
    tokens: dict[str, list[list[int]]] = {}
    for round_index in range(max(2, cfg.repeats)):
        for feature in rotated(features, round_index):
            with copy_overlap(llm, feature):
                began = time.perf_counter()
                outputs = generate(feature)
                times[feature].append(time.perf_counter() - began)
            tokens[feature] = [list(o.outputs[0].token_ids) for o in outputs]
            carried = delivered(feature, outputs)
            if carried != len(prompts):  # a cheap round that did no work is no result
                raise RuntimeError(f"{feature}: only {carried}/{len(prompts)} outputs carry their result")
    measured = Measured(start_seconds, warm_seconds, min(times["plain"]), tokens["plain"], all_seconds=times["plain"])
    measured.interleaved = {"times": times, "summary": summarise(times)}
    for feature in features[1:]:
        same = sum(a == b for a, b in zip(tokens[feature], tokens["plain"]))
        measured.notes.append(f"{feature} last round: tokens equal plain on {same}/{len(prompts)}")
    if cfg.sync_debug:
        for feature in features:
            with copy_overlap(llm, feature):
                measured.notes.append(f"{feature}: " + count_syncs(cfg, partial(generate, feature)))
    profile_dir = settings.BENCH_PROFILE.get()
    if profile_dir:
        Path(profile_dir).mkdir(parents=True, exist_ok=True)
        for feature in features:
            with copy_overlap(llm, feature):
                _profiled(partial(generate, feature), Path(profile_dir) / f"{system.name}-{feature}.txt")
        measured.notes.append(f"profiles in {profile_dir}")
    if cfg.workload == "prefill":
        for feature in features:
            if feature.startswith("capture") and not feature.endswith(SYNC):
                layers = capture_layers(feature, cfg.num_layers, cfg.layer)
                note = copy_note(cfg.prompt_tokens, len(layers), cfg.hidden_size, torch_dtype(cfg.dtype), cfg.device)
                measured.notes.append(f"{feature}: {note}")
    return measured
