"""Worker side: decodes lens requests, plans each step, keeps captured rows per request until
the frontend fetches them (through collective_rpc, as safetensors bytes) or they are dropped."""

from __future__ import annotations

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
from lens_evals.engine.taps import install_taps

logger = logging.getLogger("lens_evals")
STATE_ATTR = "_lens_evals_state"
FETCH_METHOD = "lens_evals_fetch"
MEMORY_METHOD = "lens_evals_memory"


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
        self.local_layers = set(install_taps(self, compat.runner_model(runner), self.num_layers))
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

    def around_forward(self, run: Callable[[], Any]) -> Any:
        scheduled, self._step_scheduled = self._step_scheduled, None
        if scheduled is None:  # profiling / dummy run
            return run()
        layout = compat.batch_layout(self.runner, scheduled)
        for req_id in layout.req_ids:
            if req_id not in self.requests:
                self._admit(req_id)
        if not self.req_keys:  # no lens request in flight: plain traffic pays nothing more
            return run()
        self.plan = build_plan(layout, self.requests, self.device, self.dtype, self.capture_here, self.local_layers)
        if self.plan is None:
            return run()
        try:
            return run()
        finally:
            plan, self.plan = self.plan, None
            self._store_step(plan)

    def _admit(self, req_id: str) -> None:
        extra = compat.request_extra_args(self.runner, req_id)
        try:
            req = decode_worker_request(extra, self.device, self.dtype)
        except (ValueError, KeyError, TypeError) as exc:
            key = str((extra or {}).get("_lens_evals", {}).get("key", req_id))
            self.errors[key] = f"could not decode lens request on the worker: {exc}"
            req = None
        self.requests[req_id] = req
        if req is not None:
            self.req_keys[req_id] = req.key

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
            self.errors.setdefault(key, message)

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
        """Assemble and release one request's capture and probe scores, rows placed by absolute position."""
        error = self.errors.get(key)
        captured, scored = self._release_chunks(key)
        if key in self.finished_unfetched:
            self.finished_unfetched.pop(key)
            self.errors.pop(key, None)
        else:
            self.fetched.add(key)
        if error is not None:
            return {"error": error}
        if not captured and not scored:
            return None
        tensors: dict[str, torch.Tensor] = {}
        for chunks, name, ids_name in ((captured, "residual_stream", "layers"), (scored, "probe_scores", "probe_index")):
            if not chunks:
                continue
            ids, rows, gaps = _assemble(chunks)
            if gaps:
                return {"error": f"{name} has gaps at positions {gaps} (prefix cache or scheduling defect)"}
            tensors[name] = rows
            tensors[ids_name] = torch.tensor(ids, dtype=torch.int64)
        return {"safetensors": st_save(tensors)}


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


WORKER_METHODS = {FETCH_METHOD: fetch_results, MEMORY_METHOD: worker_memory}
