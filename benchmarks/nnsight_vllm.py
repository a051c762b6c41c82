"""nnsight 0.8's vLLM backend (``nnsight.modeling.vllm.VLLM``), with a small adapter for vLLM's CPU
build: nnsight names its GPU worker (a subclass of vLLM's CUDA ``Worker``) as ``worker_cls`` and
swaps the runner's class for its ``NNsightGPUModelRunner``. On CPU the adapter names a subclass of
vLLM's ``CPUWorker`` instead and swaps in a class that puts nnsight's runner over vLLM's
``CPUModelRunner`` (both are subclasses of ``GPUModelRunner``; nnsight's only calls ``super()``)."""

from __future__ import annotations

import time
from typing import Any, cast

import torch

from benchmarks.config import BenchConfig
from benchmarks.measure import Measured, Stopwatch, SystemUnavailable, best_of, package_version
from benchmarks.systems import System

CPU_WORKER = f"{__name__}.NNsightCPUWorker"


def _cpu_worker_class() -> type:
    from nnsight.modeling.vllm.model_runners.GPUModelRunner import NNsightGPUModelRunner
    from nnsight.modeling.vllm.workers.GPUWorker import NNsightGPUWorker
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner
    from vllm.v1.worker.cpu_worker import CPUWorker

    runner_class = type("NNsightCPUModelRunner", (NNsightGPUModelRunner, CPUModelRunner), {})

    class Worker(CPUWorker):
        def init_device(self) -> None:
            # vLLM's CPUWorker.init_device is unannotated; untyped_calls_exclude misses calls through super()
            super().init_device()  # type: ignore[no-untyped-call]
            if type(self.model_runner) is not CPUModelRunner:
                raise NotImplementedError(f"expected vLLM's CPUModelRunner, got {type(self.model_runner).__name__}")
            self.model_runner.__class__ = runner_class

    # nnsight's RPC entry points (collect_nnsight, nnsight_register, ...) as on its GPU worker.
    for name, value in vars(NNsightGPUWorker).items():
        if callable(value) and name not in ("init_device",) and not name.startswith("__"):
            setattr(Worker, name, value)
    Worker.__name__ = Worker.__qualname__ = "NNsightCPUWorker"
    return Worker


def __getattr__(name: str) -> Any:  # vLLM imports worker_cls by its dotted name
    if name == "NNsightCPUWorker":
        worker = _cpu_worker_class()
        globals()[name] = worker
        return worker
    raise AttributeError(name)


def _model_class(device: str) -> type:
    try:
        from nnsight.modeling.vllm import VLLM
    except ImportError as exc:
        raise SystemUnavailable(f"nnsight's vLLM backend does not import: {exc}") from None
    if device == "cuda":
        return cast(type, VLLM)  # nnsight is untyped: its class reads as Any

    def _load_meta(self: Any, repo_id: str, **kwargs: Any) -> Any:
        # vLLM's loader empties the accelerator cache after building the (meta) tree; a host
        # without an accelerator raises there.
        from unittest import mock

        with mock.patch("torch.accelerator.empty_cache", lambda: None):
            return VLLM._load_meta(self, repo_id, **kwargs)

    return type("NNsightCPUVLLM", (VLLM,), {"_WORKER_CLS": CPU_WORKER, "_load_meta": _load_meta})


def run_nnsight_vllm(system: System, cfg: BenchConfig) -> Measured:
    model_class = _model_class(cfg.device)
    import nnsight

    started = time.perf_counter()
    model = model_class(
        cfg.model_dir,
        dispatch=True,
        dtype=cfg.dtype,
        max_model_len=cfg.max_model_len,
        seed=0,
        enable_prefix_caching=False,
        **({"gpu_memory_utilization": cfg.gpu_memory_utilization} if cfg.device == "cuda" else {}),
    )
    start_seconds = time.perf_counter() - started
    layer = model.model.layers[cfg.layer]

    def generate(prompts: list[list[int]], new_tokens: int) -> tuple[list[list[int]], list[list[torch.Tensor]]]:
        # One invoke per request; a name saved in every invoke comes back as a list in
        # submission order (one request: the value itself).
        with model.trace(temperature=0.0, max_tokens=new_tokens, ignore_eos=True) as tracer:
            for prompt in prompts:
                with tracer.invoke(list(prompt)):
                    steps = nnsight.save(list())
                    for _ in tracer.iter[:new_tokens]:
                        hidden, residual = layer.output  # vLLM's fused-residual layers: stream = sum
                        steps.append(hidden + residual)
                    result = tracer.result.save()
        streams, results = (steps, result) if len(prompts) > 1 else ([steps], [result])
        return [list(r.outputs[0].token_ids) for r in results], streams

    warm = Stopwatch()
    with warm.timing():
        generate(cfg.prompts[: min(2, len(cfg.prompts))], cfg.warmup_tokens)
    best, times, (tokens, streams) = best_of(cfg.repeats, lambda: generate(cfg.prompts, cfg.max_tokens))
    samples = {i: torch.cat([s.reshape(-1, s.shape[-1]) for s in streams[i]]).float() for i in range(cfg.check_prompts)}
    measured = Measured(start_seconds, warm.seconds, best, tokens, samples, all_seconds=times)
    measured.notes.append(
        f"nnsight {package_version('nnsight')}" + ("; CPU adapter (benchmarks.nnsight_vllm)" if cfg.device != "cuda" else "")
    )
    return measured
