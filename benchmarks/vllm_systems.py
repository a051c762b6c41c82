"""Pure vLLM and our plugin's features, on the same engine settings. The plugin is switched off
for pure vLLM by ``LENS_EVALS_DISABLE=1`` in that process's environment (see ``runner``)."""

from __future__ import annotations

import time
import warnings
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from benchmarks.config import BenchConfig
from benchmarks.measure import Measured, Stopwatch, SystemUnavailable, best_of, torch_dtype
from benchmarks.prefill import capture_layers, copy_note
from benchmarks.systems import System
from lens_evals.engine.frontend.offline import offline_engine_args
from lens_evals.request.spec import CAPTURE_KEY, STEERING_KEY, SteeringVector

if TYPE_CHECKING:
    from vllm import LLM
    from vllm.inputs import TokensPrompt

PROBE_NAME = "bench"
PROBE_BIAS = 0.5


def has_tokenizer(model_dir: str) -> bool:
    return any((Path(model_dir) / name).exists() for name in ("tokenizer.json", "tokenizer.model"))


def probe_weights(hidden_size: int, seed: int = 11) -> npt.NDArray[np.float32]:
    weights: npt.NDArray[np.float32] = (np.random.default_rng(seed).standard_normal(hidden_size) / np.sqrt(hidden_size)).astype(np.float32)
    return weights


def lens_extra_args(system: System, cfg: BenchConfig) -> dict[str, Any] | None:
    rng = np.random.default_rng(7)
    if system.lens in (None, "plain"):
        return None
    if system.lens in ("capture-1", "capture-8", "capture-all"):
        return {CAPTURE_KEY: capture_layers(system.lens, cfg.num_layers, cfg.layer)}
    if system.lens == "steer-1":
        direction = rng.standard_normal((1, cfg.hidden_size)).astype(np.float32)
        direction /= np.linalg.norm(direction)
        vector = SteeringVector(activations=direction, layer_indices=[cfg.layer], scale=cfg.steer_scale)
        return {STEERING_KEY: [vector]}
    if system.lens == "probe":
        try:
            from lens_evals.request.spec import PROBE_KEY, LinearProbe
        except ImportError:
            raise SystemUnavailable(
                "not available: lens_evals.request.spec has no LinearProbe / PROBE_KEY on this branch (probe-on-worker not merged)"
            ) from None
        probes = [LinearProbe(name=PROBE_NAME, layer=cfg.layer, weights=probe_weights(cfg.hidden_size), bias=PROBE_BIAS)]
        probes += [
            LinearProbe(name=f"{PROBE_NAME}-{i}", layer=cfg.layer, weights=probe_weights(cfg.hidden_size, seed=11 + i), bias=0.0)
            for i in range(1, cfg.probe_count)
        ]
        return {PROBE_KEY: probes}
    raise ValueError(f"unknown lens feature {system.lens!r}")


def sampling_params(cfg: BenchConfig, max_tokens: int, extra: dict[str, Any] | None) -> Any:
    from vllm import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, detokenize=False, seed=0, extra_args=extra)


def _probe_scores(output: Any) -> Any:
    return ((getattr(output, "activations", None) or {}).get("probe_scores") or {}).get(PROBE_NAME)


def engine_prompts(prompts: list[list[int]]) -> list[TokensPrompt]:
    """Token-id prompts in the form ``LLM.generate`` takes."""
    return [{"prompt_token_ids": list(p)} for p in prompts]


def engine_options(system: System, cfg: BenchConfig) -> dict[str, Any]:
    """The LLM(...) arguments every vLLM system shares; graph mode taps ``cfg.layer``."""
    options = offline_engine_args(
        cfg.model_dir,
        dtype=cfg.dtype,
        max_model_len=cfg.max_model_len,
        enforce_eager=not system.cuda_graphs,
        # Off for every system: lens requests are salted (never cached), plain ones would be.
        enable_prefix_caching=False,
        skip_tokenizer_init=not has_tokenizer(cfg.model_dir),
        tensor_parallel_size=cfg.tensor_parallel_size,
        pipeline_parallel_size=cfg.pipeline_parallel_size,
    )
    if cfg.device == "cuda":
        options["gpu_memory_utilization"] = cfg.gpu_memory_utilization
    if system.graph_mode:
        tapped = capture_layers(system.lens, cfg.num_layers, cfg.layer) or [cfg.layer]
        options["additional_config"] = {"lens_evals": {"graph_layers": tapped}}
    return options


