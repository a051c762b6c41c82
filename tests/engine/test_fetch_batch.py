"""Served fetches batched while one is in flight (``engine/fetch_batch.py``). The worker's call is
replaced by one that waits for the test, so what is in flight when is certain; a real server's
concurrent requests (each rows equal to its solo run) are tests/engine/test_hardening_load.py's."""

from __future__ import annotations

import asyncio

import pytest

from lens_evals.engine.frontend import fetch_batch


class Worker:
    """A fetch call per ``release``: replies for each key asked, or fails the call."""

    def __init__(self) -> None:
        self.calls: list[list[str]] = []
        self.gates: list[asyncio.Event] = []
        self.fail: set[int] = set()  # call indices that raise

    async def rpc(self, engine, method, args):
        keys, _target = args
        index = len(self.calls)
        self.calls.append(list(keys))
        gate = asyncio.Event()
        self.gates.append(gate)
        await gate.wait()
        if index in self.fail:
            raise RuntimeError(f"call {index} failed")
        return [{key: {"rows": f"rows of {key}"} for key in keys}]

    async def release(self, index: int) -> None:
        while len(self.gates) <= index:
            await asyncio.sleep(0.001)
        self.gates[index].set()


@pytest.fixture
def worker(monkeypatch) -> Worker:
    worker = Worker()
    monkeypatch.setattr(fetch_batch.compat.rpc, "async_collective_rpc", worker.rpc)
    monkeypatch.setattr(fetch_batch, "claim_all", lambda replies, source: None)
    monkeypatch.setattr(fetch_batch.HandoffTarget, "for_this_process", staticmethod(lambda source: {"token": "t"}))
    return worker


def test_requests_finishing_during_a_call_go_together_in_the_next(worker) -> None:
    async def scenario() -> list:
        batcher = fetch_batch.FetchBatcher(engine=None, processor=object())
        first = asyncio.ensure_future(batcher.fetch("a"))
        await asyncio.sleep(0.01)  # the call for "a" is in flight
        later = [asyncio.ensure_future(batcher.fetch(key)) for key in "bcde"]
        await asyncio.sleep(0.01)
        assert worker.calls == [["a"]]
        await worker.release(0)
        await worker.release(1)
        results = await asyncio.gather(first, *later)
        assert batcher.calls == 2 and batcher._drain is None
        return results

    results = asyncio.run(scenario())
    assert worker.calls == [["a"], ["b", "c", "d", "e"]]
    for key, replies in zip("abcde", results):
        assert replies[0][key] == {"rows": f"rows of {key}"}


def test_requests_ending_together_share_one_call(worker) -> None:
    async def scenario() -> None:
        batcher = fetch_batch.FetchBatcher(engine=None, processor=object())
        both = asyncio.gather(batcher.fetch("a"), batcher.fetch("b"))
        await worker.release(0)
        await both

    asyncio.run(scenario())
    assert worker.calls == [["a", "b"]]


def test_a_failed_call_fails_only_its_requests(worker) -> None:
    worker.fail = {0}

    async def scenario() -> None:
        batcher = fetch_batch.FetchBatcher(engine=None, processor=object())
        first = asyncio.ensure_future(batcher.fetch("a"))
        await asyncio.sleep(0.01)
        second = asyncio.ensure_future(batcher.fetch("b"))
        await worker.release(0)
        with pytest.raises(RuntimeError, match="call 0 failed"):
            await first
        await worker.release(1)
        assert (await second)[0]["b"] == {"rows": "rows of b"}

    asyncio.run(scenario())
    assert worker.calls == [["a"], ["b"]]


def test_a_cancelled_request_is_still_fetched_and_the_others_answered(worker) -> None:
    """A client gone while its fetch waits: its key is still sent (the worker's rows must be
    taken and claimed, or their regions stay taken), and the request beside it is answered."""

    async def scenario() -> None:
        batcher = fetch_batch.FetchBatcher(engine=None, processor=object())
        first = asyncio.ensure_future(batcher.fetch("a"))
        await asyncio.sleep(0.01)
        gone = asyncio.ensure_future(batcher.fetch("b"))
        stays = asyncio.ensure_future(batcher.fetch("c"))
        await asyncio.sleep(0.01)
        gone.cancel()
        await worker.release(0)
        await worker.release(1)
        assert (await stays)[0]["c"] == {"rows": "rows of c"}
        assert (await first)[0]["a"] == {"rows": "rows of a"}
        assert gone.cancelled()

    asyncio.run(scenario())
    assert worker.calls == [["a"], ["b", "c"]]
