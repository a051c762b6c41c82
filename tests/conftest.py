"""Shared fixtures. Engines run in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0) for speed; the
multiprocess path has its own tests. An engine that cannot start FAILS the test, never skips."""

from __future__ import annotations

import gc
import os

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import pytest

from lens_evals.models import model_path


@pytest.fixture(scope="session")
def tiny_path() -> Path:
    return model_path("tiny-llama")


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    return model_path("smollm2-135m-instruct")


def on_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


def engine_tolerance() -> float:
    """Absolute/relative tolerance between two fp32 runs that differ in batch shape or against
    HF on CPU. CPU: 1e-4 (measured below 1e-5). GPU: vLLM runs fp32 matmuls in TF32, and
    different batch shapes pick different kernels: measured up to 7.6e-3 on the tiny model
    (values of order 1), so 2e-2 there. Tokens are always compared exactly."""
    return 2e-2 if on_gpu() else 1e-4


# Prompts for the tiny Llama (its tokenizer knows these words).
TINY_PROMPTS = [
    "the cat reads a book.",
    "a model finds the truth.",
    "our team builds many layers and the river sees the city.",
    "1 2 3 4 5 6 7 8",
    "my friend",
    "the engine steers a vector. the probe captures small data.",
    "a student likes the answer",
    "the truth",
]

# On a GPU machine several engines (and the server) share one device.
GPU_MEMORY_FRACTION = 0.2


@contextmanager
def make_llm(path: Path, **kwargs: Any) -> Iterator[Any]:
    from vllm import LLM

    options = {"dtype": "float32", "max_model_len": 1024, "seed": 0, "enable_prefix_caching": True}
    if on_gpu():
        options["gpu_memory_utilization"] = GPU_MEMORY_FRACTION
    options.update(kwargs)
    llm = LLM(str(path), **options)
    try:
        yield llm
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()


def greedy(max_tokens: int = 6, **extra_args: Any) -> Any:
    from vllm import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, extra_args=extra_args or None)


def capture(output: Any) -> Any:
    activations = getattr(output, "activations", None)
    assert activations is not None, "no activations attached to the output"
    return activations["residual_stream"]


@contextmanager
def lens_server(path: Path, env: dict[str, str] | None = None) -> Iterator[Any]:
    """A LensServer for ``path`` served as "test", with the tests' engine options."""
    from lens_evals.evals.server_process import LensServer

    args: dict[str, Any] = {"dtype": "float32", "max_model_len": 1024, "seed": 0}
    if on_gpu():
        args["gpu_memory_utilization"] = GPU_MEMORY_FRACTION
    server = LensServer(str(path), served_name="test", server_args=args, env=env).start()
    try:
        yield server
    finally:
        server.stop()
