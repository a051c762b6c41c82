"""Entry point for ``vllm.general_plugins``: vLLM calls :func:`register` in every process it
starts (frontend, engine core, workers). Idempotent; ``LENS_EVALS_DISABLE=1`` (or vllm-lens's
``VLLM_LENS_DISABLE=1``; values 1/true/yes/on) makes it a no-op."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from lens_evals import settings

logger = logging.getLogger("lens_evals")


def enabled() -> bool:
    return settings.plugin_disabled_by() is None


def register() -> None:
    if logger.level == logging.NOTSET:
        # vLLM's API server sets the root logger to ERROR (its SageMaker logging module, unless
        # LOG_LEVEL says otherwise), which silenced our warnings there; a level set by the user stays
        logger.setLevel(logging.WARNING)
    if (off := settings.plugin_disabled_by()) is not None:
        logger.info("lens_evals: disabled by %s", off)
        return
    from lens_evals.engine import compat, frontend_admit, frontend_attach, graph_taps, http_middleware, vllm_lens_api
    from lens_evals.engine.worker_rpc import WORKER_METHODS
    from lens_evals.engine.worker_state import STATE_ATTR, LensWorkerState

    def on_load(runner: Any) -> None:
        setattr(runner, STATE_ATTR, LensWorkerState(runner))

    def on_step_start(runner: Any, scheduler_output: Any) -> None:
        state = getattr(runner, STATE_ATTR, None)
        if state is not None:
            state.on_step_start(scheduler_output)

    def around_forward(runner: Any, run: Callable[[], Any], input_ids: Any) -> Any:
        state = getattr(runner, STATE_ATTR, None)
        return run() if state is None else state.around_forward(run, input_ids)

    compat.prefer_v1_model_runner()
    compat.force_eager_unless(
        "layer hooks run only outside CUDA graphs and torch.compile", graph_taps.env_layer_spec, graph_taps.CONFIG_KEY
    )
    compat.patch_input_processor(frontend_admit.on_request)
    compat.patch_offline_submit(frontend_attach.release_offline)
    compat.patch_offline_results(frontend_attach.attach_offline)
    compat.patch_offline_aborts(frontend_attach.discard_offline)
    compat.shut_down_engines_at_exit()
    compat.give_engine_cores_their_teardown_time()
    compat.patch_async_results(frontend_attach.attach_async, frontend_attach.discard_async)
    compat.patch_model_runner(on_load, on_step_start, around_forward)
    compat.patch_http_app(http_middleware.add_middleware, http_middleware.MIDDLEWARE_PATH)
    compat.add_worker_methods(WORKER_METHODS)
    compat.add_offline_methods(vllm_lens_api.OFFLINE_METHODS)
    compat.use_grouped_lora_ops()
