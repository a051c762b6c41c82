"""An operator's ``--middleware`` for tests/engine/test_server_auth.py's server (imported by the server
process): it stamps every HTTP response with the path it saw (``x-operator-saw``) and answers
403 itself to a request that carries ``x-operator-block``, before anything inside it runs."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

Message = dict[str, Any]
App = Callable[[dict[str, Any], Callable[[], Awaitable[Message]], Callable[[Message], Awaitable[None]]], Awaitable[None]]
BLOCK_HEADER = "x-operator-block"
SAW_HEADER = "x-operator-saw"


class OperatorMiddleware:
    def __init__(self, app: App) -> None:
        self.app = app

    async def __call__(
        self, scope: dict[str, Any], receive: Callable[[], Awaitable[Message]], send: Callable[[Message], Awaitable[None]]
    ) -> None:
        if scope.get("type") != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        if any(name.lower() == BLOCK_HEADER.encode() for name, _ in scope.get("headers", ())):
            body = json.dumps({"blocked_by_operator": path}).encode()
            await send({"type": "http.response.start", "status": 403, "headers": [(b"content-type", b"application/json")]})
            await send({"type": "http.response.body", "body": body})
            return

        async def stamped(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), (SAW_HEADER.encode(), path.encode())]}
            await send(message)

        await self.app(scope, receive, stamped)
