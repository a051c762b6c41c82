"""Worker side: decodes lens requests, plans each step, keeps captured rows per request until
the frontend fetches them (through collective_rpc, as safetensors bytes) or they are dropped."""

from __future__ import annotations

import json
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch

from lens_evals import settings, wire
from lens_evals.engine import compat, handoff, timing
from lens_evals.engine.batch import StepPlan, build_plan
from lens_evals.engine.graph_taps import GraphTaps, configured_layers, graph_refusal
from lens_evals.engine.hooks import HookCall, HookContext, ParameterCache, WorkerHook, decode_hooks
from lens_evals.engine.requests import WorkerRequest, decode_worker_request
from lens_evals.engine.results import TakenResult, write_results
from lens_evals.engine.store import Piece, PieceStore, row_blocks, to_host
from lens_evals.engine.taps import install_hook_tap, install_taps, read_step
from lens_evals.spec import INTERNAL_KEY

logger = logging.getLogger("lens_evals")
STATE_ATTR = "_lens_evals_state"
FETCH_METHOD = "lens_evals_fetch"
MEMORY_METHOD = "lens_evals_memory"
REGISTER_SET_METHOD = "lens_evals_register_hook_set"
CLEAR_SET_METHOD = "lens_evals_clear_hook_set"


class LensWorkerState:
    def __init__(self, runner: Any) -> None:
        self.runner = runner
        self.model = compat.runner_model(runner)
        self.num_layers = compat.num_layers_of(runner)
        tp_rank, _ = compat.parallel_ranks()
        self.graph: GraphTaps | None = None
        try:
            self.layer_modules = dict(compat.find_decoder_layers(self.model, self.num_layers))
        except RuntimeError:
            self.layer_modules = {}
        self.support = compat.layer_support(runner.model_config, self.layer_modules)
        graph_layers = configured_layers(runner.vllm_config, self.num_layers)
        self.refusal = self.support.refusal or (graph_refusal(self.support) if graph_layers is not None else None)
        contract = self.support.contract
        if self.refusal is not None or contract is None:  # contract is None only with a refusal
            logger.warning("lens_evals: %s", self.refusal)
        elif graph_layers is None:
            install_taps(self, self.layer_modules, contract)
        else:
            self.graph = GraphTaps(
                self.layer_modules, graph_layers, compat.max_step_rows(runner),
                compat.model_shape(runner.vllm_config).hidden_size, runner.model_config.dtype, compat.runner_device(runner),
                contract,
            )
        self._init_data_path(compat.runner_device(runner), runner.model_config.dtype, set(self.layer_modules), tp_rank == 0)
        self.parameters = ParameterCache(self.model, compat.checkpoint_dir(runner))

    @classmethod
    def detached(cls, device: torch.device, dtype: torch.dtype, local_layers: set[int]) -> LensWorkerState:
        """The step planning and host store without a model runner (``lens_evals.bench.host_path``)."""
        state = cls.__new__(cls)
        state.graph = None
        state.refusal = None
        state._init_data_path(device, dtype, local_layers, capture_here=True)
        return state

    def _init_data_path(self, device: torch.device, dtype: torch.dtype, local_layers: set[int], capture_here: bool) -> None:
        self.device = device
        self.dtype = dtype
        self.capture_here = capture_here
        self.local_layers = local_layers
        self.hook_sites: set[tuple[int, str | None, bool]] = set()
        self.hook_sets: dict[str, list[WorkerHook]] = {}
        self.by_key: dict[str, WorkerRequest] = {}
        self.max_saved_chars = settings.MAX_SAVED_MIB.in_bytes()
        self.requests: dict[str, WorkerRequest | None] = {}
        self.req_keys: dict[str, str] = {}
        self.captures = PieceStore()  # captured rows per request key
        self.scores = PieceStore(arena_chunk_bytes=4 * 2**20)  # probe scores per request key
        self.errors: dict[str, str] = {}
        self.fetched: set[str] = set()
        self.finished_unfetched: OrderedDict[str, float] = OrderedDict()
        self.max_held_bytes = settings.MAX_HELD_CAPTURE_GIB.in_bytes()
        self.plan: StepPlan | None = None
        self._last_plan: tuple[tuple[list[str], list[int]], StepPlan] | None = None
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
        with timing.phase("plan"):
            plan = self.plan_step(layout, input_ids) if self.req_keys else None  # no lens request: nothing more
        if self.graph is not None:
            return self._graph_forward(run, plan, sum(layout.num_rows))
        if plan is None:
            return run()
        self.plan = plan
        self._install_hook_sites(plan)
        try:
            with timing.phase("forward with taps (queued)"):
                return run()
        finally:
            self.plan = None
            self.store_step(plan)

    def _graph_forward(self, run: Callable[[], Any], plan: StepPlan | None, num_rows: int) -> Any:
        """Graph mode: steering rows into the static buffers, the (compiled) forward, then the
        step's captures and probe scores read out of the capture buffers."""
        assert self.graph is not None
        with timing.phase("graph steer rows"):
            self.graph.before_forward(plan)
        with timing.phase("forward (queued)"):
            output = run()
        if plan is not None:
            try:
                for layer in plan.hooked_layers:
                    read_step(self, plan, layer, self.graph.stream(layer, num_rows))
            except Exception as exc:  # noqa: BLE001 - reported to every lens request of the step
                logger.exception("lens_evals: reading the graph-mode buffers failed")
                self.fail_keys(plan.keys, f"graph-mode read failed: {type(exc).__name__}: {exc}")
            self.store_step(plan)
        return output

    @property
    def held_bytes(self) -> int:
        return self.captures.held_bytes + self.scores.held_bytes

    def plan_step(self, layout: compat.BatchLayout, input_ids: torch.Tensor | None) -> StepPlan | None:
        """The step's plan; a decode step with the same requests and row counts as the last
        one reuses its tensors (only the start positions change), so it costs no device work."""
        signature = (layout.req_ids, layout.num_rows)
        if self._last_plan is not None and self._last_plan[0] == signature:
            plan = self._last_plan[1]
            plan.start_positions = layout.start_positions
            return plan
        plan = build_plan(
            layout, self.requests, self.device, self.dtype, self.capture_here, self.local_layers,
            input_ids, set(self.errors),
        )
        self._last_plan = (signature, plan) if plan is not None and plan.reusable else None
        return plan

    def _admit(self, req_id: str) -> None:
        extra = compat.request_extra_args(self.runner, req_id)
        if self.refusal is not None and extra and INTERNAL_KEY in extra:
            key = str(extra[INTERNAL_KEY].get("key", req_id))
            self.errors[key] = self.refusal
            self.track(req_id, None, key)
            return
        try:
            req = decode_worker_request(extra, self.device, self.dtype, self.hook_sets)
        except (ValueError, KeyError, TypeError, ImportError, AttributeError) as exc:
            key = str((extra or {}).get(INTERNAL_KEY, {}).get("key", req_id))
            self.errors[key] = f"could not decode lens request on the worker: {exc}"
            self.track(req_id, None, key)
            return
        self.track(req_id, req)

    def track(self, req_id: str, req: WorkerRequest | None, failed_key: str | None = None) -> None:
        """Follow a (decoded) request from now on; None: a plain request, or a lens request
        that already failed (``failed_key``: its key, so its error is released with it)."""
        self.requests[req_id] = req
        if req is not None:
            self.req_keys[req_id] = req.key
            self.by_key[req.key] = req
        elif failed_key is not None:
            self.req_keys[req_id] = failed_key

    def _install_hook_sites(self, plan: StepPlan) -> None:
        """Taps for hook sites seen for the first time; a bad module path fails its requests."""
        for site in list(plan.hook_calls):
            if site in self.hook_sites:
                continue
            try:
                install_hook_tap(self, self.layer_modules[site[0]], site, self.support.contract)
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

    def store_step(self, plan: StepPlan) -> None:
        """One device-to-host copy for the step's captures and one for its probe scores; each
        request keeps a Piece (where its rows are), nothing is cut per request here."""
        with timing.phase("store"):
            self._store_step(plan)

    def _store_step(self, plan: StepPlan) -> None:
        captured, self.step_captures = self.step_captures, {}
        scored, self.step_scores = self.step_scores, {}
        self.captures.compact()
        self.scores.compact()
        starts = plan.start_positions
        if plan.capture_slots and len(captured) == len(plan.capture_layers):
            layers = [captured[layer] for layer in plan.capture_layers]
            stacked = layers[0].unsqueeze(0) if len(layers) == 1 else torch.stack(layers)  # (L, R, H), a new tensor
            data, ready, chunk = to_host(stacked, self.captures.arena)
            buffer = self.captures.new_buffer(data, ready, stacked.shape[1], chunk)
            for slot in plan.capture_slots:
                if slot.key not in self.fetched and slot.key not in self.errors:
                    self.captures.add(slot.key, Piece(buffer, slot.row_start, slot.num_rows, starts[slot.batch_index], slot.layer_slots))
            self.captures.drop_unused(buffer)
        if plan.score_slots and len(scored) == len(plan.probes):
            flat = torch.cat([scored[layer] for layer in plan.probes])  # float32 scores of every (row, probe) pair
            data, ready, chunk = to_host(flat, self.scores.arena)
            buffer = self.scores.new_buffer(data, ready, flat.shape[0], chunk)
            for slot in plan.score_slots:
                if slot.key not in self.fetched and slot.key not in self.errors:
                    self.scores.add(slot.key, Piece(buffer, 0, slot.num_rows, starts[slot.batch_index], slot.flat_offsets))
            self.scores.drop_unused(buffer)
        self._enforce_memory_bound()

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

    def _release(self, key: str) -> tuple[list[Piece], list[Piece]]:
        """Forget a request's (captured, scored) pieces and return them (still readable)."""
        return self.captures.release(key), self.scores.release(key)

    def _drop(self, key: str) -> None:
        self._release(key)
        self.by_key.pop(key, None)
        self.errors.pop(key, None)

    def _enforce_memory_bound(self) -> None:
        while self.held_bytes > self.max_held_bytes and self.finished_unfetched:
            key, _ = self.finished_unfetched.popitem(last=False)
            logger.warning("lens_evals: dropping unfetched capture %s to stay under the host memory bound", key)
            self._drop(key)
        if self.held_bytes > self.max_held_bytes:
            keys = list(self.captures.keys() | self.scores.keys())
            self.fail_keys(keys, "worker capture memory bound exceeded (LENS_EVALS_MAX_HELD_CAPTURE_GIB)")
            for key in keys:
                self._release(key)

    def pop_result(self, key: str, sink: handoff.Sink = handoff.inline) -> dict[str, Any] | None:
        """Release one request and return its capture, probe scores and hook results (rows
        placed by absolute position, written by ``sink``; ``saved`` JSON-safe, arrays encoded)."""
        return self.take_result(key).write(sink)

    def take_result(self, key: str) -> TakenResult:
        """Release one request: its result without the rows, and where the rows are (the
        writing may happen on another thread: nothing here is touched by it)."""
        error = self.errors.get(key)
        captured, scored = self._release(key)
        req = self.by_key.pop(key, None)
        if key in self.finished_unfetched:
            self.finished_unfetched.pop(key)
            self.errors.pop(key, None)
        else:
            self.fetched.add(key)
        if error is not None:
            return TakenResult({"error": error})
        result: dict[str, Any] = {}
        if req is not None and self.capture_here:
            try:
                if req.hooks:
                    result["saved"] = self._encode_saved(req.saved, "saved")
                if req.hook_set:
                    result["set_saved"] = self._encode_saved(req.set_saved, "hook set saved")
            except ValueError as exc:
                return TakenResult({"error": str(exc)})
        parts = []
        for pieces, name, ids_name, ids in (
            (captured, "residual_stream", "layers", [layer for layer in (req.capture_layers if req else []) if layer in self.local_layers]),
            (scored, "probe_scores", "probe_index", [probe.index for probe in (req.probes if req else []) if probe.layer in self.local_layers]),
        ):
            if not pieces:
                continue
            rows = row_blocks(pieces)
            if rows.gaps:
                return TakenResult({"error": f"{name} has gaps at positions {rows.gaps} (prefix cache or scheduling defect)"})
            parts.append((name, ids_name, ids, rows))
        return TakenResult(result, parts)

    def _encode_saved(self, saved: dict[str, Any], what: str) -> dict[str, Any]:
        encoded = wire.encode_tree(saved, "saved")
        size = len(json.dumps(encoded))
        if size > self.max_saved_chars:
            raise ValueError(
                f"{what} is {size / 2**20:.1f} MiB encoded, over the per-request limit of "
                f"{self.max_saved_chars / 2**20:.1f} MiB (LENS_EVALS_MAX_SAVED_MIB)"
            )
        return encoded


