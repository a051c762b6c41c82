"""vllm-lens's persistent-hook API under its own names, built on our hook sets (``hook_sets``).

Offline (methods added to ``vllm.LLM``): ``register_hooks(hooks)`` (appends, like vllm-lens),
``collect_hook_results()`` -> ``{request_id: {hook_index: saved}}`` (does not drain),
``clear_hook_results()``, ``clear_hooks()``, and ``prefetch_params`` / ``clear_prefetched``
(accepted; ``ctx.get_parameter`` gathers a parameter on first use here). The hooks apply to every
later request of that ``LLM``: the object is its holder's alone.

HTTP (``/v1/hooks/...``, behind the server's API keys): ``register`` makes a hook set and answers
its ``id``; ONLY requests that send ``vllm_xargs={"use_hook_set": id}`` run it (a shared server
never applies one user's hooks to another's requests); ``collect``, ``clear_results`` and
``clear`` take ``{"id": ...}``. Hooks are registered hooks by name (JSON); a cloudpickled
function is refused with a 400 that says how to register one by name.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from lens_evals.engine import compat
from lens_evals.engine.frontend import hook_set_store, hook_sets
from lens_evals.engine.frontend.hook_routes import Receive, Send, error_body, read_body, reply
from lens_evals.engine.frontend.state import frontend_state
from lens_evals.request.hooks import Hook
from lens_evals.wire import formats as wire

HOOKS_PATH = "/v1/hooks"
STATE_ATTR = "_lens_evals_persistent_hooks"
NEEDS_ID = (
    'name the hook set: {"id": "<the id POST /v1/hooks/register answered>"}; lens-evals keeps each '
    "registration's hooks and results to the holder of its id (see docs/vllm_lens.md)"
)


# --------------------------------------------------------------------------- offline
@dataclass
class _Persistent:
    """An LLM's registered hooks: one hook set (all hooks so far) and the results taken out of it."""

    hooks: list[Any] = field(default_factory=list)
    hook_set: hook_sets.HookSet | None = None
    results: dict[str, dict[str, Any]] = field(default_factory=dict)

    def drain(self) -> None:
        if self.hook_set is not None:
            for result in self.hook_set.collect()["results"]:
                self.results[result["request_id"]] = result["hook_results"]


def _state(llm: Any) -> _Persistent:
    if not hasattr(llm, STATE_ATTR):
        setattr(llm, STATE_ATTR, _Persistent())
    state: _Persistent = getattr(llm, STATE_ATTR)
    return state


def _set_auto(llm: Any, set_id: str | None) -> None:
    frontend_state(compat.frontend.input_processor(llm.llm_engine)).hook_sets.auto_set = set_id


def register_hooks(llm: Any, hooks: Sequence[Any], prefetch_params: Sequence[str] | None = None) -> None:
    """Add hooks that run on every later request of this LLM (their results: ``collect_hook_results``)."""
    state = _state(llm)
    combined = [*state.hooks, *hooks]
    new_set = hook_sets.register_hook_set(llm, combined)  # validated before the old set goes
    state.drain()
    if state.hook_set is not None:
        state.hook_set.clear()
    state.hooks, state.hook_set = combined, new_set
    _set_auto(llm, new_set.id)


def collect_hook_results(llm: Any) -> dict[str, dict[str, Any]]:
    """``{request_id: {hook_index: saved}}`` of every request since the last clear (kept)."""
    state = _state(llm)
    state.drain()
    return {request_id: dict(per_hook) for request_id, per_hook in state.results.items()}


def clear_hook_results(llm: Any) -> None:
    state = _state(llm)
    state.drain()
    state.results.clear()


def clear_hooks(llm: Any) -> None:
    state = _state(llm)
    if state.hook_set is not None:
        state.hook_set.clear()
    _set_auto(llm, None)
    setattr(llm, STATE_ATTR, _Persistent())


def prefetch_params(llm: Any, names: Sequence[str]) -> None:
    """Accepted for vllm-lens code; parameters are gathered on first ``ctx.get_parameter``."""
    _param_names(names)


def clear_prefetched(llm: Any) -> None:
    """Accepted for vllm-lens code (nothing is prefetched here)."""


OFFLINE_METHODS: dict[str, Callable[..., Any]] = {
    "register_hooks": register_hooks,
    "collect_hook_results": collect_hook_results,
    "clear_hook_results": clear_hook_results,
    "clear_hooks": clear_hooks,
    "prefetch_params": prefetch_params,
    "clear_prefetched": clear_prefetched,
}


def _param_names(names: Any) -> list[str]:
    if not isinstance(names, list) or any(not isinstance(name, str) for name in names):
        raise ValueError("'params' must be a list of parameter names")
    return names


# --------------------------------------------------------------------------- HTTP
def _set_id(body: dict[str, Any]) -> str:
    set_id = body.get("id")
    if not isinstance(set_id, str):
        raise ValueError(NEEDS_ID)
    return set_id


def _encoded_results(collected: dict[str, Any], encoding: str) -> dict[str, Any]:
    """{request_id: {hook_index: saved}} re-encoded in the asked-for encoding."""
    return {
        result["request_id"]: wire.encode_tree(wire.decode_tree_native(result["hook_results"]), "results", encoding=encoding)
        for result in collected["results"]
    }


async def serve_vllm_lens_hooks(scope: dict[str, Any], receive: Receive, send: Send, owner: str) -> None:
    action = scope["path"][len(HOOKS_PATH) :].strip("/")
    try:
        if scope.get("method") != "POST":
            raise LookupError(f"no such endpoint: {scope.get('method')} {scope['path']}")
        engine = compat.frontend.engine_client_from_scope(scope)
        await hook_sets.free_idle_async(engine)
        body = wire.json_loads(await read_body(receive) or b"{}")
        if not isinstance(body, dict):
            raise ValueError("the request body must be a JSON object")
        store = frontend_state(compat.frontend.input_processor(engine)).hook_sets
        if action == "register":
            hooks = body.get("hooks")
            if not isinstance(hooks, list) or any(not isinstance(hook, dict) for hook in hooks):
                raise ValueError("'hooks' must be a list of objects (registered hooks by name)")
            made = await hook_sets.register_async(engine, [Hook.from_wire(hook) for hook in hooks], owner)
            await reply(send, 200, {"status": "ok", "count": len(hooks), "id": made["id"]})
        elif action == "collect":
            encoding = body.get("encoding", wire.VLLM_LENS)
            if encoding not in wire.JSON_ENCODINGS:
                raise ValueError(f"encoding must be one of {', '.join(wire.JSON_ENCODINGS)}")
            await reply(send, 200, {"results": _encoded_results(store.peek(_set_id(body), owner), encoding)})
        elif action == "clear_results":
            store.collect(_set_id(body), owner)
            await reply(send, 200, {"status": "ok"})
        elif action == "clear":
            await hook_sets.clear_async(engine, _set_id(body), owner)
            await reply(send, 200, {"status": "ok"})
        elif action == "prefetch":
            await reply(send, 200, {"status": "ok", "params": _param_names(body.get("params"))})
        elif action == "clear_prefetched":
            await reply(send, 200, {"status": "ok"})
        else:
            raise LookupError(f"no such endpoint: POST {scope['path']}")
    except hook_set_store.UnknownHookSet as exc:
        await reply(send, 404, error_body(str(exc.args[0]), 404))
    except LookupError as exc:
        await reply(send, 404, error_body(str(exc), 404))
    except hook_set_store.HookSetLimit as exc:
        await reply(send, 429, error_body(str(exc), 429))
    except ValueError as exc:
        await reply(send, 400, error_body(str(exc), 400))
