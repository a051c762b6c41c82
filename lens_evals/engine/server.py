"""OpenAI-compatible server: an ASGI middleware adds each request's activations to the JSON
response (safetensors + base64, float32; never pickle). Bad lens input is rejected by the
frontend validation before the engine sees it (vLLM answers 400 with the reason)."""

from __future__ import annotations

import json
import logging
import re
from typing import Any, Awaitable, Callable

import torch

from lens_evals import wire
from lens_evals.engine.frontend import HTTP_SINK
from lens_evals.engine.hook_routes import HOOK_SETS_PATH, UNAUTHORIZED, authorized, reply, serve_hook_sets

logger = logging.getLogger("lens_evals")
Scope = dict[str, Any]
Message = dict[str, Any]
_TRAILING_INDEX = re.compile(r"-(\d+)$")
MIDDLEWARE_PATH = "lens_evals.engine.server.LensResponseMiddleware"


def add_middleware(app: Any) -> None:
    app.add_middleware(LensResponseMiddleware)


def encode_activations(activations: dict[str, Any]) -> dict[str, Any]:
    """Tensors as float32 wire arrays; ``probe_scores`` (name -> tensor) as name -> wire array;
    ``saved`` (hook results) as an encoded tree (arrays keep their dtype)."""
    encoded: dict[str, Any] = {}
    for name, value in activations.items():
        if name == "saved":
            encoded[name] = wire.encode_tree(value, "saved")
        elif isinstance(value, torch.Tensor):
            encoded[name] = wire.encode_array(value.float().numpy())
        else:
            encoded[name] = {inner: wire.encode_array(t.float().numpy()) for inner, t in value.items()}
    return encoded


class LensResponseMiddleware:
    """Buffers non-streaming completion/chat responses that carried lens requests and adds
    ``"activations"`` (one request) or a list of them (several prompts, in prompt order).
    It also answers the lens routes (``/lens/...``), each behind the server's API keys: it runs
    outside vLLM's authentication, which guards only ``/v1``-like prefixes anyway."""

    def __init__(self, app: Callable[..., Awaitable[None]]) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Callable, send: Callable) -> None:
        if scope.get("type") == "http" and scope.get("path", "").startswith(HOOK_SETS_PATH):
            if not authorized(scope):
                await reply(send, 401, UNAUTHORIZED)
                return
            await serve_hook_sets(scope, receive, send)
            return
        if scope.get("type") != "http" or scope.get("method") != "POST" or not scope.get("path", "").endswith("completions"):
            await self.app(scope, receive, send)
            return
        sink: list[tuple[str, Any]] = []
        token = HTTP_SINK.set(sink)
        held_start: Message | None = None
        body_parts: list[bytes] = []
        passthrough = False

        async def send_wrapper(message: Message) -> None:
            nonlocal held_start, passthrough
            if passthrough:
                await send(message)
                return
            if message["type"] == "http.response.start":
                headers = dict(message.get("headers", []))
                if b"application/json" not in headers.get(b"content-type", b""):
                    passthrough = True  # streaming (SSE) responses go through untouched
                    await send(message)
                    return
                held_start = message
                return
            if message["type"] != "http.response.body" or held_start is None:
                await send(message)
                return
            body_parts.append(message.get("body", b""))
            if message.get("more_body"):
                return
            status, body = _rewrite(held_start["status"], b"".join(body_parts), sink)
            headers = [(k, v) for k, v in held_start.get("headers", []) if k.lower() != b"content-length"]
            headers.append((b"content-length", str(len(body)).encode()))
            await send({**held_start, "status": status, "headers": headers})
            await send({"type": "http.response.body", "body": body})

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            HTTP_SINK.reset(token)


def _rewrite(status: int, body: bytes, sink: list[tuple[str, Any]]) -> tuple[int, bytes]:
    if not sink:
        return status, body
    errors = [f"{rid}: {res}" for rid, res in sink if isinstance(res, str)]
    if errors:
        message = "lens request failed in the engine: " + "; ".join(errors)
        error = {"error": {"message": message, "type": "LensRequestError", "code": 500}}
        return 500, json.dumps(error).encode()
    if status != 200:
        return status, body
    try:
        data = json.loads(body)
    except json.JSONDecodeError:
        logger.error("lens_evals: could not parse a JSON response to add activations")
        return status, body
    ordered = sorted(sink, key=lambda item: _prompt_index(item[0]))
    encoded = [encode_activations(res) for _, res in ordered]
    data["activations"] = encoded[0] if len(encoded) == 1 else encoded
    return status, json.dumps(data).encode()


def _prompt_index(request_id: str) -> int:
    match = _TRAILING_INDEX.search(request_id)
    return int(match.group(1)) if match else 0
