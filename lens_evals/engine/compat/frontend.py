"""vLLM internals on the frontend side: engine args, request validation hook, offline / async
result delivery, the HTTP app, collective_rpc and worker methods."""

from __future__ import annotations

import atexit
import inspect
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from lens_evals.engine.compat._base import Method, _patch, logger

__all__ = [
    "ENGINE_TEARDOWN_MARGIN_S",
    "add_innermost_middleware",
    "async_tokenizer",
    "engine_client_from_scope",
    "engine_refusal",
    "force_eager_unless",
    "give_engine_cores_their_teardown_time",
    "LENS_STATE_ATTR",
    "input_processor",
    "lens_state",
    "patch_async_results",
    "patch_http_app",
    "patch_offline_aborts",
    "patch_offline_results",
    "patch_offline_submit",
    "prefer_v1_model_runner",
    "server_api_keys",
    "shut_down_engines_at_exit",
    "step_limits",
]


def step_limits(vllm_config: Any) -> tuple[int, int]:
    """(bytes per activation element in the model's dtype, the most tokens one step runs)."""
    dtype = vllm_config.model_config.dtype
    return int(getattr(dtype, "itemsize", 4)), int(vllm_config.scheduler_config.max_num_batched_tokens)


def patch_offline_submit(before: Callable[[Any], None]) -> None:
    """Call ``before(llm)`` as an offline call (``LLM.generate``, ``chat``, ``enqueue``...)
    starts adding its requests, before the engine core sees any of them."""
    from vllm.entrypoints.llm import LLM

    def make(original: Method) -> Method:
        def _render_and_add_requests(self: Any, *args: Any, **kwargs: Any) -> Any:
            before(self)
            return original(self, *args, **kwargs)

        return _render_and_add_requests

    _patch(LLM, "_render_and_add_requests", make)


def patch_offline_results(attach: Callable[[Any, list[Any]], None]) -> None:
    """After ``LLM.generate`` / ``LLM.chat`` finish, call ``attach(llm, outputs)``."""
    from vllm.entrypoints.llm import LLM

    def make(original: Method) -> Method:
        def _run_engine(self: Any, *args: Any, **kwargs: Any) -> Any:
            outputs = original(self, *args, **kwargs)
            attach(self, outputs)
            return outputs

        return _run_engine

    _patch(LLM, "_run_engine", make)


_open_engine_cores: weakref.WeakSet[Any] = weakref.WeakSet()


def shut_down_engines_at_exit(then: Callable[[Any], None] | None = None) -> None:
    """``then(llm)`` at the end of every offline ``LLM.__init__`` (the engine is built). At exit, shut down every offline ``LLM``'s engine core still open, as ``shutdown()`` would.
    vLLM's own exit path only kills the engine-core process, which then never unlinks its
    executor's shared-memory ring (``MultiprocExecutor.rpc_broadcast_mq``): the resource tracker
    warns of a leaked ``shared_memory`` object and the segment stays in /dev/shm. Our hook is
    registered after vLLM's ``weakref.finalize`` exit hook, so it runs first."""
    from vllm.entrypoints.llm import LLM

    def make(original: Method) -> Method:
        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            original(self, *args, **kwargs)
            if not _open_engine_cores:
                atexit.unregister(_shut_down_open_engines)
                atexit.register(_shut_down_open_engines)  # after vLLM's exit hooks: runs before them
            _open_engine_cores.add(self.llm_engine.engine_core)
            if then is not None:
                then(self)

        return __init__

    _patch(LLM, "__init__", make)


# Seconds an engine core is given past its own waits for its workers before it is killed
ENGINE_TEARDOWN_MARGIN_S = 20.0


def give_engine_cores_their_teardown_time() -> None:
    """vLLM's engine core waits ``VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS`` for its workers to exit,
    4 s more after SIGTERM, and only then unlinks its executor's shared-memory ring; but the
    frontend's process manager kills the engine core after 5 s when no timeout is given (every
    ``shutdown()`` without one, and the finalizer of an ``LLM`` that is garbage-collected). On a
    loaded host the workers take longer than that, so the ring leaked (tests/engine/test_shm_cleanup.py).
    With no timeout given, the engine core now gets its own waits plus a margin (it is waited for
    only as long as it runs); an explicit timeout is kept."""
    from vllm import envs
    from vllm.v1.engine import utils as engine_utils

    def make(original: Method) -> Method:
        def shutdown(procs: Any, timeout: float | None = None) -> None:
            if timeout is None:
                timeout = float(envs.VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS) + 4.0 + ENGINE_TEARDOWN_MARGIN_S
            original(procs, timeout=timeout)

        return shutdown

    _patch(engine_utils, "shutdown", make)


def _shut_down_open_engines() -> None:
    for core in list(_open_engine_cores):
        try:
            core.shutdown()
        except Exception as exc:  # at exit: report and go on with the other engines
            logger.warning("lens_evals: shutting down an engine at exit failed: %s", exc)


