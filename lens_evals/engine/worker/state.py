"""The model runner's lens state (one per runner, set at model load): finds the decoder layers
and installs the taps (eager) or the static buffers (graph mode), admits each new request
(decoded once), and around every forward pass plans the step, hands the taps its context and
stores what they captured (the model-free part is ``WorkerCore``). The worker's methods for
``collective_rpc`` are in ``worker.rpc``."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from lens_evals.engine import compat
from lens_evals.engine.transport import timing
from lens_evals.engine.transport.graph_layers import configured_layers
from lens_evals.engine.worker.core import WorkerCore
from lens_evals.engine.worker.graph_taps import GraphTaps, graph_refusal
from lens_evals.engine.worker.hooks import HookCall, HookContext, ParameterCache, WorkerHook
from lens_evals.engine.worker.requests import decode_worker_request
from lens_evals.engine.worker.taps import ActiveStep, HookSites, StepContext, install_taps, read_step
from lens_evals.request.spec import INTERNAL_KEY

logger = logging.getLogger("lens_evals")
STATE_ATTR = "_lens_evals_state"


class LensWorkerState:
    """One model runner's lens state: its layers and their taps (eager or graph mode), the
    worker's data path (``core``: ledger, planner, step stores, fetch), the hook sites installed
    so far and the persistent hook sets registered here."""

    def __init__(self, runner: Any) -> None:
        self.runner = runner
        self.model = compat.worker.runner_model(runner)
        self.num_layers = compat.worker.num_layers_of(runner)
        tp_rank, _ = compat.worker.parallel_ranks()
        self.graph: GraphTaps | None = None
        self.active = ActiveStep()
        try:
            self.layer_modules = dict(compat.architectures.find_decoder_layers(self.model, self.num_layers))
        except RuntimeError:
            self.layer_modules = {}
        self.support = compat.architectures.layer_support(runner.model_config, self.layer_modules)
        graph_layers = configured_layers(runner.vllm_config, self.num_layers)
        self.refusal = self.support.refusal or (graph_refusal(self.support) if graph_layers is not None else None)
        contract = self.support.contract
        if self.refusal is not None or contract is None:  # contract is None only with a refusal
            logger.warning("lens_evals: %s", self.refusal)
        elif graph_layers is None:
            install_taps(self.active, self.layer_modules, contract)
        else:
            self.graph = GraphTaps(
                self.layer_modules,
                graph_layers,
                compat.worker.max_step_rows(runner),
                compat.config.model_shape(runner.vllm_config).hidden_size,
                runner.model_config.dtype,
                compat.worker.runner_device(runner),
                contract,
            )
        self.core = WorkerCore(compat.worker.runner_device(runner), runner.model_config.dtype, set(self.layer_modules), tp_rank == 0)
        self.core.head = compat.worker.readout_head(self.model)
        self.hook_sites = HookSites(self.active, self.layer_modules, contract)
        self.hook_sets: dict[str, list[WorkerHook]] = {}
        self.parameters = ParameterCache(self.model, compat.worker.checkpoint_dir(runner))
        self._step_scheduled: dict[str, int] | None = None

    # ----------------------------------------------------------------- step lifecycle
    def on_step_start(self, scheduler_output: Any) -> None:
        with timing.phase("step start (finished requests)"):
            for req_id in compat.worker.finished_request_ids(scheduler_output):
                self.core.finish(req_id)
            self._step_scheduled = compat.worker.step_num_scheduled(scheduler_output)

    def around_forward(self, run: Callable[[], Any], input_ids: torch.Tensor | None = None) -> Any:
        scheduled, self._step_scheduled = self._step_scheduled, None
        if scheduled is None:  # profiling / dummy run
            return run()
        with timing.phase("layout and admission"):
            layout = compat.worker.batch_layout(self.runner, scheduled)
            ledger = self.core.ledger
            for req_id in layout.req_ids:
                if not ledger.known(req_id):
                    self._admit(req_id)
        with timing.phase("plan"):
            plan = self.core.plan_step(layout, input_ids) if ledger.any_lens_request else None  # no lens request: nothing more
        step = self.core.begin_step(plan, self.hook_context) if plan is not None else None
        if self.graph is not None:
            return self._graph_forward(run, step, sum(layout.num_rows))
        if step is None:
            return run()
        self.hook_sites.install_for(step)
        self.active.step = step
        try:
            with timing.phase("forward with taps (queued)"):
                return run()
        finally:
            self.active.step = None
            self.core.store_step(step)

    def _graph_forward(self, run: Callable[[], Any], step: StepContext | None, num_rows: int) -> Any:
        """Graph mode: steering rows into the static buffers, the (compiled) forward, then the
        step's captures and probe scores read out of the capture buffers."""
        assert self.graph is not None
        with timing.phase("graph steer rows"):
            self.graph.before_forward(step.plan if step is not None else None)
        with timing.phase("forward (queued)"):
            output = run()
        if step is not None:
            try:
                with timing.phase("graph read rows (queued)"):
                    for layer in step.plan.hooked_layers:
                        read_step(step, layer, self.graph.stream(layer, num_rows))
            except Exception as exc:  # noqa: BLE001 - reported to every lens request of the step
                logger.exception("lens_evals: reading the graph-mode buffers failed")
                step.fail_keys(step.plan.keys, f"graph-mode read failed: {type(exc).__name__}: {exc}")
            self.core.store_step(step)
        return output

    def _admit(self, req_id: str) -> None:
        extra = compat.worker.request_extra_args(self.runner, req_id)
        ledger = self.core.ledger
        if self.refusal is not None and extra and INTERNAL_KEY in extra:
            ledger.refuse(req_id, str(extra[INTERNAL_KEY].get("key", req_id)), self.refusal)
            return
        try:
            req = decode_worker_request(extra, self.core.device, self.core.dtype, self.hook_sets)
        except Exception as exc:  # noqa: BLE001 - any failure here is this request's (escaping, it wedged the engine)
            if not isinstance(exc, (ValueError, KeyError, TypeError, ImportError, AttributeError)):
                logger.exception("lens_evals: decoding lens request %s on the worker failed", req_id)
            key = str((extra or {}).get(INTERNAL_KEY, {}).get("key", req_id))
            ledger.refuse(req_id, key, f"could not decode lens request on the worker: {type(exc).__name__}: {exc}")
            return
        if req is not None:
            req.rows_at_most = compat.worker.request_rows_at_most(self.runner, req_id)
        ledger.track(req_id, req)

    def hook_context(self, call: HookCall, layer: int) -> HookContext:
        hook = call.hook
        return HookContext(
            saved=call.saved,
            layer_idx=layer,
            positions=call.positions,
            token_ids=call.token_ids,
            args=hook.args,
            pre=hook.pre,
            module_path=hook.module,
            model=self.model,
            hf_config=compat.worker.hf_config(self.runner),
            parameters=self.parameters,
        )


def get_state(runner: Any) -> LensWorkerState:
    state: LensWorkerState | None = getattr(runner, STATE_ATTR, None)
    if state is None:
        raise RuntimeError("lens_evals is not active in this worker (was the model loaded with the plugin?)")
    return state
