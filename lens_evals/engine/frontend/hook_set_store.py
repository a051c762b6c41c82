"""The frontend's hook sets and their uncollected results, bounded per engine (one
``HookSetStore`` per engine, in the frontend state); ``hook_sets`` registers, collects and clears
through it. Who may use a set: :data:`CALLER`, the owner of the server request being served."""

from __future__ import annotations

import json
import time
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

from lens_evals import settings
from lens_evals.engine.frontend.hooks import forget_local
from lens_evals.engine.transport.protocol import HookWire

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
class HookSetRecord:
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
        self.sets: dict[str, HookSetRecord] = {}
        self.held_chars = 0
        self.hook_chars = 0  # over the registered sets
        self.pending: list[HookSetRecord] = []  # admitted, waiting for the workers
        # offline only (LLM.register_hooks): the set every request of this engine uses; the LLM
        # object is its holder's alone, so this touches nobody else's requests
        self.auto_set: str | None = None

    @property
    def max_sets(self) -> int:
        return settings.MAX_HOOK_SETS.get()

    @property
    def max_hook_chars(self) -> int:
        return settings.MAX_HOOK_SET_MIB.in_bytes()

    def admit(self, record: HookSetRecord) -> None:
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

    def release(self, record: HookSetRecord) -> None:
        self.pending = [pending for pending in self.pending if pending is not record]

    def add(self, set_id: str, record: HookSetRecord) -> None:
        self.release(record)
        self.sets[set_id] = record
        self.hook_chars += record.hook_chars

    @property
    def max_chars(self) -> int:
        return settings.MAX_HOOK_RESULTS_MIB.in_bytes()

    def record(self, set_id: str, caller: str | None = None) -> HookSetRecord:
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
    def _idle(record: HookSetRecord, now: float) -> bool:
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

    def remove(self, set_id: str, caller: str | None = None) -> HookSetRecord:
        self.record(set_id, caller)
        return self._drop(set_id)

    def _drop(self, set_id: str) -> HookSetRecord:
        record = self.sets.pop(set_id)
        if self.auto_set == set_id:
            self.auto_set = None
        self.held_chars -= record.chars
        self.hook_chars -= record.hook_chars
        forget_local(record.local_ids)
        return record