def patch_async_results(
    open_call: Callable[[str], Any],
    attach: Callable[[Any, Any, int, Any], Any],
    discard: Callable[[Any, Any], Any],
    before: Callable[[Any, Any], Awaitable[Any]] | None = None,
) -> None:
    """Wrap ``AsyncLLM.generate``: ``await before(engine, sampling_params)`` first (if given),
    then ``call = open_call(request_id)`` before the request is added,
    in this call's context (so the request vLLM adds for it can be bound to this call and to no
    other call with the same client id); ``await attach(engine, output, generated, call)`` on
    the final output
    (``generated``: its number of generated tokens, counted over the stream when the outputs are
    deltas); ``await discard(engine, call)`` when the request ends without one."""
    from vllm.sampling_params import RequestOutputKind
    from vllm.v1.engine.async_llm import AsyncLLM

    def make(original: Method) -> Method:
        async def generate(self: Any, prompt: Any, sampling_params: Any, request_id: str, *args: Any, **kwargs: Any) -> AsyncIterator[Any]:
            if before is not None:
                await before(self, sampling_params)
            delivered = False
            delta = getattr(sampling_params, "output_kind", None) == RequestOutputKind.DELTA
            generated = 0
            call = open_call(request_id)
            try:
                async for output in original(self, prompt, sampling_params, request_id, *args, **kwargs):
                    tokens = len(output.outputs[0].token_ids) if output.outputs else 0
                    generated = generated + tokens if delta else tokens
                    if output.finished:
                        await attach(self, output, generated, call)
                        delivered = True
                    yield output
            finally:
                if not delivered:
                    await discard(self, call)

        return generate

    _patch(AsyncLLM, "generate", make)


def patch_offline_aborts(discard: Callable[[Any, list[str]], None]) -> None:
    """After ``LLMEngine.abort_request`` (an offline ``LLM`` call aborts the requests it added
    when a later one is refused), ``discard(engine, request_ids)`` with the ids the input
    processor saw (vLLM 0.32 aborts by its internal ids: their external ids are looked up)."""
    from vllm.v1.engine.llm_engine import LLMEngine

    def make(original: Method) -> Method:
        def abort_request(self: Any, request_ids: Any, *args: Any, **kwargs: Any) -> Any:
            ids = list(request_ids)
            states = getattr(getattr(self, "output_processor", None), "request_states", {})
            external = [getattr(states.get(request_id), "external_req_id", None) for request_id in ids]
            try:
                return original(self, ids, *args, **kwargs)
            finally:
                discard(self, ids + [request_id for request_id in external if request_id is not None])

        return abort_request

    _patch(LLMEngine, "abort_request", make)


def input_processor(engine: Any) -> Any:
    """The engine's input processor (offline ``LLMEngine`` = ``LLM.llm_engine``, or ``AsyncLLM``),
    which holds the frontend's per-engine lens state (:func:`lens_state`)."""
    return engine.input_processor


LENS_STATE_ATTR = "_lens_evals_frontend"  # on the input processor: the frontend's lens state
State = TypeVar("State")


def lens_state(processor: Any, make: Callable[[Any], State]) -> State:
    """The lens state attached to an input processor, made by ``make(processor)`` at first use
    (one attribute of ours on vLLM's object; the event loop / the offline engine's own thread
    are its only users, so no lock)."""
    state: State | None = getattr(processor, LENS_STATE_ATTR, None)
    if state is None:
        state = make(processor)
        setattr(processor, LENS_STATE_ATTR, state)
    return state


async def async_tokenizer(engine: Any) -> Any:
    """An ``AsyncLLM``'s tokenizer (``get_tokenizer`` is a coroutine in vLLM 0.26, plain in 0.32)."""
    tokenizer = engine.get_tokenizer()
    return await tokenizer if inspect.isawaitable(tokenizer) else tokenizer


def force_eager_unless(reason: str, graph_layers: Callable[[], Any], config_key: str) -> None:
    """Forward hooks run only outside CUDA graphs / torch.compile: force enforce_eager, unless
    graph mode is asked for (``graph_layers()`` not None, or ``additional_config[config_key]``
    already names graph layers). The env setting is copied into ``additional_config``, which
    vLLM hashes into its compile cache key and sends to every worker."""
    from vllm.engine.arg_utils import EngineArgs

    def make(original: Method) -> Method:
        def create_engine_config(self: Any, *args: Any, **kwargs: Any) -> Any:
            extra = dict(self.additional_config or {}) if isinstance(self.additional_config, dict) else None
            section = dict((extra or {}).get(config_key) or {})
            from_env = graph_layers()
            if extra is not None and section.get("graph_layers") is None and from_env is not None:
                section["graph_layers"] = from_env
                extra[config_key] = section
                self.additional_config = extra
            if section.get("graph_layers") is not None:
                logger.info("lens_evals: graph mode (layers %s): torch.compile / CUDA graphs as configured", section["graph_layers"])
            elif not self.enforce_eager:
                logger.info("lens_evals: enforce_eager=True (%s); set LENS_EVALS_DISABLE=1 to opt out", reason)
                self.enforce_eager = True
            return original(self, *args, **kwargs)

        return create_engine_config

    _patch(EngineArgs, "create_engine_config", make)


