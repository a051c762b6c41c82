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
import time
import uuid
from collections.abc import Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

from lens_evals import settings
from lens_evals.engine import compat
from lens_evals.engine.frontend.hooks import encode_hooks, forget_local, union_of
from lens_evals.engine.transport.protocol import CLEAR_SET_METHOD, REGISTER_SET_METHOD, HookWire
from lens_evals.request.hooks import Hook, check_hook_args
from lens_evals.request.spec import HOOK_SET_KEY, LensRequest
from lens_evals.wire import formats as wire

STORE_ATTR = "_lens_evals_hook_sets"
MAX_HOOKS_PER_SET = 256
FREE_HINT = "free one with DELETE /lens/hook_sets/{id} (offline: HookSet.clear())"
# The owner of the HTTP request being served (set by the lens middleware for every request):
# its API key's digest, SHARED_OWNER on a server without keys, NOBODY for a request carrying no
# valid key. None outside a server request: only offline sets (owner None) are found then.
CALLER: ContextVar[str | None] = ContextVar("lens_evals_hook_set_caller", default=None)
SHARED_OWNER = ""
NOBODY = "-"


class UnknownHookSet(KeyError):
    pass


class HookSetLimit(ValueError):
    """A new hook set would pass LENS_EVALS_MAX_HOOK_SETS or LENS_EVALS_MAX_HOOK_SET_MIB."""


@dataclass
class _Record:
    hooks: list[HookWire]  # the worker's form
    local_ids: list[str]
    hook_chars: int = 0  # the JSON size of ``hooks``, counted against LENS_EVALS_MAX_HOOK_SET_MIB
    results: list[dict[str, Any]] = field(default_factory=list)
    chars: int = 0
    refused: int = 0
    owner: str | None = None  # the API key's digest that made it (SHARED_OWNER: no keys; None: offline)
    last_used: float = field(default_factory=time.monotonic)  # made, used by a request, or collected


class HookSetStore:
    """The frontend's sets and their uncollected results (one store per engine)."""

    def __init__(self) -> None:
        self.sets: dict[str, _Record] = {}
        self.held_chars = 0
        self.hook_chars = 0  # over the registered sets
        self.pending: list[_Record] = []  # admitted, waiting for the workers
        # offline only (LLM.register_hooks): the set every request of this engine uses; the LLM
        # object is its holder's alone, so this touches nobody else's requests
        self.auto_set: str | None = None

    @property
    def max_sets(self) -> int:
        return settings.MAX_HOOK_SETS.get()

    @property
    def max_hook_chars(self) -> int:
        return settings.MAX_HOOK_SET_MIB.in_bytes()

    def admit(self, record: _Record) -> None:
        """Count a new set against both bounds (HookSetLimit if it does not fit) until
        :meth:`add` or :meth:`release`; sets still being registered count too."""
        live = len(self.sets) + len(self.pending)
        if live >= self.max_sets:
            raise HookSetLimit(
                f"too many hook sets: {live} live, the bound is {self.max_sets} (LENS_EVALS_MAX_HOOK_SETS); {FREE_HINT} and try again"
            )
        if record.owner:  # a keyed owner; without keys (SHARED_OWNER) only the bound above applies
            mine = sum(other.owner == record.owner for other in [*self.sets.values(), *self.pending])
            bound = settings.MAX_HOOK_SETS_PER_KEY.get()
            if mine >= bound:
                raise HookSetLimit(
                    f"too many hook sets for this API key: {mine} live, the bound is {bound} per key "
                    f"(LENS_EVALS_MAX_HOOK_SETS_PER_KEY); {FREE_HINT} and try again"
                )
        held = self.hook_chars + sum(pending.hook_chars for pending in self.pending)
        if held + record.hook_chars > self.max_hook_chars:
            raise HookSetLimit(
                f"hook sets' hooks would hold {(held + record.hook_chars) / 2**20:.1f} MiB, over the bound of "
                f"{self.max_hook_chars / 2**20:.1f} MiB (LENS_EVALS_MAX_HOOK_SET_MIB; {held / 2**20:.1f} MiB held by "
                f"{live} sets, this one {record.hook_chars / 2**20:.1f} MiB): {FREE_HINT} and try again"
            )
        self.pending.append(record)

    def release(self, record: _Record) -> None:
        self.pending = [pending for pending in self.pending if pending is not record]

    def add(self, set_id: str, record: _Record) -> None:
        self.release(record)
        self.sets[set_id] = record
        self.hook_chars += record.hook_chars

    @property
    def max_chars(self) -> int:
        return settings.MAX_HOOK_RESULTS_MIB.in_bytes()

    def record(self, set_id: str, caller: str | None = None) -> _Record:
        """The set, for ``caller`` (a server request's owner, :data:`CALLER`); counts as a use.
        A set another owner made, or one idle past LENS_EVALS_HOOK_SET_IDLE_S, is not found
        (the same answer as an unknown id: its holder's id tells nobody else anything)."""
        record = self.sets.get(set_id)
        now = time.monotonic()
        if record is None or (record.owner is not None and record.owner != caller) or self._idle(record, now):
            raise UnknownHookSet(f"hook set {set_id!r} is not registered (cleared, expired, or made with another API key?)")
        record.last_used = now
        return record

    @staticmethod
    def _idle(record: _Record, now: float) -> bool:
        idle_s = settings.HOOK_SET_IDLE_S.get()
        return record.owner is not None and idle_s > 0 and now - record.last_used > idle_s

    def expire(self) -> list[str]:
        """Drop the server sets idle past LENS_EVALS_HOOK_SET_IDLE_S; their ids (the workers'
        halves are the caller's to clear)."""
        now = time.monotonic()
        expired = [set_id for set_id, record in self.sets.items() if self._idle(record, now)]
        for set_id in expired:
            self._drop(set_id)
        return expired

    def add_result(self, set_id: str, request_id: str, saved: dict[str, Any]) -> str | None:
        """Keep one request's result (hook index -> saved, encoded); the error text when the
        bound would be passed."""
        record = self.sets.get(set_id)
        if record is None:
            return f"hook set {set_id!r} was cleared while the request ran; its result is dropped"
        chars, bound = len(json.dumps(saved)), self.max_chars
        if self.held_chars + chars > bound:
            record.refused += 1
            return (
                f"hook set results would pass the bound of {bound / 2**20:.1f} MiB "
                f"(LENS_EVALS_MAX_HOOK_RESULTS_MIB; {self.held_chars / 2**20:.1f} MiB held): collect or clear "
                "hook sets to make room; this request's result was not kept"
            )
        record.results.append({"request_id": request_id, "hook_results": saved})
        record.last_used = time.monotonic()
        record.chars += chars
        self.held_chars += chars
        return None

    def peek(self, set_id: str, caller: str | None = None) -> dict[str, Any]:
        """Like :meth:`collect` but the results stay (vllm-lens's non-draining collect)."""
        record = self.record(set_id, caller)
        return {"id": set_id, "results": list(record.results), "refused": record.refused}

    def collect(self, set_id: str, caller: str | None = None) -> dict[str, Any]:
        """Every result held for the set ({"request_id", "hook_results"}: hook index -> saved,
        encoded), and how many were refused; empties the set."""
        record = self.record(set_id, caller)
        results, refused = record.results, record.refused
        self.held_chars -= record.chars
        record.results, record.chars, record.refused = [], 0, 0
        return {"id": set_id, "results": results, "refused": refused}

    def remove(self, set_id: str, caller: str | None = None) -> _Record:
        self.record(set_id, caller)
        return self._drop(set_id)

    def _drop(self, set_id: str) -> _Record:
        record = self.sets.pop(set_id)
        if self.auto_set == set_id:
            self.auto_set = None
        self.held_chars -= record.chars
        self.hook_chars -= record.hook_chars
        forget_local(record.local_ids)
        return record


