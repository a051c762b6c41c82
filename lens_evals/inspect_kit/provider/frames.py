"""Binary-frame responses for the Inspect provider.

A lens server answers a request that asks for ``activations_encoding: "safetensors-frame"`` with a
binary frame (``lens_evals.wire.frame``): the JSON response with the arrays' bytes after it, no
base64 on either side (over HTTP on an H100 the frame took a 1,000-prompt capture from 2.7x to
1.05x the offline time; docs/benchmarks.md). Inspect's provider reads responses through the
OpenAI SDK, which parses JSON only. So the provider's HTTP client gets :func:`frame_responses`
around Inspect's own transport: a frame response becomes the JSON the SDK expects, with each lens
field (``activations``, ``hook_results``) replaced by a small reference, and the provider takes
the real field back with :func:`take` (its arrays' bytes stay where they were read; nothing is
unpickled or executed). Other responses pass untouched.
"""

from __future__ import annotations

import itertools
import json
from collections import OrderedDict
from typing import Any

from lens_evals.inspect_kit.provider.outputs import ACTIVATIONS_KEY, HOOK_RESULTS_KEY
from lens_evals.wire import frame as wire_frame

FRAME_REF = "lens_evals_frame"  # {FRAME_REF: n}: where a frame's lens field waits for the provider
MAX_WAITING = 1024  # fields read but never taken (a response the SDK then refused): the oldest go
_waiting: OrderedDict[int, Any] = OrderedDict()
_numbers = itertools.count()
frames_read = 0  # responses that came as frames (tests read it)


def _keep(value: Any) -> dict[str, int]:
    number = next(_numbers)
    _waiting[number] = value
    while len(_waiting) > MAX_WAITING:
        _waiting.popitem(last=False)
    return {FRAME_REF: number}


def take(value: Any) -> Any:
    """A lens field as the server sent it: ``value`` itself, or what a frame carried in its place."""
    if not (isinstance(value, dict) and set(value) == {FRAME_REF}):
        return value
    try:
        return _waiting.pop(value[FRAME_REF])
    except KeyError:
        raise RuntimeError(f"lens_evals: a frame's lens field was dropped before it was read (over {MAX_WAITING} waiting)") from None


def frame_responses(inner: Any) -> Any:
    """An httpx2 transport that turns frame responses of ``inner`` (an httpx2 transport) into JSON
    ones (see above). httpx2 (the OpenAI SDK's HTTP library) is imported here: a client install
    with an older SDK has none, and then the provider asks for JSON."""
    import httpx2

    class FrameResponses(httpx2.AsyncBaseTransport):
        async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
            global frames_read
            response: httpx2.Response = await inner.handle_async_request(request)
            if not wire_frame.is_frame(response.headers.get("content-type")):
                return response
            try:
                body = await response.aread()
            finally:
                await response.aclose()
            data = wire_frame.unframe(body)
            if isinstance(data, dict):
                for key in (ACTIVATIONS_KEY, HOOK_RESULTS_KEY):
                    if key in data:
                        data[key] = _keep(data[key])
            frames_read += 1
            dropped = {"content-type", "content-length", "content-encoding", "transfer-encoding"}
            headers = [(name, value) for name, value in response.headers.multi_items() if name.lower() not in dropped]
            return httpx2.Response(
                response.status_code,
                headers=[*headers, ("content-type", "application/json")],
                content=json.dumps(data).encode(),
                extensions=response.extensions,
            )

        async def aclose(self) -> None:
            await inner.aclose()

    return FrameResponses()


def frame_http_client() -> Any:
    """The OpenAI SDK's HTTP client with Inspect's defaults (limits, timeouts, retries, proxies)
    and :func:`frame_responses` around Inspect's transport; None where this Inspect or SDK lacks
    what builds them (the provider then asks for JSON)."""
    try:
        import httpx2  # noqa: F401  (frame_responses needs it)
        from inspect_ai._util.http_defaults_httpx2 import default_client_kwargs  # what Inspect's OpenAI providers use
        from openai import DefaultAsyncHttpxClient
    except ImportError:
        return None
    kwargs = default_client_kwargs()
    if kwargs.get("transport") is None:  # another Inspect: it does not build the transport itself
        return None
    kwargs["transport"] = frame_responses(kwargs["transport"])
    return DefaultAsyncHttpxClient(**kwargs)
