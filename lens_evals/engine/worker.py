"""Worker side: decodes lens requests, plans each step, keeps captured rows per request until
the frontend fetches them (through collective_rpc, as safetensors bytes) or they are dropped."""

from __future__ import annotations

import json
import logging
import os
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch
from safetensors.torch import save as st_save

from lens_evals.engine import compat
from lens_evals.engine.batch import StepPlan, build_plan
from lens_evals.engine.requests import WorkerRequest, decode_worker_request
from lens_evals import wire
from lens_evals.engine.hooks import HookCall, HookContext, ParameterCache, WorkerHook, decode_hooks
from lens_evals.engine.taps import install_hook_tap, install_taps

logger = logging.getLogger("lens_evals")
STATE_ATTR = "_lens_evals_state"
FETCH_METHOD = "lens_evals_fetch"
MEMORY_METHOD = "lens_evals_memory"
REGISTER_SET_METHOD = "lens_evals_register_hook_set"
CLEAR_SET_METHOD = "lens_evals_clear_hook_set"
DEFAULT_MAX_SAVED_MIB = 256.0


@dataclass
class RowChunk:
    """One step's rows of one request: captured residual streams (``ids`` are layers, data
    (n_layers, n_rows, hidden)) or probe scores (``ids`` are probe indices, data (n_probes, n_rows))."""

    ids: list[int]
    positions: np.ndarray
    data: torch.Tensor  # host memory once `ready` is done
    ready: torch.cuda.Event | None = None

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()


def _limit_bytes(env: str, default_gib: float) -> int:
    return int(float(os.environ.get(env, default_gib)) * 2**30)