def start_engine(system: System, cfg: BenchConfig, extras: list[dict[str, Any] | None]) -> tuple[LLM, float, float]:
    """(LLM, start seconds, warm-up seconds): the engine, warmed with a few prompts per extra_args."""
    from vllm import LLM

    started = time.perf_counter()
    llm = LLM(**engine_options(system, cfg))
    start_seconds = time.perf_counter() - started
    first = engine_prompts(cfg.prompts[:4])
    warm = Stopwatch()
    with warm.timing():
        for extra in extras:
            llm.generate(first, sampling_params(cfg, cfg.warmup_tokens, extra), use_tqdm=False)
    return llm, start_seconds, warm.seconds


def run_vllm(system: System, cfg: BenchConfig) -> Measured:
    extra = lens_extra_args(system, cfg)  # before the engine starts: an unavailable feature costs nothing
    llm, start_seconds, warm_seconds = start_engine(system, cfg, [extra])
    prompts = engine_prompts(cfg.prompts)
    params = sampling_params(cfg, cfg.max_tokens, extra)
    runs: list[list[list[int]]] = []

    def generate() -> Any:
        outputs = llm.generate(prompts, params, use_tqdm=False)
        runs.append([list(o.outputs[0].token_ids) for o in outputs])
        return outputs

    best, times, outputs = best_of(cfg.repeats, generate)

    measured = Measured(start_seconds, warm_seconds, best, runs[-1], all_seconds=times)
    if len(runs) > 1:  # the engine's own run-to-run agreement: the noise floor of the token check
        same = sum(a == b for a, b in zip(runs[0], runs[-1]))
        measured.notes.append(f"runs 1 and {len(runs)} agree on {same}/{len(prompts)} outputs")
        measured.runs_agree = same
    if system.captures_layer:
        layers = capture_layers(system.lens, cfg.num_layers, cfg.layer)
        index = layers.index(cfg.layer)
        for i, output in enumerate(outputs[: cfg.check_prompts]):
            measured.samples[i] = output.activations["residual_stream"][index].float()
        if cfg.workload == "prefill":
            positions = cfg.prompt_tokens + len(cfg.prompts) * (cfg.max_tokens - 1)
            measured.notes.append(copy_note(positions, len(layers), cfg.hidden_size, torch_dtype(cfg.dtype), cfg.device))
    if system.lens == "probe":
        returned = sum(_probe_scores(o) is not None for o in outputs)
        measured.notes.append(f"probe scores on {returned}/{len(outputs)} outputs")
        for i, output in enumerate(outputs[: cfg.check_prompts]):
            if _probe_scores(output) is not None:
                measured.samples[i] = _probe_scores(output).float()
    if system.lens == "steer-1":
        measured.notes.append(f"steering scale {cfg.steer_scale}")
    if cfg.sync_debug:
        measured.notes.append(count_syncs(cfg, lambda: llm.generate(prompts, params, use_tqdm=False)))
    return measured


def count_syncs(cfg: BenchConfig, run: Callable[[], object]) -> str:
    """One more (untimed) run under torch.cuda.set_sync_debug_mode("warn"): how many calls made
    the host wait for the GPU, by the Python line that made them."""
    if cfg.device != "cuda" or cfg.engine != "inprocess":
        return "sync debug needs --gpu --engine inprocess (the workers must be in this process)"
    import torch

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            run()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    sites = Counter(f"{Path(w.filename).name}:{w.lineno}" for w in caught if "synchroniz" in str(w.message))
    top = ", ".join(f"{site} x{n}" for site, n in sites.most_common(6))
    return f"{sum(sites.values())} synchronizing CUDA calls in one run ({top})"
