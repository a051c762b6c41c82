"""Hook references: how a hook travels from the frontend to the worker (``HookWire.ref``).

``registered:NAME`` (looked up in the worker's registry), ``import:MODULE:QUALNAME`` (a
module-level callable the user passed offline) and ``local:ID`` (any other callable the user
passed offline; found only when the worker shares the user's process: the callable waits in this
module until the request ends, ``forget_local``). The frontend makes them (``hook_reference``),
the worker resolves them (``resolve``)."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable
from typing import Any

from lens_evals.request.hooks import Hook, import_target, registered_hook

logger = logging.getLogger("lens_evals")
# Callables of in-process offline requests that cannot be imported by name (lambdas, closures).
_LOCAL_CALLABLES: dict[str, Callable[..., Any]] = {}


def hook_reference(hook: Hook) -> tuple[str, str | None]:
    """(reference for the worker, local id to forget when the request ends or None)."""
    fn = hook.fn
    if isinstance(fn, str):  # hook.registered
        return f"registered:{fn}", None
    module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
    if module and qualname and "<" not in qualname:
        try:
            if import_target(f"{module}:{qualname}") is fn:
                return f"import:{module}:{qualname}", None
        except (ImportError, AttributeError, ValueError):
            logger.debug("lens_evals: hook %s is not importable by name; in-process only", qualname)
    local_id = uuid.uuid4().hex
    _LOCAL_CALLABLES[local_id] = fn
    return f"local:{local_id}", local_id


def forget_local(local_ids: list[str]) -> None:
    for local_id in local_ids:
        _LOCAL_CALLABLES.pop(local_id, None)


def resolve(ref: str) -> Callable[..., Any]:
    kind, _, target = ref.partition(":")
    if kind == "registered":
        return registered_hook(target)
    if kind == "import":
        return import_target(target)
    if kind == "local":
        fn = _LOCAL_CALLABLES.get(target)
        if fn is None:
            raise ValueError(
                "the hook is a Python callable that cannot be imported by name (a lambda, closure or "
                "method) and the worker runs in another process: define it as a module-level function, "
                "or run the engine in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0)"
            )
        return fn
    raise ValueError(f"unknown hook reference {ref!r}")