class LensWorkerState:
    def __init__(self, runner: Any) -> None:
        self.runner = runner
        self.device = compat.runner_device(runner)
        self.dtype = runner.model_config.dtype
        self.num_layers = compat.num_layers_of(runner)
        tp_rank, _ = compat.parallel_ranks()
        self.capture_here = tp_rank == 0
        self.model = compat.runner_model(runner)
        self.layer_modules = install_taps(self, self.model, self.num_layers)
        self.local_layers = set(self.layer_modules)
        self.hook_sites: set[tuple[int, str | None, bool]] = set()
        self.hook_sets: dict[str, list[WorkerHook]] = {}
        self.parameters = ParameterCache(self.model, compat.checkpoint_dir(runner))
        self.by_key: dict[str, WorkerRequest] = {}
        self.max_saved_chars = int(float(os.environ.get("LENS_EVALS_MAX_SAVED_MIB", DEFAULT_MAX_SAVED_MIB)) * 2**20)
        self.requests: dict[str, WorkerRequest | None] = {}
        self.req_keys: dict[str, str] = {}
        self.chunks: dict[str, list[RowChunk]] = {}
        self.score_chunks: dict[str, list[RowChunk]] = {}
        self.errors: dict[str, str] = {}
        self.fetched: set[str] = set()
        self.finished_unfetched: OrderedDict[str, float] = OrderedDict()
        self.held_bytes = 0
        self.max_held_bytes = _limit_bytes("LENS_EVALS_MAX_HELD_CAPTURE_GIB", 8.0)
        self.plan: StepPlan | None = None
        self.step_captures: dict[int, torch.Tensor] = {}
        self.step_scores: dict[int, torch.Tensor] = {}
        self._step_scheduled: dict[str, int] | None = None

    # ----------------------------------------------------------------- step lifecycle
    def on_step_start(self, scheduler_output: Any) -> None:
        for req_id in compat.finished_request_ids(scheduler_output):
            self._finish(req_id)
        self._step_scheduled = compat.step_num_scheduled(scheduler_output)

    def around_forward(self, run: Callable[[], Any], input_ids: torch.Tensor | None = None) -> Any:
        scheduled, self._step_scheduled = self._step_scheduled, None
        if scheduled is None:  # profiling / dummy run
            return run()
        layout = compat.batch_layout(self.runner, scheduled)
        for req_id in layout.req_ids:
            if req_id not in self.requests:
                self._admit(req_id)
        if not self.req_keys:  # no lens request in flight: plain traffic pays nothing more
            return run()
        self.plan = build_plan(
            layout, self.requests, self.device, self.dtype, self.capture_here, self.local_layers,
            input_ids, set(self.errors),
        )
        if self.plan is None:
            return run()
        self._install_hook_sites(self.plan)
        try:
            return run()
        finally:
            plan, self.plan = self.plan, None
            self._store_step(plan)

    def _admit(self, req_id: str) -> None:
        extra = compat.request_extra_args(self.runner, req_id)
        try:
            req = decode_worker_request(extra, self.device, self.dtype, self.hook_sets)
        except (ValueError, KeyError, TypeError, ImportError, AttributeError) as exc:
            key = str((extra or {}).get("_lens_evals", {}).get("key", req_id))
            self.errors[key] = f"could not decode lens request on the worker: {exc}"
            req = None
        self.requests[req_id] = req
        if req is not None:
            self.req_keys[req_id] = req.key
            self.by_key[req.key] = req

    def _install_hook_sites(self, plan: StepPlan) -> None:
        """Taps for hook sites seen for the first time; a bad module path fails its requests."""
        for site in list(plan.hook_calls):
            if site in self.hook_sites:
                continue
            try:
                install_hook_tap(self, self.layer_modules[site[0]], site)
                self.hook_sites.add(site)
            except AttributeError:
                calls = plan.hook_calls.pop(site)
                message = f"layer {site[0]} has no submodule {site[1]!r} to hook"
                for call in calls:
                    self.fail_key(call.key, message)

    def hook_context(self, call: HookCall, layer: int) -> HookContext:
        hook = call.hook
        return HookContext(
            saved=call.saved, layer_idx=layer, positions=call.positions, token_ids=call.token_ids,
            args=hook.args, pre=hook.pre, module_path=hook.module, model=self.model,
            hf_config=compat.hf_config(self.runner), parameters=self.parameters,
        )

    def fail_key(self, key: str, message: str) -> None:
        self.errors.setdefault(key, message)

    def has_failed(self, key: str) -> bool:
        return key in self.errors

    def _store_step(self, plan: StepPlan) -> None:
        captured, self.step_captures = self.step_captures, {}
        scored, self.step_scores = self.step_scores, {}
        if plan.capture_slots and len(captured) == len(plan.capture_layers):
            stacked = torch.stack([captured[layer] for layer in plan.capture_layers])  # (L, R, H)
            parts = [stacked[slot.layer_slots, slot.row_start : slot.row_start + slot.num_rows] for slot in plan.capture_slots]
            host_parts, ready = _to_host(parts)
            for slot, data in zip(plan.capture_slots, host_parts):
                layers = [plan.capture_layers[i] for i in slot.layer_slots]
                self._keep(self.chunks, slot.key, RowChunk(layers, slot.positions, data, ready))
        if plan.score_slots and len(scored) == len(plan.probes):
            parts = [torch.stack([scored[layer][off : off + slot.num_rows] for _, layer, off in slot.entries]) for slot in plan.score_slots]
            host_parts, ready = _to_host(parts)  # float32 scores: a separate (small) copy
            for slot, data in zip(plan.score_slots, host_parts):
                probe_indices = [index for index, _, _ in slot.entries]
                self._keep(self.score_chunks, slot.key, RowChunk(probe_indices, slot.positions, data, ready))
        self._enforce_memory_bound()

    def _keep(self, store: dict[str, list[RowChunk]], key: str, chunk: RowChunk) -> None:
        if key in self.fetched or key in self.errors:
            return
        store.setdefault(key, []).append(chunk)
        self.held_bytes += chunk.nbytes

    def fail_keys(self, keys: list[str], message: str) -> None:
        for key in keys:
            self.fail_key(key, message)

    # ----------------------------------------------------------------- finishing and fetching
    def _finish(self, req_id: str) -> None:
        self.requests.pop(req_id, None)
        key = self.req_keys.pop(req_id, None)
        if key is None:
            return
        if key in self.fetched:
            self.fetched.discard(key)
            self._drop(key)
        else:
            self.finished_unfetched[key] = time.monotonic()

    def _release_chunks(self, key: str) -> tuple[list[RowChunk], list[RowChunk]]:
        """Forget a request's (captured, scored) chunks and return them."""
        captured = self.chunks.pop(key, [])
        scored = self.score_chunks.pop(key, [])
        self.held_bytes -= sum(chunk.nbytes for chunk in captured + scored)
        return captured, scored

    def _drop(self, key: str) -> None:
        self._release_chunks(key)
        self.by_key.pop(key, None)
        self.errors.pop(key, None)

    def _enforce_memory_bound(self) -> None:
        while self.held_bytes > self.max_held_bytes and self.finished_unfetched:
            key, _ = self.finished_unfetched.popitem(last=False)
            logger.warning("lens_evals: dropping unfetched capture %s to stay under the host memory bound", key)
            self._drop(key)
        if self.held_bytes > self.max_held_bytes:
            keys = list(self.chunks.keys() | self.score_chunks.keys())
            self.fail_keys(keys, "worker capture memory bound exceeded (LENS_EVALS_MAX_HELD_CAPTURE_GIB)")
            for key in keys:
                self._release_chunks(key)

    def pop_result(self, key: str) -> dict[str, Any] | None:
        """Assemble and release one request's capture, probe scores and hook results (rows placed
        by absolute position; ``saved`` JSON-safe, arrays encoded)."""
        error = self.errors.get(key)
        captured, scored = self._release_chunks(key)
        req = self.by_key.pop(key, None)
        if key in self.finished_unfetched:
            self.finished_unfetched.pop(key)
            self.errors.pop(key, None)
        else:
            self.fetched.add(key)
        if error is not None:
            return {"error": error}
        result: dict[str, Any] = {}
        if req is not None and self.capture_here:
            try:
                if req.hooks:
                    result["saved"] = self._encode_saved(req.saved, "saved")
                if req.hook_set:
                    result["set_saved"] = self._encode_saved(req.set_saved, "hook set saved")
            except ValueError as exc:
                return {"error": str(exc)}
        tensors: dict[str, torch.Tensor] = {}
        for chunks, name, ids_name in ((captured, "residual_stream", "layers"), (scored, "probe_scores", "probe_index")):
            if not chunks:
                continue
            ids, rows, gaps = _assemble(chunks)
            if gaps:
                return {"error": f"{name} has gaps at positions {gaps} (prefix cache or scheduling defect)"}
            tensors[name] = rows
            tensors[ids_name] = torch.tensor(ids, dtype=torch.int64)
        if tensors:
            result["safetensors"] = st_save(tensors)
        return result or None

    def _encode_saved(self, saved: dict[str, Any], what: str) -> dict[str, Any]:
        encoded = wire.encode_tree(saved, "saved")
        size = len(json.dumps(encoded))
        if size > self.max_saved_chars:
            raise ValueError(
                f"{what} is {size / 2**20:.1f} MiB encoded, over the per-request limit of "
                f"{self.max_saved_chars / 2**20:.1f} MiB (LENS_EVALS_MAX_SAVED_MIB)"
            )
        return encoded


