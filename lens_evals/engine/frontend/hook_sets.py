"""Persistent hook sets: register hooks once, run many requests that opt in with
``"use_hook_set": ID``, collect every request's ``saved`` in one bulk call, clear.

Only requests that name the set run its hooks, so on a shared server one researcher's set
neither sees nor changes other users' requests; the id (a random UUID) is the capability to use,
collect and clear it. Results wait in the frontend process, encoded (JSON-safe), bounded by
``LENS_EVALS_MAX_HOOK_RESULTS_MIB`` over all sets: a request whose result does not fit fails
with a message saying to collect or clear. The sets themselves are bounded per engine: at most
``LENS_EVALS_MAX_HOOK_SETS`` live sets (default 64) whose hooks' JSON form (args included) totals
at most ``LENS_EVALS_MAX_HOOK_SET_MIB`` (default 256); a set over either bound is refused
(:class:`HookSetLimit`, HTTP 429) until one is cleared.

On a server each set belongs to the API key that made it (no key configured: one shared owner):
another key's requests, collects and deletes find no such set (404 / 400), each key holds at most
``LENS_EVALS_MAX_HOOK_SETS_PER_KEY`` of the live sets, and a set neither used nor collected for
``LENS_EVALS_HOOK_SET_IDLE_S`` is freed, its worker half too, by the next lens call
(:func:`free_idle_async`). Offline sets have no owner and never expire.

Offline: :func:`register_hook_set` (returns a :class:`HookSet` with ``extra_args``, ``collect()``
and ``clear()``). Server: the HTTP endpoints in ``lens_evals.engine.frontend.http_middleware``.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from lens_evals.engine import compat
from lens_evals.engine.frontend.hook_set_store import MAX_HOOKS_PER_SET, SHARED_OWNER, HookSetLimit, HookSetRecord
from lens_evals.engine.frontend.hooks import encode_hooks, forget_local, union_of
from lens_evals.engine.frontend.state import frontend_state
from lens_evals.engine.transport.protocol import CLEAR_SET_METHOD, REGISTER_SET_METHOD
from lens_evals.request.hooks import Hook, check_hook_args
from lens_evals.request.spec import HOOK_SET_KEY, LensRequest
from lens_evals.wire import formats as wire


def prepare(processor: Any, hooks: Sequence[Any]) -> tuple[str, HookSetRecord]:
    """Validate hooks (objects, or registered hooks' JSON) against the model; ValueError if bad."""
    if not isinstance(hooks, (list, tuple)) or not hooks:
        raise ValueError("a hook set needs a non-empty list of hooks")
    if len(hooks) > MAX_HOOKS_PER_SET:
        raise ValueError(f"a hook set holds at most {MAX_HOOKS_PER_SET} hooks")
    parsed = [Hook.from_wire(hook) for hook in hooks]
    shape = compat.config.model_shape(processor.vllm_config)
    for hook in parsed:  # a set serves requests not known yet: positions bounded by the context length
        check_hook_args(hook, shape.hidden_size, shape.max_model_len, shape.vocab_size)
    LensRequest(hooks=parsed).check_model(shape.num_layers, shape.hidden_size, 1, 2**62)
    encoded, local_ids = encode_hooks(parsed)
    return uuid.uuid4().hex, HookSetRecord(encoded, local_ids, hook_chars=len(json.dumps(encoded)))


def _check_workers(replies: list[Any]) -> None:
    errors = [reply for reply in replies if isinstance(reply, str)]
    if errors:
        raise ValueError(errors[0])


def union_view(collected: dict[str, Any]) -> dict[str, Any]:
    """Our form of collected results: each request's hooks' saved keys in one "saved" dict."""
    results = [{"request_id": r["request_id"], "saved": union_of(r["hook_results"])} for r in collected["results"]]
    return {**collected, "results": results}


def _decode_results(collected: dict[str, Any]) -> dict[str, Any]:
    results = []
    for result in collected["results"]:
        per_hook = wire.decode_tree_native(result["hook_results"])
        results.append({"request_id": result["request_id"], "saved": union_of(per_hook), "hook_results": per_hook})
    return {**collected, "results": results}


# --------------------------------------------------------------------------- offline
@dataclass
class HookSet:
    """A registered set on an offline ``LLM``: pass ``extra_args`` in the requests that use it."""

    id: str
    llm: Any

    @property
    def extra_args(self) -> dict[str, str]:
        return {HOOK_SET_KEY: self.id}

    def collect(self) -> dict[str, Any]:
        """{"id", "results": [{"request_id", "saved": {...}, "hook_results": {index: {...}}}],
        "refused": n} (tensors); empties the set."""
        return _decode_results(frontend_state(compat.frontend.input_processor(self.llm.llm_engine)).hook_sets.collect(self.id))

    def clear(self) -> int:
        """Unregister the set; returns how many uncollected results were dropped."""
        record = frontend_state(compat.frontend.input_processor(self.llm.llm_engine)).hook_sets.remove(self.id)
        compat.rpc.offline_collective_rpc(self.llm, CLEAR_SET_METHOD, (self.id,))
        return len(record.results)


def register_hook_set(llm: Any, hooks: Sequence[Any]) -> HookSet:
    """Register hooks once on an offline engine (callables or registered hooks)."""
    processor = compat.frontend.input_processor(llm.llm_engine)
    set_id, record = prepare(processor, hooks)
    store = frontend_state(processor).hook_sets
    try:
        store.admit(record)
    except HookSetLimit:
        forget_local(record.local_ids)
        raise
    try:
        _check_workers(compat.rpc.offline_collective_rpc(llm, REGISTER_SET_METHOD, (set_id, record.hooks)))
    except ValueError:
        forget_local(record.local_ids)
        compat.rpc.offline_collective_rpc(llm, CLEAR_SET_METHOD, (set_id,))
        raise
    finally:
        store.release(record)
    store.add(set_id, record)
    return HookSet(set_id, llm)


# --------------------------------------------------------------------------- server (AsyncLLM)
async def register_async(engine: Any, hooks: Sequence[Any], owner: str = SHARED_OWNER) -> dict[str, Any]:
    processor = compat.frontend.input_processor(engine)
    set_id, record = prepare(processor, hooks)
    record.owner = owner
    store = frontend_state(processor).hook_sets
    try:
        store.admit(record)  # before the await: concurrent creates cannot pass the bounds together
    except HookSetLimit:
        forget_local(record.local_ids)
        raise
    try:
        _check_workers(await compat.rpc.async_collective_rpc(engine, REGISTER_SET_METHOD, (set_id, record.hooks)))
    except ValueError:
        await compat.rpc.async_collective_rpc(engine, CLEAR_SET_METHOD, (set_id,))
        raise
    finally:
        store.release(record)
    store.add(set_id, record)  # no await since release: atomic on the event loop
    return {"id": set_id, "hooks": [hook["name"] for hook in record.hooks]}


def collect_async(engine: Any, set_id: str, owner: str) -> dict[str, Any]:
    """Raw (per-hook) results; ``union_view`` gives our HTTP form."""
    return frontend_state(compat.frontend.input_processor(engine)).hook_sets.collect(set_id, owner)


async def clear_async(engine: Any, set_id: str, owner: str) -> dict[str, Any]:
    record = frontend_state(compat.frontend.input_processor(engine)).hook_sets.remove(set_id, owner)
    await compat.rpc.async_collective_rpc(engine, CLEAR_SET_METHOD, (set_id,))
    return {"id": set_id, "dropped_results": len(record.results)}


async def free_idle_async(engine: Any) -> list[str]:
    """Free the sets idle past LENS_EVALS_HOOK_SET_IDLE_S, the workers' halves too (every lens
    route calls this first, so an expired set never holds a slot a create needs); their ids."""
    expired = frontend_state(compat.frontend.input_processor(engine)).hook_sets.expire()
    for set_id in expired:
        await compat.rpc.async_collective_rpc(engine, CLEAR_SET_METHOD, (set_id,))
    return expired
