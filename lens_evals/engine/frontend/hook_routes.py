"""HTTP endpoints for persistent hook sets, served by the lens middleware (plain ASGI, so the
same code runs on every vLLM version's app):

    POST   /lens/hook_sets              {"hooks": [registered hook JSON, ...]} -> {"id", "hooks"}
    POST   /lens/hook_sets/{id}/collect -> {"id", "results": [{"request_id", "saved"}], "refused"}
    DELETE /lens/hook_sets/{id}         -> {"id", "dropped_results"}

Only registered hooks (by name, JSON args) are accepted; bad input is a 400 with the reason,
an unknown id a 404, a set over LENS_EVALS_MAX_HOOK_SETS / LENS_EVALS_MAX_HOOK_SET_MIB a 429
saying which bound and how to free one. On a server started with ``--api-key`` (or
``VLLM_API_KEY``) every route needs ``Authorization: Bearer KEY`` like vLLM's ``/v1`` routes:
:func:`caller`, checked by the middleware before any lens route runs (vLLM's own check guards
only its ``/v1``-like prefixes); a set belongs to the key that made it (``hook_sets``). Bodies
are JSON only (:func:`json_only`: 415 otherwise), so a cross-origin "simple" request (text/plain,
a form) that a browser sends without a CORS preflight never reaches a route. The middleware runs
inside the operator's ``--middleware`` and vLLM's CORS (``compat.frontend.patch_http_app``).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from lens_evals.engine import compat
from lens_evals.engine.frontend import hook_set_store, hook_sets
from lens_evals.wire import formats as wire

logger = logging.getLogger("lens_evals")
# ASGI's callables, as Starlette hands them to a middleware
Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
HOOK_SETS_PATH = "/lens/hook_sets"
MAX_BODY_BYTES = 64 * 2**20
UNAUTHORIZED = {"error": "Unauthorized"}  # vLLM's own 401 body
JSON_TYPE = "application/json"


def _header(scope: dict[str, Any], wanted: bytes) -> bytes:
    return next((value for name, value in scope.get("headers", ()) if name.lower() == wanted), b"")


def caller(scope: dict[str, Any]) -> str | None:
    """Who sends the request, as the owner of the hook sets it makes: ``hook_set_store.SHARED_OWNER``
    without configured API keys, else the SHA-256 digest (hex) of the key that
    ``Authorization: Bearer`` carries; None when it carries none of them (read and compared as
    vLLM does: SHA-256 digests compared in constant time, every key checked)."""
    keys = compat.frontend.server_api_keys(scope)
    if not keys:
        return hook_set_store.SHARED_OWNER
    scheme, _, token = _header(scope, b"authorization").decode("latin-1").partition(" ")
    if scheme.lower() != "bearer":
        return None
    digest = hashlib.sha256(token.encode("utf-8")).digest()
    owner = None
    for key in keys:
        key_digest = hashlib.sha256(key.encode("utf-8")).digest()
        if hmac.compare_digest(digest, key_digest):
            owner = key_digest.hex()
    return owner


def authorized(scope: dict[str, Any]) -> bool:
    return caller(scope) is not None


def json_only(scope: dict[str, Any]) -> str | None:
    """Why the request's body is refused (HTTP 415), or None: a POST must say
    ``Content-Type: application/json``; a DELETE may carry no body type, or that one."""
    content_type = _header(scope, b"content-type").decode("latin-1")
    if content_type.partition(";")[0].strip().lower() == JSON_TYPE or (scope.get("method") == "DELETE" and not content_type):
        return None
    return f"the lens routes take JSON bodies only: send Content-Type: {JSON_TYPE} (got {content_type or 'none'!r})"


async def read_body(receive: Receive) -> bytes:
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


async def reply(send: Send, status: int, payload: dict[str, Any]) -> None:
    body = json.dumps(payload).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def error_body(message: str, status: int) -> dict[str, Any]:
    return {"error": {"message": message, "type": "LensHookSetError", "code": status}}


async def serve_hook_sets(scope: dict[str, Any], receive: Receive, send: Send, owner: str) -> None:
    method = scope.get("method")
    parts = [p for p in scope["path"][len(HOOK_SETS_PATH) :].split("/") if p]
    try:
        engine = compat.frontend.engine_client_from_scope(scope)
        await hook_sets.free_idle_async(engine)
        if method == "POST" and not parts:
            body = wire.json_loads(await read_body(receive) or b"{}")
            if not isinstance(body, dict) or set(body) != {"hooks"}:
                raise ValueError('the body must be {"hooks": [...]}')
            hooks = body["hooks"]
            if any(not isinstance(hook, (dict, str)) for hook in hooks if isinstance(hooks, list)):
                raise ValueError("hooks must be registered hooks in JSON form")
            await reply(send, 200, await hook_sets.register_async(engine, hooks, owner))
        elif method == "POST" and len(parts) == 2 and parts[1] == "collect":
            await reply(send, 200, hook_sets.union_view(hook_sets.collect_async(engine, parts[0], owner)))
        elif method == "DELETE" and len(parts) == 1:
            await reply(send, 200, await hook_sets.clear_async(engine, parts[0], owner))
        else:
            await reply(send, 404, error_body(f"no such endpoint: {method} {scope['path']}", 404))
    except hook_set_store.UnknownHookSet as exc:
        await reply(send, 404, error_body(str(exc.args[0]), 404))
    except hook_set_store.HookSetLimit as exc:
        await reply(send, 429, error_body(str(exc), 429))
    except ValueError as exc:  # json.JSONDecodeError and pydantic errors are ValueErrors
        await reply(send, 400, error_body(str(exc), 400))