def _to_host(parts: list[torch.Tensor]) -> tuple[list[torch.Tensor], torch.cuda.Event | None]:
    """One asynchronous device-to-host copy for all of a step's parts; each part comes back as
    a view of the pinned buffer (read it only after the event: the copy may still run)."""
    if parts[0].device.type != "cuda":
        return parts, None
    flat = torch.cat([part.reshape(-1) for part in parts])
    host = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
    host.copy_(flat, non_blocking=True)
    ready = torch.cuda.Event()
    ready.record()
    views, start = [], 0
    for part in parts:
        views.append(host[start : start + part.numel()].view(part.shape))
        start += part.numel()
    return views, ready


def _assemble(chunks: list[RowChunk]) -> tuple[list[int], torch.Tensor, list[int]]:
    """(ids, rows (n_ids, n_positions, ...), first missing positions). Later chunks
    (recomputation after preemption) overwrite earlier ones."""
    for chunk in chunks:
        if chunk.ready is not None:
            chunk.ready.synchronize()
    ids = chunks[0].ids
    last = int(max(c.positions.max() for c in chunks))
    first = chunks[0].data
    out = torch.zeros((len(ids), last + 1, *first.shape[2:]), dtype=first.dtype)
    covered = np.zeros(last + 1, dtype=bool)
    for chunk in chunks:
        out[:, torch.from_numpy(chunk.positions)] = chunk.data
        covered[chunk.positions] = True
    gaps = np.flatnonzero(~covered)[:10].tolist()
    return ids, out.contiguous(), gaps


def get_state(runner: Any) -> LensWorkerState:
    state = getattr(runner, STATE_ATTR, None)
    if state is None:
        raise RuntimeError("lens_evals is not active in this worker (was the model loaded with the plugin?)")
    return state


# ----------------------------------------------------------------- functions run through collective_rpc
def fetch_results(worker: Any, keys: list[str]) -> dict[str, dict[str, Any]]:
    """Runs on each worker; returns only plain bytes and strings (tensors do not cross processes)."""
    state = getattr(compat.runner_from_worker(worker), STATE_ATTR, None)
    if state is None:  # e.g. a model runner the plugin does not hook: fail the requests, not the engine
        return {key: {"error": "lens_evals is not active in this worker's model runner"} for key in keys}
    results: dict[str, dict[str, Any]] = {}
    for key in keys:
        result = state.pop_result(key)
        if result is not None:
            results[key] = result
    return results


def worker_memory(worker: Any) -> dict[str, int]:
    state = get_state(compat.runner_from_worker(worker))
    held = state.chunks.keys() | state.score_chunks.keys()
    return {"held_bytes": state.held_bytes, "requests": len(held), "tracked": len(state.requests)}


def register_hook_set(worker: Any, set_id: str, hooks: list[dict[str, Any]]) -> str | None:
    """Resolve a persistent hook set on this worker; the error text if it cannot be."""
    state = get_state(compat.runner_from_worker(worker))
    try:
        state.hook_sets[set_id] = decode_hooks(hooks, state.device)
    except (ValueError, KeyError, TypeError, ImportError, AttributeError) as exc:
        return f"could not load hook set on the worker: {type(exc).__name__}: {exc}"
    return None


def clear_hook_set(worker: Any, set_id: str) -> bool:
    return get_state(compat.runner_from_worker(worker)).hook_sets.pop(set_id, None) is not None


WORKER_METHODS = {
    FETCH_METHOD: fetch_results,
    MEMORY_METHOD: worker_memory,
    REGISTER_SET_METHOD: register_hook_set,
    CLEAR_SET_METHOD: clear_hook_set,
}
