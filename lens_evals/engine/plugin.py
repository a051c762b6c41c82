"""Entry point for ``vllm.general_plugins``: vLLM calls :func:`register` in every process it
starts (frontend, engine core, workers). Idempotent; ``LENS_EVALS_DISABLE=1`` (or vllm-lens's
``VLLM_LENS_DISABLE=1``; values 1/true/yes/on) makes it a no-op.

Whether vLLM will load it at all (:func:`require_plugin`): vLLM finds general plugins by their
package's ``vllm.general_plugins`` entry point (so lens-evals must be *installed*, not only
importable from a source tree on ``PYTHONPATH``) and loads only those ``VLLM_PLUGINS`` names when
that variable is set. Without the plugin an engine serves every request as plain vLLM and a
lens request comes back without activations, steering or probe scores; the package's own engine
and server starters ask this first and refuse with what to do. Importing this module imports
neither vLLM nor torch."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable, Mapping
from importlib.metadata import entry_points
from typing import Any

from lens_evals import settings

logger = logging.getLogger("lens_evals")


def disabled_by(env: Mapping[str, str] | None = None) -> str | None:
    """The environment variable that turns the plugin off, if one does (in ``env``, default: this
    process's environment)."""
    for setting in (settings.DISABLE, settings.VLLM_LENS_DISABLE):
        if setting.get(env):
            return setting.name
    return None


def enabled() -> bool:
    return disabled_by() is None


def register() -> None:
    if logger.level == logging.NOTSET:
        # vLLM's API server sets the root logger to ERROR (its SageMaker logging module, unless
        # LOG_LEVEL says otherwise), which silenced our warnings there; a level set by the user stays
        logger.setLevel(logging.WARNING)
    if (off := disabled_by()) is not None:
        logger.info("lens_evals: disabled by %s", off)
        return
    from lens_evals.engine import compat
    from lens_evals.engine.frontend import admit as frontend_admit
    from lens_evals.engine.frontend import attach as frontend_attach
    from lens_evals.engine.frontend import budget as frontend_budget
    from lens_evals.engine.frontend import http_middleware, self_check_run, vllm_lens_api
    from lens_evals.engine.transport import graph_layers
    from lens_evals.engine.worker.rpc import WORKER_METHODS
    from lens_evals.engine.worker.state import STATE_ATTR, LensWorkerState

    def on_load(runner: Any) -> None:
        setattr(runner, STATE_ATTR, LensWorkerState(runner))

    def on_step_start(runner: Any, scheduler_output: Any) -> None:
        state = getattr(runner, STATE_ATTR, None)
        if state is not None:
            state.on_step_start(scheduler_output)

    def around_forward(runner: Any, run: Callable[[], Any], input_ids: Any) -> Any:
        state = getattr(runner, STATE_ATTR, None)
        return run() if state is None else state.around_forward(run, input_ids)

    compat.frontend.prefer_v1_model_runner()
    compat.frontend.force_eager_unless(
        "layer hooks run only outside CUDA graphs and torch.compile", graph_layers.env_layer_spec, graph_layers.CONFIG_KEY
    )
    compat.admission.patch_input_processor(frontend_admit.on_request)
    compat.admission.patch_request_id_assignment(frontend_admit.on_assigned)
    compat.frontend.patch_offline_submit(self_check_run.before_offline_call(frontend_attach.release_offline))
    compat.frontend.patch_offline_results(frontend_attach.attach_offline)
    compat.frontend.patch_offline_aborts(frontend_attach.discard_offline)
    compat.frontend.shut_down_engines_at_exit(then=self_check_run.ensure_offline)
    compat.frontend.give_engine_cores_their_teardown_time()
    compat.frontend.patch_async_results(
        frontend_admit.open_call, frontend_attach.attach_async, frontend_attach.discard_async, before=self_check_run.before_async_request
    )
    compat.worker.patch_model_runner(on_load, on_step_start, around_forward)
    compat.worker.reserve_lens_memory(frontend_budget.reserved_bytes)
    compat.frontend.patch_http_app(http_middleware.LensResponseMiddleware)
    compat.rpc.add_worker_methods(WORKER_METHODS)
    compat.rpc.add_offline_methods(vllm_lens_api.OFFLINE_METHODS)
    compat.lora.use_grouped_lora_ops()


PLUGIN_GROUP = "vllm.general_plugins"
PLUGIN_NAME = "lens_evals"
PLUGIN_TARGET = "lens_evals.engine.plugin:register"


class PluginNotLoadable(RuntimeError):
    """vLLM would start this engine without the lens-evals plugin."""


def installed_plugins() -> list[tuple[str, str]]:
    """(name, target) of every ``vllm.general_plugins`` entry point of this Python environment."""
    return [(entry.name, entry.value) for entry in entry_points(group=PLUGIN_GROUP)]


def plugin_load_problem(plugins: Iterable[tuple[str, str]], allowed: str | None) -> str | None:
    """Why vLLM would not load our plugin, given the environment's entry points and
    ``VLLM_PLUGINS`` (``allowed``: comma-separated names, or None when unset), or None."""
    if not any(name == PLUGIN_NAME and target == PLUGIN_TARGET for name, target in plugins):
        return (
            f"the lens-evals vLLM plugin is not installed in this Python environment (no {PLUGIN_GROUP!r} entry point "
            f"{PLUGIN_NAME} = {PLUGIN_TARGET}; importing lens_evals from a source tree on PYTHONPATH does not register it): "
            "install the package (`pip install -e .` in the repository, or `pip install --target DIR .` with DIR on PYTHONPATH)"
        )
    if allowed is not None and PLUGIN_NAME not in {name.strip() for name in allowed.split(",")}:
        return f"VLLM_PLUGINS={allowed!r} leaves out the lens-evals plugin: add {PLUGIN_NAME} to it, or unset it"
    return None


def require_plugin(env: Mapping[str, str] | None = None) -> None:
    """Raise :class:`PluginNotLoadable` if vLLM, started with ``env`` (default: this process's
    environment), would not load our plugin; nothing when the plugin is turned off on purpose
    (``LENS_EVALS_DISABLE``): then plain vLLM is what was asked for."""
    env = os.environ if env is None else env
    if disabled_by(env) is not None:
        return
    problem = plugin_load_problem(installed_plugins(), env.get("VLLM_PLUGINS"))
    if problem is not None:
        raise PluginNotLoadable(f"lens_evals: {problem}. Without it, lens requests would come back without activations.")
