"""OpenAI-compatible server: an ASGI middleware adds each request's activations (and hook results)
to the JSON response, or as a final SSE chunk of a stream, in the encoding the request asked for
(``lens_evals.wire``; native dtype; never pickle); ``safetensors-frame`` turns a JSON response into
a binary frame (``lens_evals.wire.frame``; a stream's chunk stays JSON, base64). Bad lens input is rejected by the frontend
validation before the engine sees it (vLLM answers 400 with the reason)."""

from __future__ import annotations

import asyncio
import json
import logging
import re
from collections.abc import Awaitable, Callable
from typing import Any

import torch

from lens_evals.engine import compat
from lens_evals.engine.frontend import budget as frontend_budget
from lens_evals.engine.frontend import hook_set_store, self_check_run
from lens_evals.engine.frontend.attach import HTTP_HELD, HTTP_SINK, HttpResult, release_when_idle
from lens_evals.engine.frontend.hook_routes import (
    HOOK_SETS_PATH,
    UNAUTHORIZED,
    Message,
    Receive,
    Scope,
    Send,
    caller,
    error_body,
    json_only,
    reply,
    serve_hook_sets,
)
from lens_evals.engine.frontend.vllm_lens_api import HOOKS_PATH, serve_vllm_lens_hooks
from lens_evals.wire import formats as wire
from lens_evals.wire import frame as wire_frame
from lens_evals.wire.codec import Buffers

logger = logging.getLogger("lens_evals")
_TRAILING_INDEX = re.compile(r"-(\d+)$")


def encode_activations(activations: dict[str, Any], encoding: str = wire.DEFAULT_RESPONSE_ENCODING) -> dict[str, Any]:
    """Tensors as wire arrays in their native dtype; ``probe_scores`` (name -> tensor) as name ->
    wire array; ``saved`` (hook results) as an encoded tree."""
    encoded: dict[str, Any] = {}
    for name, value in activations.items():
        if name in ("saved", "readouts"):
            encoded[name] = wire.encode_tree(value, name, encoding=encoding)
        elif isinstance(value, torch.Tensor):
            encoded[name] = wire.encode_array(value, encoding)
        else:
            encoded[name] = {inner: wire.encode_array(t, encoding) for inner, t in value.items()}
    return encoded


def lens_fields(results: list[HttpResult], framed: bool = False) -> dict[str, Any]:
    """The response's ``activations`` and ``hook_results`` (one request: objects; several
    prompts: lists in prompt order); unless ``framed``, a frame's arrays as base64 text."""
    ordered = sorted(results, key=lambda item: _prompt_index(item.request_id))
    fields: dict[str, list[Any]] = {"activations": [], "hook_results": []}
    for result in ordered:
        encoding = wire.SAFETENSORS if result.encoding == wire.SAFETENSORS_FRAME and not framed else result.encoding
        fields["activations"].append(encode_activations(result.activations or {}, encoding))
        if result.hook_results is not None:
            fields["hook_results"].append(wire.encode_tree(result.hook_results, "hook_results", encoding=encoding))
    return {name: values[0] if len(values) == 1 else values for name, values in fields.items() if values}


def _error_body(results: list[HttpResult]) -> dict[str, Any] | None:
    errors = [f"{result.request_id}: {result.error}" for result in results if result.error is not None]
    if not errors:
        return None
    return {"error": {"message": "lens request failed in the engine: " + "; ".join(errors), "type": "LensRequestError", "code": 500}}


class LensResponseMiddleware:
    """Buffers non-streaming completion/chat responses that carried lens requests and adds
    ``"activations"`` (one request) or a list of them (several prompts, in prompt order).
    It also answers the lens routes (``/lens/...``, ``/v1/hooks/...``), each behind the server's
    API keys (vLLM's authentication guards only ``/v1``-like prefixes), JSON bodies only. It is
    the innermost middleware: the operator's ``--middleware`` and CORS see every request first."""

    def __init__(self, app: Callable[..., Awaitable[None]]) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        owner = caller(scope) if scope.get("type") == "http" else None
        if scope.get("type") == "http" and (path.startswith(HOOK_SETS_PATH) or path.startswith(HOOKS_PATH)):
            if owner is None:
                await reply(send, 401, UNAUTHORIZED)
                return
            if (refusal := json_only(scope)) is not None:
                await reply(send, 415, error_body(refusal, 415))
                return
            serve = serve_hook_sets if path.startswith(HOOK_SETS_PATH) else serve_vllm_lens_hooks
            await serve(scope, receive, send, owner)
            return
        if scope.get("type") == "http" and path == INFO_PATH:
            if owner is None:
                await reply(send, 401, UNAUTHORIZED)
                return
            await serve_info(scope, send)
            return
        # the request's own context (each ASGI request runs in a task of its own): admission
        # finds only this caller's hook sets (frontend.admit)
        hook_set_store.CALLER.set(hook_set_store.NOBODY if owner is None else owner)
        if scope.get("type") != "http" or scope.get("method") != "POST" or not scope.get("path", "").endswith("completions"):
            await self.app(scope, receive, send)
            return
        sink: list[HttpResult] = []
        token = HTTP_SINK.set(sink)
        held: list[int] = []  # what its results were charged until they are written (frontend_budget)
        held_token = HTTP_HELD.set(held)
        held_start: Message | None = None
        body_parts: list[bytes] = []
        passthrough = False
        streaming = False
        served_lens = False  # a response carried lens results (their tensors die once it is out)

        async def send_wrapper(message: Message) -> None:
            nonlocal held_start, passthrough, streaming, served_lens
            served_lens = served_lens or bool(sink)
            if streaming and message["type"] == "http.response.body":
                await send_in_pieces(send, (_stream_chunk(message.get("body", b""), sink),), bool(message.get("more_body")))
                return
            if passthrough:
                await send(message)
                return
            if message["type"] == "http.response.start":
                headers = dict(message.get("headers", []))
                content_type = headers.get(b"content-type", b"")
                if b"application/json" not in content_type:
                    streaming = b"text/event-stream" in content_type  # SSE: a final chunk is added
                    passthrough = True
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
            # in a worker thread: encoding a large capture (base64, JSON) would otherwise hold the
            # event loop, and with it every other request's response, for as long as it takes
            status, pieces, content_type = await asyncio.to_thread(_rewrite, held_start["status"], b"".join(body_parts), sink)
            replaced = {b"content-length"} | ({b"content-type"} if content_type else set())
            kept = [(k, v) for k, v in held_start.get("headers", []) if k.lower() not in replaced]
            kept.append((b"content-length", str(pieces.nbytes).encode()))
            if content_type:
                kept.append((b"content-type", content_type))
            await send({**held_start, "status": status, "headers": kept})
            # a frame's arrays go as they are, neither joined nor copied to bytes (a fresh 1.4 MB
            # copy costs ~0.5 ms in page faults): only uvicorn's protocol (uvloop / asyncio
            # transports take any buffer) and ServerErrorMiddleware (passes it on) see them
            await send_in_pieces(send, pieces, False)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            # the results' tensors die here, not when the last context copied during the request
            # does (a cancelled timer of vLLM's, per prompt, holds one until it would have fired)
            sink.clear()
            HTTP_SINK.reset(token)
            frontend_budget.RESPONSES.release(sum(held))
            HTTP_HELD.reset(held_token)
        if served_lens:
            release_when_idle(compat.frontend.engine_client_from_scope(scope))