def get_state(runner: Any) -> LensWorkerState:
    state = getattr(runner, STATE_ATTR, None)
    if state is None:
        raise RuntimeError("lens_evals is not active in this worker (was the model loaded with the plugin?)")
    return state


# ----------------------------------------------------------------- functions run through collective_rpc
def fetch_results(worker: Any, keys: list[str], target: dict[str, Any] | None = None) -> dict[str, dict[str, Any]]:
    """Runs on each worker; returns only plain bytes and strings (tensors do not cross processes).
    ``target``: the frontend's hand-off directory (large row blocks go there, see ``handoff``)."""
    state = getattr(compat.runner_from_worker(worker), STATE_ATTR, None)
    if state is None:  # e.g. a model runner the plugin does not hook: fail the requests, not the engine
        return {key: {"error": "lens_evals is not active in this worker's model runner"} for key in keys}
    sink = handoff.sink_for(target)
    with timing.phase("fetch: release"):
        taken = {key: state.take_result(key) for key in keys}
    with timing.phase("fetch: write rows"):
        written = write_results(taken, sink)
    results = {key: result for key, result in written.items() if result is not None}
    timing.log_and_reset("worker")
    return results


def worker_memory(worker: Any) -> dict[str, int]:
    state = get_state(compat.runner_from_worker(worker))
    held = state.captures.keys() | state.scores.keys()
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
