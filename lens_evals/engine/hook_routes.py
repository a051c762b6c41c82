"""HTTP endpoints for persistent hook sets, served by the lens middleware (plain ASGI, so the
same code runs on every vLLM version's app):

    POST   /lens/hook_sets              {"hooks": [registered hook JSON, ...]} -> {"id", "hooks"}
    POST   /lens/hook_sets/{id}/collect -> {"id", "results": [{"request_id", "saved"}], "refused"}
    DELETE /lens/hook_sets/{id}         -> {"id", "dropped_results"}

Only registered hooks (by name, JSON args) are accepted; bad input is a 400 with the reason,
an unknown id a 404.
"""

from __future__ import annotations

import json
import logging
from typing import Any, Callable

from lens_evals.engine import compat, hook_sets

logger = logging.getLogger("lens_evals")
HOOK_SETS_PATH = "/lens/hook_sets"
MAX_BODY_BYTES = 64 * 2**20


async def _read_body(receive: Callable) -> bytes:
    parts, size = [], 0
    while True:
        message = await receive()
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise ValueError(f"request body over {MAX_BODY_BYTES // 2**20} MiB")
        parts.append(chunk)
        if not message.get("more_body"):
            return b"".join(parts)


async def _reply(send: Callable, status: int, payload: dict[str, Any]) -> None:
    body = json.dumps(payload).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def _error(message: str, status: int) -> dict[str, Any]:
    return {"error": {"message": message, "type": "LensHookSetError", "code": status}}


async def serve_hook_sets(scope: dict[str, Any], receive: Callable, send: Callable) -> None:
    method = scope.get("method")
    parts = [p for p in scope["path"][len(HOOK_SETS_PATH):].split("/") if p]
    try:
        engine = compat.engine_client_from_scope(scope)
        if method == "POST" and not parts:
            body = json.loads(await _read_body(receive) or b"{}")
            if not isinstance(body, dict) or set(body) != {"hooks"}:
                raise ValueError('the body must be {"hooks": [...]}')
            hooks = body["hooks"]
            if any(not isinstance(hook, (dict, str)) for hook in hooks if isinstance(hooks, list)):
                raise ValueError("hooks must be registered hooks in JSON form")
            await _reply(send, 200, await hook_sets.register_async(engine, hooks))
        elif method == "POST" and len(parts) == 2 and parts[1] == "collect":
            await _reply(send, 200, hook_sets.collect_async(engine, parts[0]))
        elif method == "DELETE" and len(parts) == 1:
            await _reply(send, 200, await hook_sets.clear_async(engine, parts[0]))
        else:
            await _reply(send, 404, _error(f"no such endpoint: {method} {scope['path']}", 404))
    except hook_sets.UnknownHookSet as exc:
        await _reply(send, 404, _error(str(exc.args[0]), 404))
    except ValueError as exc:  # json.JSONDecodeError and pydantic errors are ValueErrors
        await _reply(send, 400, _error(str(exc), 400))
