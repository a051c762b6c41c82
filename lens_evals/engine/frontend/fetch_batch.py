"""Served requests that finish together fetch their rows in one worker round trip.

A served lens request ends with a fetch: a ``collective_rpc`` that the engine core runs between
two steps. A prefill batch ends hundreds of requests in one step, and a call per request puts as
many utility calls on the engine core's loop and makes each request wait its turn. Here the
first request to finish starts a call; the requests that finish while it is in flight wait and go
together in the next one. Every call's rows are claimed before any request wakes, so a request
cancelled meanwhile (a client gone) still frees its pool regions: its rows are claimed and
dropped. A call that fails fails the requests it carried, and only those.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
from typing import Any

from lens_evals.engine import compat
from lens_evals.engine.transport.handoff import HandoffTarget, claim_all
from lens_evals.engine.transport.protocol import FETCH_METHOD, FetchReply

logger = logging.getLogger("lens_evals")


class FetchBatcher:
    """One input processor's fetches (one engine's), batched while a call is in flight."""

    def __init__(self, engine: Any, processor: Any) -> None:
        self.engine = engine
        self.processor = processor
        self.calls = 0  # worker round trips made
        self._waiting: dict[str, asyncio.Future[list[FetchReply]]] = {}
        self._drain: asyncio.Task[None] | None = None

    async def fetch(self, key: str) -> list[FetchReply]:
        """Every worker's reply for a call that carried ``key`` (its rows already claimed)."""
        loop = asyncio.get_running_loop()
        reply: asyncio.Future[list[FetchReply]] = loop.create_future()
        self._waiting[key] = reply
        if self._drain is None:
            # a context of its own: the first request's (its HTTP results) must not live as long as the calls
            self._drain = loop.create_task(self._send_while_waiting(), context=contextvars.Context())
        return await reply

    async def _send_while_waiting(self) -> None:
        batch: dict[str, asyncio.Future[list[FetchReply]]] = {}
        try:
            while self._waiting:
                await asyncio.sleep(0)  # requests ending in the same engine output join this call
                batch, self._waiting = self._waiting, {}
                target = HandoffTarget.for_this_process(id(self.processor))
                self.calls += 1
                try:
                    replies: list[FetchReply] = await compat.rpc.async_collective_rpc(self.engine, FETCH_METHOD, (list(batch), target))
                    claim_all(replies, id(self.processor))
                except Exception as error:
                    logger.warning(
                        "lens_evals: fetching the rows of %d request(s) failed (%s: %s)", len(batch), type(error).__name__, error
                    )
                    for reply in batch.values():
                        if not reply.done():  # a cancelled request no longer waits
                            reply.set_exception(error)
                    continue
                for reply in batch.values():
                    if not reply.done():
                        reply.set_result(replies)
                batch = {}
        finally:
            self._drain = None
            for reply in [*batch.values(), *self._waiting.values()]:  # cancelled itself (the loop closing)
                reply.cancel()
            self._waiting = {}
