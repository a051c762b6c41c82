"""vLLM internals for calling our worker methods: ``collective_rpc`` (offline and async, every
data-parallel engine), the methods added to vLLM's worker and offline ``LLM`` classes, and the
clear error for a worker whose process lacks the plugin."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["WorkerWithoutPlugin", "add_offline_methods", "add_worker_methods", "async_collective_rpc", "offline_collective_rpc"]


class WorkerWithoutPlugin(RuntimeError):
    """A worker of the engine lacks our methods: the plugin did not load in its process."""


def _worker_without_plugin(method: str, error: BaseException) -> WorkerWithoutPlugin | None:
    """vLLM reports a worker method that does not exist as a bare ``'...Worker' object has no
    attribute '<method>'`` (multiprocess executor, Ray on vLLM 0.26) or ``Method '<method>' is not
    implemented`` (``run_method``): the worker's process did not load our plugin, typically a Ray
    node where lens-evals is not installed. Say so, and what to do."""
    said = str(error)
    if f"has no attribute '{method}'" not in said and f"Method '{method}' is not implemented" not in said:
        return None
    return WorkerWithoutPlugin(
        f"lens_evals: a vLLM worker of this engine has no {method!r}: the lens-evals plugin did not load in "
        "its process. Install lens-evals (the same version as here) in the Python environment of every node "
        "that runs a worker (on a Ray cluster: each node), and check that its `vllm.general_plugins` entry "
        "point is not filtered out by VLLM_PLUGINS and that LENS_EVALS_DISABLE / VLLM_LENS_DISABLE are not set "
        f"there. Plain requests are not affected. (vLLM said: {said[:300]})"
    )


@contextmanager
def _naming_a_missing_plugin(method: str) -> Iterator[None]:
    """Around a call of ``method`` on the workers: vLLM's error for a worker without it becomes
    :class:`WorkerWithoutPlugin`; any other error passes as it is."""
    try:
        yield
    except Exception as exc:
        if (missing := _worker_without_plugin(method, exc)) is not None:
            raise missing from exc
        raise


async def async_collective_rpc(engine: Any, method: str, args: tuple[Any, ...]) -> list[Any]:
    """Call a worker method installed by :func:`add_worker_methods` on every worker. By name:
    vLLM refuses to send functions between processes unless insecure serialisation is on.

    With data parallelism, ``AsyncLLM.collective_rpc`` runs the method on every engine's
    workers but returns only the first engine's replies; a request served by another engine
    would lose its results. Ask each engine this frontend talks to and join the replies."""
    core = engine.engine_core
    engines = list(getattr(core, "core_engines", None) or ())
    with _naming_a_missing_plugin(method):
        if len(engines) <= 1 or not hasattr(core, "_call_utility_async"):
            replies: list[Any] = await engine.collective_rpc(method, args=args)
            return replies
        per_engine = await asyncio.gather(
            *(core._call_utility_async("collective_rpc", method, None, args, None, engine=target) for target in engines)
        )
    return [reply for replies in per_engine for reply in replies]


def offline_collective_rpc(llm: Any, method: str, args: tuple[Any, ...]) -> list[Any]:
    with _naming_a_missing_plugin(method):
        replies: list[Any] = llm.collective_rpc(method, args=args)
    return replies


def add_worker_methods(methods: dict[str, Callable[..., Any]]) -> None:
    """Make ``methods`` callable by name through collective_rpc (``fn(worker, *args)``)."""
    from vllm.v1.worker.worker_base import WorkerBase

    for name, fn in methods.items():
        if getattr(WorkerBase, name, None) is not fn:
            setattr(WorkerBase, name, fn)


def add_offline_methods(methods: dict[str, Callable[..., Any]]) -> None:
    """Add methods to vLLM's offline ``LLM`` class (vllm-lens's names: ``llm.register_hooks``...)."""
    from vllm.entrypoints.llm import LLM

    for name, fn in methods.items():
        if getattr(LLM, name, None) is not fn:
            setattr(LLM, name, fn)