INFO_PATH = "/lens/info"


async def serve_info(scope: Scope, send: Send) -> None:
    """``GET /lens/info``: the stream-contract self-check of the served model (run now if no lens
    request has run it yet): its numbers per checked layer, or why it was skipped or failed."""
    if scope.get("method") != "GET":
        await reply(send, 405, error_body("GET /lens/info", 405))
        return
    result = await self_check_run.ensure_checked_async(compat.frontend.engine_client_from_scope(scope))
    await reply(send, 200, {"self_check": None if result is None else result.to_json()})


SEND_PIECE = 1 << 20


async def send_in_pieces(send: Send, pieces: Any, more_body: bool) -> None:
    """A body as messages of at most ``SEND_PIECE`` bytes (views, not copies). The server waits
    for a slow client's socket before taking the next message, not after the last: sent whole, a
    large body would sit in its write buffer after our last send returned, so the charge of the
    response (``LENS_EVALS_MAX_RESPONSE_HELD_MIB``) would be given back before it was written."""
    views = [memoryview(piece) for piece in pieces] or [memoryview(b"")]
    slices = [view[at : at + SEND_PIECE] for view in views for at in range(0, max(len(view), 1), SEND_PIECE)]
    for i, piece in enumerate(slices):
        await send({"type": "http.response.body", "body": piece, "more_body": more_body or i < len(slices) - 1})


DONE = b"data: [DONE]"


def _done_event_at(body: bytes) -> int:
    """Where the stream's closing ``data: [DONE]`` event starts in ``body``, or -1. Only a whole
    event counts: one at the body's start or after an event's blank line, ending the body or
    followed by its own. The same bytes inside a chunk's JSON (generated or echoed text) are
    never an event boundary: JSON escapes newlines, so an event's text holds no blank line."""
    start = 0
    for event in body.split(b"\n\n"):
        if event.strip(b"\r\n") == DONE:
            return start + (len(event) - len(event.lstrip(b"\r\n")))
        start += len(event) + 2
    return -1


def _stream_chunk(body: bytes, sink: list[HttpResult]) -> bytes:
    """A stream's body: before the ``data: [DONE]`` event goes one more event with the
    requests' ``activations`` / ``hook_results`` (or the lens error)."""
    at = _done_event_at(body) if sink else -1
    if at < 0:
        return body
    results = list(sink)
    sink.clear()
    event = _error_body(results) or lens_fields(results)
    return body[:at] + b"data: " + wire.json_bytes(event) + b"\n\n" + body[at:]


def _rewrite(status: int, body: bytes, sink: list[HttpResult]) -> tuple[int, Buffers, bytes | None]:
    """(status, the body's pieces to send one after another, a new content type or None) of a
    response with lens results."""
    if not sink:
        return status, Buffers((body,)), None
    error = _error_body(sink)
    if error is not None:
        return 500, Buffers((json.dumps(error).encode(),)), None
    if status != 200:
        return status, Buffers((body,)), None
    try:
        data = json.loads(body)
    except json.JSONDecodeError:
        logger.error("lens_evals: could not parse a JSON response to add activations")
        return status, Buffers((body,)), None
    framed = any(result.encoding == wire.SAFETENSORS_FRAME for result in sink)
    data.update(lens_fields(sink, framed))
    if framed:
        return status, wire_frame.frame_bytes(data), wire_frame.CONTENT_TYPE.encode()
    return status, Buffers((wire.json_bytes(data),)), None


def _prompt_index(request_id: str) -> int:
    match = _TRAILING_INDEX.search(request_id)
    return int(match.group(1)) if match else 0
