"""Shared fixtures. Engines run in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0) for speed; the
multiprocess path has its own tests. An engine that cannot start FAILS the test, never skips."""

from __future__ import annotations

import gc
import os

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# the stream-contract self-check costs every engine 1-3 s here: on where a test asks for it
# (tests/engine/test_self_check.py, the architecture matrix, the SmolLM2 capture test)
os.environ.setdefault("LENS_EVALS_SELF_CHECK", "0")

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from lens_evals.models.registry import model_path
from tests.device import gpu_share, on_gpu


@pytest.fixture(scope="session")
def tiny_path() -> Path:
    return model_path("tiny-llama")


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    return model_path("smollm2-135m-instruct")


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


def share_the_device_in_package_engines() -> None:
    """On a GPU, the engines the package opens in the test process (probe training, science,
    capture, oracle building: ``lens_evals.engine.frontend.offline``) take :func:`gpu_share` too, as the
    tests' own engines do: a test that opens one while another engine holds the device would
    otherwise ask for vLLM's default 0.92 of it and fail to start."""
    from lens_evals.engine.frontend import offline as offline_engine

    offline_engine.DEFAULTS.update(gpu_share())


share_the_device_in_package_engines()


def engine_options(**kwargs: Any) -> dict[str, Any]:
    """The tests' LLM options: the package's engine defaults (``lens_evals.engine.frontend.offline``: short
    context, fixed seed, and on a GPU :func:`gpu_share`, set above) and fp32."""
    from lens_evals.engine.frontend.offline import engine_defaults

    return engine_defaults(**{"dtype": "float32", **kwargs})


def release_gpu_memory() -> None:
    """Hand the device memory of engines already shut down back before the next one starts (their
    objects collected, torch's cache emptied). No waiting: with :func:`gpu_share` vLLM does not
    profile memory at start-up, so memory still being freed elsewhere cannot fail it. No-op on CPU."""
    if not on_gpu():
        return
    import torch

    gc.collect()
    torch.cuda.empty_cache()


@contextmanager
def make_llm(path: Path, **kwargs: Any) -> Iterator[Any]:
    from vllm import LLM

    release_gpu_memory()
    llm = LLM(str(path), **engine_options(**{"enable_prefix_caching": True, **kwargs}))
    try:
        yield llm
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()


@pytest.fixture(scope="module")
def llm(tiny_path: Path) -> Iterator[Any]:
    """The tiny Llama on the tests' engine options, one engine per test module (a module that
    needs other options defines its own ``llm``)."""
    with make_llm(tiny_path) as engine:
        yield engine


def greedy(max_tokens: int = 6, **extra_args: Any) -> Any:
    from vllm import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, extra_args=extra_args or None)


def capture(output: Any) -> Any:
    activations = getattr(output, "activations", None)
    assert activations is not None, "no activations attached to the output"
    return activations["residual_stream"]


@contextmanager
def lens_server(path: Path, env: dict[str, str] | None = None, server_args: dict[str, Any] | None = None) -> Iterator[Any]:
    """A LensServer for ``path`` served as "test", with the tests' engine options (plus ``server_args``)."""
    from lens_evals.inspect_kit.provider.server import LensServer

    release_gpu_memory()
    server = LensServer(str(path), served_name="test", server_args=engine_options(**(server_args or {})), env=env).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(autouse=True, scope="session")
def servers_share_the_gpu() -> Iterator[None]:
    """On a GPU, every vLLM server a test starts (itself, or through the Inspect provider) takes
    :func:`gpu_share` unless the test sets its own, and starts after the memory of engines already
    shut down is released. vLLM's default (0.92 of the device) leaves no room for the test
    process's own engine (2026-12-03: four provider tests failed so). Nothing changes on CPU."""
    if not on_gpu():
        yield
        return
    from lens_evals.inspect_kit.provider.server import LensServer

    init, start = LensServer.__init__, LensServer.start

    def sharing_init(self: Any, model: str, served_name: str, server_args: Any = None, env: Any = None) -> None:
        init(self, model, served_name, {**gpu_share(), **(server_args or {})}, env)

    def released_start(self: Any, *args: Any, **kwargs: Any) -> Any:
        release_gpu_memory()
        return start(self, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(LensServer, "__init__", sharing_init)
        patch.setattr(LensServer, "start", released_start)
        yield


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """With ``LENS_EVALS_TEST_FAILURES_AT_ONCE=1`` (``scripts/gpu_suite.sh``) a failure's traceback
    is written as it happens, not only in pytest's summary: a device call cut at its time limit
    still says why a test failed (2026-12-04: a part cut at 560 s named a failed test, no reason)."""
    if report.failed and os.environ.get("LENS_EVALS_TEST_FAILURES_AT_ONCE") == "1":
        import sys

        sys.__stderr__.write(f"\n--- {report.nodeid} failed ({report.when}) ---\n{report.longreprtext[-6000:]}\n")
        sys.__stderr__.flush()
