"""Rows written while a request still decodes (``worker/stream_write.py``), without an engine.
Reference: each request's rows computed here from the step tensors, by absolute position (a
later row of a position wins, as after a recomputation); the same steps with streaming off."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from lens_evals.engine.compat.worker import BatchLayout
from lens_evals.engine.frontend.rows import result_tensors
from lens_evals.engine.transport import handoff, handoff_pool
from lens_evals.engine.transport.handoff import claim_all
from lens_evals.engine.worker import decode_runs, stream_write
from lens_evals.engine.worker.core import WorkerCore
from lens_evals.engine.worker.requests import WorkerLensRequest
from lens_evals.engine.worker.taps import run_layer
from tests.engine.test_decode_runs import note_rows
from tests.engine.test_handoff import sent, target  # noqa: F401  (``target`` is a fixture)

HIDDEN, LAYERS = 8, {0, 1, 2, 3}
PROMPT = 3


def _run(
    address: dict[str, Any] | None,
    steps: int = 41,
    back_at: int = 33,
    fetch_at: int = 18,
    fail_at: int = 26,
    fetch_all: bool = True,
    slack: int = 0,
    hidden: int = HIDDEN,
):
    """Five requests decoding together (prompt of 3, then one row a step); r1 is fetched while it
    runs, r3 fails, r4's ``rows_at_most`` is too small (its block grows), and at ``back_at`` every
    request computes its last position again. Returns the core, the rows seen, the results and
    the bytes held after each step."""
    core = WorkerCore(torch.device("cpu"), torch.float32, LAYERS)
    names = [f"r{i}" for i in range(5)]
    requests = {}
    for i, name in enumerate(names):
        req = WorkerLensRequest(key=f"k{i}", capture_layers=[1, 2] if i % 2 else [2], handoff=dict(address) if address else None)
        req.rows_at_most = 10 if i == 4 else PROMPT + steps + slack
        requests[name] = req
        core.ledger.track(name, req)
    seen: dict[str, dict[int, dict[int, torch.Tensor]]] = {name: {1: {}, 2: {}} for name in names}
    generator = torch.Generator().manual_seed(0)
    positions = dict.fromkeys(names, 0)
    results: dict[str, Any] = {}
    held = []
    for step in range(steps):
        rows = [PROMPT if step == 0 else 1] * len(names)
        if step == back_at:
            for name in names:
                positions[name] -= 1
        context = core.begin_step(core.plan_step(BatchLayout(list(names), rows, [positions[n] for n in names]), None))
        stream = {}
        for layer in (1, 2):
            hidden_rows, residual = torch.randn(sum(rows), hidden, generator=generator), torch.randn(sum(rows), hidden, generator=generator)
            run_layer(context, layer, hidden_rows, residual)
            stream[layer] = hidden_rows + residual
        core.store_step(context)
        stream_write.writer().submit(lambda: None).result()  # the streamed writes of this step done
        core.streams.reap()
        held.append(core.stores.held_bytes)
        note_rows(seen, positions, names, rows, stream)
        if step == fetch_at:
            results["r1"] = _fetch(core, "k1", address)
            frozen = {layer: dict(rows) for layer, rows in seen["r1"].items()}
        if step == fail_at:
            core.ledger.fail_key("k3", "failed on purpose")
    for name in names if fetch_all else []:
        core.finish(name)
        if name != "r1":
            results[name] = _fetch(core, requests[name].key, address)
    if fetch_at >= 0:
        seen["r1"] = frozen
    return core, requests, seen, results, held


KINDS: dict[str, str] = {}  # request key -> where its captures came back: data, pool or file


def _fetch(core: WorkerCore, key: str, address: dict[str, Any] | None) -> Any:
    if address is None or address.get("pid") == os.getpid():
        reply = {key: core.pop_result(key)}
    else:
        reply = core.fetch_results([key], sent())
    packed = (reply[key] or {}).get("residual_stream", {})
    KINDS[key] = next((kind for kind in ("pool", "file", "data") if kind in packed), "none")
    claim_all([reply])
    return reply[key]


def _check(requests, seen, results) -> None:
    assert "failed on purpose" in results["r3"]["error"]
    for name, req in requests.items():
        if name == "r3":
            continue
        got = result_tensors(results[name])["residual_stream"]
        last = max(seen[name][2])
        for index, layer in enumerate(req.capture_layers):
            want = torch.stack([seen[name][layer][p] for p in range(last + 1)])
            assert torch.equal(got[index], want), (name, layer)


@pytest.fixture
def small_rounds(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(stream_write, "STREAM_STEPS", 4)
    monkeypatch.setattr(stream_write, "MIN_BYTES", 0)
    monkeypatch.setattr(decode_runs, "MAX_SEGMENT_STEPS", 4)


def test_rows_streamed_as_bytes_equal_the_rows_by_position(small_rounds) -> None:
    """A frontend in the worker's process: the blocks are bytes. The rows leave the step buffers
    as the requests run (the store holds at most a few rounds' rows, not every step's)."""
    core, requests, seen, results, held = _run({"dir": "/nonexistent", "token": "0" * 32, "pid": os.getpid()})
    _check(requests, seen, results)
    assert core.streams.written >= 4 * 4 and core.held_bytes == 0 and not core.streams.blocks  # 4 requests, 4 rounds at least
    _, _, _, _, held_without = _run(None)
    assert max(held) < max(held_without) / 3, (max(held), max(held_without))


def test_rows_streamed_into_the_pool_equal_the_rows_by_position(small_rounds, target) -> None:  # noqa: F811
    """Another process's frontend: each block is a pool region, cut to its rows at the end
    (the region's tail free again: the pool holds no more than the blocks returned)."""
    core, requests, seen, results, _ = _run(target, slack=300, hidden=512)  # blocks with room for more positions than they get
    _check(requests, seen, results)
    assert {KINDS[req.key] for name, req in requests.items() if name != "r3"} == {"pool"}
    assert core.streams.written >= 4 * 4 and core.held_bytes == 0
    pool = handoff._files.pools[target["token"]]
    used = sum(size for segment in pool.segments.values() for size in segment.used.values())
    returned = sum(-(-results[name]["residual_stream"]["data"].nbytes // 4096) * 4096 for name in requests if name != "r3")
    assert used == returned, (used, returned)


def test_rows_in_a_pool_without_room_count_as_held(small_rounds, target, monkeypatch) -> None:  # noqa: F811
    """Another process's frontend whose pool has no room: its blocks are bytes, which the worker
    holds until the fetch, so their rows count against the memory bound as a frontend's without
    a pool do (before 4f3c441 they were not counted). Reference: the rows streamed so far."""
    monkeypatch.setenv(handoff_pool.POOL_ENV, "0")  # a new pool (this test's token): no segment can be made
    core, _, _, _, _ = _run(target, steps=12, back_at=-1, fetch_at=-1, fail_at=-1, fetch_all=False)
    blocks = list(core.streams.blocks.values())
    assert blocks and all(block.region is None and block.memory is not None for block in blocks)  # bytes
    streamed = sum(block.streamed_bytes for block in blocks)
    assert streamed > 0 and core.streams.inline_bytes == streamed
    assert core.held_bytes == core.stores.held_bytes + streamed
    core.pop_result("k0")  # taken: no longer counted here
    assert core.streams.inline_bytes == streamed - blocks[0].streamed_bytes


def test_a_fetch_from_another_frontend_gets_the_pool_rows_inline(small_rounds, target) -> None:  # noqa: F811
    """An abort's fetch sends no target: the rows of a block in the pool come back as bytes and
    its region is free again."""
    core, requests, seen, _, _ = _run(target, steps=12, back_at=-1, fetch_at=-1, fail_at=-1, fetch_all=False)
    result = core.pop_result("k0")
    assert "data" in result["residual_stream"]
    want = torch.stack([seen["r0"][2][p] for p in range(max(seen["r0"][2]) + 1)])
    assert torch.equal(result_tensors(result)["residual_stream"][0], want)


def test_an_engine_streams_decoding_rows_equal_to_the_rows_written_at_the_end(llm, monkeypatch: pytest.MonkeyPatch) -> None:
    """The tiny Llama in this process, 4 prompts x 40 tokens capturing two layers: with every
    round's rows written (``MIN_BYTES`` 0, rounds of 16 steps) the worker writes rows while the
    requests run, and each capture and token equals the same call with nothing streamed."""
    from lens_evals.engine.transport.protocol import MEMORY_METHOD
    from tests.conftest import TINY_PROMPTS, capture, greedy

    params = greedy(40, output_residual_stream=[1, 3])
    monkeypatch.setattr(stream_write, "MIN_BYTES", 1 << 62)
    (before,) = llm.collective_rpc(MEMORY_METHOD)
    at_end = llm.generate(TINY_PROMPTS[:4], params)
    (middle,) = llm.collective_rpc(MEMORY_METHOD)
    monkeypatch.setattr(stream_write, "MIN_BYTES", 0)
    streamed = llm.generate(TINY_PROMPTS[:4], params)
    (after,) = llm.collective_rpc(MEMORY_METHOD)
    assert middle["streamed_writes"] == before["streamed_writes"]
    assert after["streamed_writes"] - middle["streamed_writes"] >= 4 * 2, after  # two rounds per request at least
    assert after["held_bytes"] == 0
    for i, (plain, written) in enumerate(zip(at_end, streamed)):
        assert plain.outputs[0].token_ids == written.outputs[0].token_ids, i
        assert torch.equal(capture(written), capture(plain)), i
        assert capture(written).shape[1] == len(plain.prompt_token_ids) + 39, i


def test_rounds_follow_segment_closes_but_at_most_one_per_half_round() -> None:
    """Hand-computed, rounds of 16 steps: a steady decode's segments close every 16 steps and a
    round follows each close; requests coming and going close a segment at every step, and a
    round comes every 8 steps; with no runs at all, every 32 steps."""
    from lens_evals.engine.worker.host_store import PieceStore

    def rounds(closes: list[int]) -> list[int]:
        streams = stream_write.StreamWrites(PieceStore())
        return [step for step, closed in enumerate(closes) if streams.due(closed)]

    assert rounds([step // 16 for step in range(64)]) == [16, 32, 48]  # the step each segment closed at
    assert rounds(list(range(40))) == [7, 15, 23, 31, 39]
    assert rounds([0] * 70) == [31, 63]


def test_rows_being_streamed_are_waited_for_when_over_the_memory_bound(small_rounds) -> None:
    """Two running requests' rows are on their way out behind a blocked writer when the next step
    passes the memory bound: the worker waits for the writes (the writer is let go after 0.3 s)
    rather than fail the running requests, and both captures come back whole."""
    import threading

    core = WorkerCore(torch.device("cpu"), torch.float32, LAYERS)
    address = {"dir": "/nonexistent", "token": "0" * 32, "pid": os.getpid()}
    names = ["r0", "r1"]
    for i, name in enumerate(names):
        core.ledger.track(name, WorkerLensRequest(key=f"k{i}", capture_layers=[2], handoff=dict(address)))
    seen: dict[str, dict[int, dict[int, torch.Tensor]]] = {name: {2: {}} for name in names}
    positions = dict.fromkeys(names, 0)
    gate = threading.Event()
    for step in range(12):
        if step == 4:  # the first round (at step 4) waits behind the gate
            stream_write.writer().submit(gate.wait, 60)
        if step == 8:
            core.stores.max_held_bytes = core.stores.held_bytes  # the next step passes it
            threading.Timer(0.3, gate.set).start()
        context = core.begin_step(core.plan_step(BatchLayout(names, [1, 1], [positions[n] for n in names]), None))
        hidden, residual = torch.randn(2, HIDDEN), torch.randn(2, HIDDEN)
        run_layer(context, 2, hidden, residual)
        core.store_step(context)
        note_rows(seen, positions, names, [1, 1], {2: hidden + residual})
    assert gate.is_set() and not core.ledger.errors, core.ledger.errors
    for i, name in enumerate(names):
        core.finish(name)
        got = result_tensors(core.pop_result(f"k{i}"))["residual_stream"][0]
        assert torch.equal(got, torch.stack([seen[name][2][p] for p in range(12)])), name


def test_a_frontend_that_takes_no_early_rows_gets_them_at_the_fetch(small_rounds, monkeypatch: pytest.MonkeyPatch) -> None:
    """A frontend whose hand-off directory the worker cannot see (another host): nothing is
    streamed, each request is asked about once (not at every round), and every row comes back
    at the fetch as computed."""
    asked: list[Any] = []
    early_sink_for = handoff.early_sink_for
    monkeypatch.setattr(handoff, "early_sink_for", lambda address: asked.append(address) or early_sink_for(address))
    core, requests, seen, results, _ = _run({"dir": "/nonexistent", "token": "a" * 32, "pid": -1})
    _check(requests, seen, results)
    assert core.streams.written == 0 and not core.streams.unwritable
    assert len(asked) <= 2 * len(requests), len(asked)  # once while it runs, once as it finishes