def store_of(processor: Any) -> HookSetStore:
    store = getattr(processor, STORE_ATTR, None)
    if store is None:
        store = HookSetStore()
        setattr(processor, STORE_ATTR, store)
    return store


def prepare(processor: Any, hooks: Sequence[Any]) -> tuple[str, _Record]:
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
    return uuid.uuid4().hex, _Record(encoded, local_ids, hook_chars=len(json.dumps(encoded)))


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
        return _decode_results(store_of(compat.frontend.input_processor(self.llm.llm_engine)).collect(self.id))

    def clear(self) -> int:
        """Unregister the set; returns how many uncollected results were dropped."""
        record = store_of(compat.frontend.input_processor(self.llm.llm_engine)).remove(self.id)
        compat.rpc.offline_collective_rpc(self.llm, CLEAR_SET_METHOD, (self.id,))
        return len(record.results)


def register_hook_set(llm: Any, hooks: Sequence[Any]) -> HookSet:
    """Register hooks once on an offline engine (callables or registered hooks)."""
    processor = compat.frontend.input_processor(llm.llm_engine)
    set_id, record = prepare(processor, hooks)
    store = store_of(processor)
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
    store = store_of(processor)
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
    return store_of(compat.frontend.input_processor(engine)).collect(set_id, owner)


async def clear_async(engine: Any, set_id: str, owner: str) -> dict[str, Any]:
    record = store_of(compat.frontend.input_processor(engine)).remove(set_id, owner)
    await compat.rpc.async_collective_rpc(engine, CLEAR_SET_METHOD, (set_id,))
    return {"id": set_id, "dropped_results": len(record.results)}


async def free_idle_async(engine: Any) -> list[str]:
    """Free the sets idle past LENS_EVALS_HOOK_SET_IDLE_S, the workers' halves too (every lens
    route calls this first, so an expired set never holds a slot a create needs); their ids."""
    expired = store_of(compat.frontend.input_processor(engine)).expire()
    for set_id in expired:
        await compat.rpc.async_collective_rpc(engine, CLEAR_SET_METHOD, (set_id,))
    return expired