def engine_refusal(vllm_config: Any) -> str | None:
    """Why this engine's configuration takes no lens requests: the plugin's patches reach only
    vLLM's V1 model runner, and speculative decoding runs draft rows the taps would count as the
    request's own. Plain requests are served either way."""
    if getattr(vllm_config, "use_v2_model_runner", False):
        return (
            "lens requests need vLLM's V1 model runner and this engine runs Model Runner V2 "
            "(VLLM_USE_V2_MODEL_RUNNER=1): start it with VLLM_USE_V2_MODEL_RUNNER=0"
        )
    if getattr(vllm_config, "speculative_config", None) is not None:
        return (
            "lens requests are not supported with speculative decoding (draft tokens would be captured "
            "and steered as the request's own): start the engine without speculative_config"
        )
    return None


def prefer_v1_model_runner() -> None:
    """vLLM 0.26 on GPU picks "Model Runner V2" for Llama-like models; our taps plan each step
    from the V1 runner's input batch. Ask for V1 unless the user chose explicitly."""
    import os

    if os.environ.get("VLLM_USE_V2_MODEL_RUNNER") is None:
        os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0"
        logger.info("lens_evals: VLLM_USE_V2_MODEL_RUNNER=0 (the plugin plans steps from the V1 model runner)")


def add_innermost_middleware(app: Any, middleware_class: Callable[[Any], Any]) -> None:
    """Put ``middleware_class`` inside every middleware the app has or gets: Starlette builds
    its stack from ``user_middleware`` (index 0 outermost; ``add_middleware`` inserts there), so
    the last entry wraps only the router. The operator's ``--middleware``, vLLM's CORS and
    authentication, and whatever is added later all run before it.

    Starlette builds the stack at the first request, unless someone built it before: vLLM 0.26's
    ``build_app`` ends with the SageMaker standards' bootstrap, which rebuilds it at once
    (model_hosting_container_standards: ``app.middleware_stack = app.build_middleware_stack()``).
    Then the stack is built again here, with this middleware in it."""
    from starlette.middleware import Middleware

    app.user_middleware.append(Middleware(middleware_class))
    if getattr(app, "middleware_stack", None) is not None:
        app.middleware_stack = app.build_middleware_stack()


def patch_http_app(middleware_class: Callable[[Any], Any]) -> None:
    """Add our ASGI middleware to the OpenAI-compatible server's app, innermost
    (:func:`add_innermost_middleware`): the lens routes it answers see a request only after the
    operator's ``--middleware`` and CORS (``--allowed-origins``) have."""
    import sys

    try:  # vLLM >= 0.30: build_app lives in vllm.entrypoints.launchers.app
        from vllm.entrypoints.launchers import app as app_module

        def make(original: Method) -> Method:
            def init_entrypoints_middleware(args: Any, app: Any, *rest: Any, **kwargs: Any) -> Any:
                result = original(args, app, *rest, **kwargs)
                add_innermost_middleware(app, middleware_class)
                return result

            return init_entrypoints_middleware

        _patch(app_module, "init_entrypoints_middleware", make)
        return
    except ImportError:
        pass  # no app module with that hook: vLLM 0.26, below
    from vllm.entrypoints.openai import api_server  # vLLM 0.26: build_app adds every middleware

    def make_build(original: Method) -> Method:
        def build_app(args: Any, *rest: Any, **kwargs: Any) -> Any:
            app = original(args, *rest, **kwargs)
            add_innermost_middleware(app, middleware_class)
            return app

        return build_app

    _patch(api_server, "build_app", make_build)
    main = sys.modules.get("__main__")  # `python -m vllm.entrypoints.openai.api_server`
    if main is not None and getattr(getattr(main, "__spec__", None), "name", None) == api_server.__name__:
        _patch(main, "build_app", make_build)


def engine_client_from_scope(scope: dict[str, Any]) -> Any:
    """The server's AsyncLLM, from an ASGI scope of vLLM's OpenAI-compatible app."""
    app = scope.get("app")
    engine = getattr(getattr(app, "state", None), "engine_client", None)
    if engine is None:
        raise RuntimeError("lens_evals: no engine client on this app")
    return engine


def server_api_keys(scope: dict[str, Any]) -> list[str]:
    """The API keys vLLM's OpenAI-compatible server requires (empty: no authentication), read
    as vLLM reads them (0.26 ``build_app``, 0.32 ``init_entrypoints_middleware``): the
    ``--api-key`` list, kept on ``app.state.args``, else the ``VLLM_API_KEY`` environment
    variable; empty keys ignored. vLLM's own check guards only ``/v1``, ``/v2``, ``/inference``
    (and ``/cohere`` in 0.32), so the lens routes check these keys themselves."""
    from vllm import envs

    args = getattr(getattr(scope.get("app"), "state", None), "args", None)
    keys = getattr(args, "api_key", None) or [envs.VLLM_API_KEY]
    if isinstance(keys, str):
        keys = [keys]
    return [key for key in keys if key]
