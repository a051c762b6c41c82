"""The worker's methods for ``collective_rpc`` (names and payloads: ``protocol``), added to
vLLM's worker class by the plugin: the fetch, the early release of pool regions, the memory
report, and the worker's half of persistent hook sets (resolved here once, used by the requests
that name them)."""

from __future__ import annotations

from typing import Any

from lens_evals.engine import compat
from lens_evals.engine.transport import handoff, timing
from lens_evals.engine.transport.protocol import (
    CLEAR_SET_METHOD,
    COPY_METHOD,
    FETCH_METHOD,
    MEMORY_METHOD,
    REGISTER_SET_METHOD,
    RELEASE_METHOD,
    CopyReport,
    FetchReply,
    HandoffTargetWire,
    HookWire,
    MemoryReport,
)
from lens_evals.engine.worker.hooks import decode_hooks
from lens_evals.engine.worker.state import STATE_ATTR, get_state


def fetch_results(worker: Any, keys: list[str], target: HandoffTargetWire | None = None) -> FetchReply:
    """Runs on each worker; returns only plain bytes and strings (tensors do not cross processes).
    ``target``: the frontend's hand-off directory (large row blocks go there, see ``handoff``)."""
    state = getattr(compat.worker.runner_from_worker(worker), STATE_ATTR, None)
    if state is None:  # e.g. a model runner the plugin does not hook: fail the requests, not the engine
        return {key: {"error": "lens_evals is not active in this worker's model runner"} for key in keys}
    written = state.core.fetch_results(keys, dict(target) if target else None)
    results = {key: result for key, result in written.items() if result is not None}
    timing.log_and_reset("worker")
    return results


def worker_memory(worker: Any) -> MemoryReport:
    state = get_state(compat.worker.runner_from_worker(worker))
    core = state.core
    return {
        "held_bytes": core.held_bytes,
        "requests": len(core.stores.keys()),
        "tracked": len(core.ledger.requests),
        "early_written": core.early.written,
        "early_unfetched": len(core.early),
        "streamed_writes": core.streams.written,
        "pool_bytes": handoff.pooled_bytes(),
        "pool_allocated_bytes": handoff.pooled_bytes(allocated=True),
    }


def release_regions(worker: Any, target: HandoffTargetWire) -> int:
    """The frontend's freed pool regions, ahead of its next fetch (``handoff.release_regions``)."""
    return handoff.release_regions(target)


def copy_mode(worker: Any, overlap: bool | None = None) -> CopyReport:
    """Overlap the step copies with the next step, or not (None: leave as it is); what they did."""
    stores = get_state(compat.worker.runner_from_worker(worker)).core.stores
    copier = stores.copier
    if overlap is not None:
        copier.set_overlap(bool(overlap))
    arena = stores.captures.arena
    return {
        "overlap": copier.overlap,
        "copies": copier.copies,
        "overlapped": copier.overlapped,
        "pinned_bytes": arena.pinned_bytes,
        "spare_bytes": arena.spare_bytes,
    }


def register_hook_set(worker: Any, set_id: str, hooks: list[HookWire]) -> str | None:
    """Resolve a persistent hook set on this worker; the error text if it cannot be."""
    state = get_state(compat.worker.runner_from_worker(worker))
    try:
        state.hook_sets[set_id] = decode_hooks(hooks, state.core.device)
    except (ValueError, KeyError, TypeError, ImportError, AttributeError) as exc:
        return f"could not load hook set on the worker: {type(exc).__name__}: {exc}"
    return None


def clear_hook_set(worker: Any, set_id: str) -> bool:
    return get_state(compat.worker.runner_from_worker(worker)).hook_sets.pop(set_id, None) is not None


WORKER_METHODS: dict[str, Any] = {
    FETCH_METHOD: fetch_results,
    MEMORY_METHOD: worker_memory,
    REGISTER_SET_METHOD: register_hook_set,
    CLEAR_SET_METHOD: clear_hook_set,
    COPY_METHOD: copy_mode,
    RELEASE_METHOD: release_regions,
}
