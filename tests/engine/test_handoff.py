"""The worker-to-frontend hand-off of row blocks through files (no engine: the engine path is in
test_engine_modes.py). Reference: the same rows assembled into inline bytes."""

from __future__ import annotations

import contextlib
import os
import subprocess
import tempfile
from collections.abc import Iterator

import pytest
import torch

from lens_evals.engine.frontend.rows import result_tensors
from lens_evals.engine.transport import handoff, handoff_files, handoff_pool
from lens_evals.engine.transport.handoff import HandoffTarget, claim, claim_all, sink_for
from lens_evals.engine.worker.host_store import Piece, PieceStore, assemble, row_blocks


@contextlib.contextmanager
def target_in(directory: str, monkeypatch) -> Iterator[dict]:
    """A frontend hand-off target in ``directory``, as another process would send it; its marker
    and this worker's pool for it go afterwards."""
    monkeypatch.setenv(handoff.DIR_ENV, directory)
    monkeypatch.setenv(handoff.MIN_BYTES_ENV, "0")  # the test's small blocks are shared too
    monkeypatch.setattr(HandoffTarget, "_current", None)
    try:
        yield sent()
    finally:
        token = HandoffTarget._current.token
        os.unlink(HandoffTarget._current.marker)
        if token in handoff._files.pools:
            handoff._cleanup_pool(handoff._files.pools.pop(token))


@pytest.fixture
def target(tmp_path, monkeypatch) -> Iterator[dict]:
    """A frontend hand-off target in ``tmp_path``, as another process would send it."""
    with target_in(str(tmp_path), monkeypatch) as sent_target:
        yield sent_target


def file_system(path: str) -> str:
    return subprocess.run(["stat", "-f", "-c", "%T", path], capture_output=True, text=True, check=True).stdout.strip()


def test_an_in_process_frontend_gets_the_pool_where_the_directory_is_in_memory(tmp_path, monkeypatch) -> None:
    """An in-process engine's rows: the pool's memory (touched before) in a tmpfs directory;
    bytes where the pool has no room (never a file) and in a directory on a disk (no rows
    through a disk's page cache). Reference: the file system ``stat -f`` names."""
    assert handoff_files.in_memory(str(tmp_path)) == (file_system(str(tmp_path)) == "tmpfs")
    assert handoff_files.in_memory("/dev/shm") == (file_system("/dev/shm") == "tmpfs")
    pieces = _pieces(torch.float32)
    with tempfile.TemporaryDirectory(dir="/dev/shm") as shm, target_in(shm, monkeypatch) as shm_target:
        here = {**shm_target, "pid": os.getpid()}
        monkeypatch.setenv(handoff_pool.POOL_ENV, "0")  # no room: bytes, where another process gets a file
        assert "data" in assemble(pieces, sink_for(here))[0] and "file" in assemble(pieces, sink_for({**here, "pid": -1}))[0]
        monkeypatch.delenv(handoff_pool.POOL_ENV)
        packed = assemble(pieces, sink_for(here))[0]
        assert ("pool" in packed) == handoff_files.in_memory(shm)
        if "pool" in packed:
            claim_all([{"k": {"residual_stream": packed}}])


def sent() -> dict:
    """What this frontend sends with a fetch (with the regions freed since the last one), as if
    it were another process than the worker."""
    return {**HandoffTarget.for_this_process(), "pid": -1}


def _pieces(dtype: torch.dtype, request: str = "k") -> list[Piece]:
    store = PieceStore()
    generator = torch.Generator().manual_seed(1)
    for step in range(3):
        rows = torch.randn(2, 4, 300, generator=generator).to(dtype)  # (layers, rows, hidden)
        buffer = store.new_buffer(rows, None, 4)
        store.add(request, Piece(buffer, 1, 2, 2 * step, None))
    return store.release(request)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_through_a_file_equal_inline_rows_and_the_file_is_gone(tmp_path, target, dtype, monkeypatch) -> None:
    monkeypatch.setenv(handoff_pool.POOL_ENV, "0")  # no pool: a file per block
    pieces = _pieces(dtype)
    inline_packed, _ = assemble(pieces)
    packed, gaps = assemble(pieces, sink_for(target))
    assert gaps == [] and "file" in packed and "data" not in packed
    assert len(list(tmp_path.glob(handoff.ROWS_PREFIX + "*"))) == 1
    reply = [{"k": {"residual_stream": packed, "layers": [3, 5]}}]
    claim_all(reply)
    assert list(tmp_path.glob(handoff.ROWS_PREFIX + "*")) == []  # unlinked on claim, still mapped
    rows = result_tensors(reply[0]["k"])["residual_stream"]
    want = result_tensors({"residual_stream": inline_packed, "layers": [3, 5]})["residual_stream"]
    assert rows.shape == (2, 6, 300) and torch.equal(rows, want)
    rows += 1  # writable, like inline rows
    assert torch.equal(rows, want + 1)


def test_small_blocks_unseen_markers_and_this_process_on_disk_stay_inline(target, monkeypatch) -> None:
    pieces = _pieces(torch.float32)
    monkeypatch.setenv(handoff.MIN_BYTES_ENV, str(10**9))
    assert "data" in assemble(pieces, sink_for(target))[0]
    monkeypatch.setenv(handoff.MIN_BYTES_ENV, "0")
    assert "data" in assemble(pieces, sink_for({**target, "pid": os.getpid()}))[0]  # this process, a disk's directory
    assert "data" in assemble(pieces, sink_for({**target, "token": "0" * 32}))[0]  # no such marker
    assert "data" in assemble(pieces, sink_for(None))[0]
    monkeypatch.setenv(handoff.HANDOFF_ENV, "0")
    assert "data" in assemble(pieces, sink_for(target))[0]


def test_claim_refuses_foreign_names_and_missing_files(target, monkeypatch) -> None:
    for name in ("../etc/passwd", "lens_evals-rows-xyz", handoff_files.marker_name(target["token"])):
        with pytest.raises(ValueError, match="unexpected hand-off file name"):
            claim({"file": name, "nbytes": 0, "dtype": "float32", "shape": [0]})
    with pytest.raises(ValueError, match="is gone"):
        claim(
            {"file": handoff_files.ROWS_PREFIX + handoff_files.NAMESPACE + "-1-" + "0" * 32, "nbytes": 4, "dtype": "float32", "shape": [1]}
        )
    monkeypatch.setenv(handoff_pool.POOL_ENV, "0")
    packed, _ = assemble(_pieces(torch.float32), sink_for(target))
    with pytest.raises(ValueError, match="bytes, the reply says"):
        claim({**packed, "nbytes": packed["nbytes"] + 4})
    monkeypatch.delenv(handoff_pool.POOL_ENV)
    pooled, _ = assemble(_pieces(torch.float32), sink_for(target))
    with pytest.raises(ValueError, match="outside segment"):
        claim({**pooled, "offset": 2**40})
    with pytest.raises(ValueError, match="unexpected hand-off pool segment"):
        claim({**pooled, "pool": "../" + pooled["pool"]})
    claim(pooled)


def test_short_writes_are_finished_block_by_block(tmp_path, monkeypatch) -> None:
    """writev may write less than asked (signals, size limits): the rest still lands in order."""
    blocks = [bytes([i]) * (1000 + i) for i in range(5)]
    real_writev = os.writev

    def short_writev(fd: int, views: list) -> int:  # the kernel writing only 1500 bytes
        return os.write(fd, b"".join(bytes(v) for v in views)[:1500]) if len(views) > 1 else real_writev(fd, views)

    monkeypatch.setattr(handoff.os, "writev", short_writev)
    path = tmp_path / "rows"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT)
    try:
        assert handoff._write_all(fd, blocks) == sum(map(len, blocks))
    finally:
        os.close(fd)
    assert path.read_bytes() == b"".join(blocks)


def _fetch(sink, dtype=torch.float32, request: str = "k") -> tuple[torch.Tensor, torch.Tensor, dict]:
    """One request's rows through ``sink`` and claimed: (rows, the same rows inline, reply)."""
    pieces = _pieces(dtype, request)
    packed, _ = assemble(pieces, sink)
    reply = [{request: {"residual_stream": dict(packed), "layers": [0, 1]}}]
    claim_all(reply)
    inline_rows = result_tensors({"residual_stream": assemble(pieces)[0], "layers": [0, 1]})["residual_stream"]
    return result_tensors(reply[0][request])["residual_stream"], inline_rows, packed


def test_pool_regions_are_reused_only_after_the_frontend_frees_them(tmp_path, target) -> None:
    import gc

    first, want_first, packed_first = _fetch(sink_for(target))
    assert "pool" in packed_first and torch.equal(first, want_first)
    assert list(tmp_path.glob(handoff_pool.SEGMENT_PREFIX + "*")) == []  # mapped and unlinked by the frontend
    second, want_second, packed_second = _fetch(sink_for(sent()))  # the first is alive: another region
    assert packed_second["offset"] != packed_first["offset"] and torch.equal(first, want_first)
    del first
    gc.collect()
    freed = sent()
    assert freed["free"] == [[packed_first["pool"], packed_first["offset"]]]
    third, want_third, packed_third = _fetch(sink_for(freed), torch.bfloat16)
    assert packed_third["offset"] == packed_first["offset"]  # the freed region again
    assert torch.equal(third, want_third) and torch.equal(second, want_second)


def test_regions_freed_before_a_call_are_released_ahead_of_its_fetch(tmp_path, target) -> None:
    """An offline call's start (``frontend_attach.release_offline``): the frontend's freed regions
    reach the worker's pool through ``release_regions`` and the next write, before any fetch,
    takes the freed region again; nothing freed, nothing released."""
    import gc

    from lens_evals.engine.transport.handoff import release_regions

    first, _, packed_first = _fetch(sink_for(target))
    pool = handoff._files.pools[target["token"]]
    assert not HandoffTarget.has_freed() and release_regions(sent()) == 0
    del first
    gc.collect()
    assert HandoffTarget.has_freed() and not HandoffTarget.has_freed(7)  # engine 0's region only
    assert release_regions(sent()) == 1 and not HandoffTarget.has_freed()
    rows = row_blocks(_pieces(torch.float32, "next"))
    assert pool.write(rows) == {"pool": packed_first["pool"], "offset": packed_first["offset"], "nbytes": rows.nbytes}
    assert release_regions(None) == 0 and release_regions({**sent(), "pid": os.getpid()}) == 0  # no pool: nothing


def test_a_full_pool_falls_back_to_files(tmp_path, target, monkeypatch) -> None:
    monkeypatch.setenv(handoff_pool.POOL_ENV, "0.001")  # less than one segment
    rows, want, packed = _fetch(sink_for(sent()))
    assert "file" in packed and torch.equal(rows, want)


def test_pool_of_an_exited_frontend_is_dropped(tmp_path, target) -> None:
    _fetch(sink_for(target))
    token = target["token"]
    assert token in handoff._files.pools
    other = {**target, "token": "f" * 32}
    open(tmp_path / handoff_files.marker_name(other["token"]), "x").close()
    os.unlink(HandoffTarget._current.marker)  # the first frontend exits
    sink_for(other)
    assert token not in handoff._files.pools
    open(HandoffTarget._current.marker, "x").close()  # for the fixture's clean-up
    handoff._cleanup_pool(handoff._files.pools.pop(other["token"]))


def test_segment_regions_never_overlap_and_coalesce_when_freed(tmp_path) -> None:
    import random

    segment = handoff_pool._Segment(str(tmp_path), 64 * handoff_pool.ALIGN)
    rng = random.Random(0)
    live: dict[int, int] = {}
    for _ in range(500):
        if live and rng.random() < 0.5:
            offset = rng.choice(list(live))
            assert segment.give(offset)
            del live[offset]
        else:
            size = rng.randint(1, 6) * handoff_pool.ALIGN - rng.randint(0, 100)
            offset = segment.take(size)
            if offset is None:  # no fitting hole: only when the free regions are all smaller
                assert all(length < size for length in segment.free_lengths.values())
                continue
            live[offset] = size
        spans = sorted((o, o + s) for o, s in live.items())
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))  # live regions never overlap
        assert all(o + s <= segment.size for o, s in live.items())
    for offset in list(live):
        segment.give(offset)
    assert segment.free_starts == [0] and segment.free_lengths == {0: segment.size}
    assert not segment.give(12345)  # an unknown offset is ignored
    segment.map.close()
    os.close(segment.fd)


def test_each_engine_gets_back_only_its_own_freed_regions(tmp_path, target) -> None:
    """Two engines in one frontend process (their workers: two pools): a region is reported free
    only with a fetch from the engine whose worker owns it."""
    import gc

    first, _, packed_first = _fetch(sink_for(target))
    other_worker = handoff_pool.SharedPool(str(tmp_path), HandoffTarget._current.marker)
    rows = row_blocks(_pieces(torch.float32, "other"))
    packed_other = rows.header | other_worker.write(rows)
    reply = [{"other": {"residual_stream": dict(packed_other), "layers": [0, 1]}}]
    claim_all(reply, source=7)  # fetched by the other engine's frontend
    other = result_tensors(reply[0]["other"])["residual_stream"]
    del first, other, reply
    gc.collect()
    assert sent()["free"] == [[packed_first["pool"], packed_first["offset"]]]  # engine 0's next fetch
    assert HandoffTarget.for_this_process(7)["free"] == [[packed_other["pool"], packed_other["offset"]]]
    other_worker.close()


def test_files_of_dead_processes_are_swept_when_a_frontend_starts(tmp_path) -> None:
    """A process killed hard leaves its marker, row files and pool segments behind; the next
    frontend to use the directory removes those whose pid is gone and keeps the live ones."""
    import subprocess
    import sys

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True)
    dead_pid, live_pid = int(dead.stdout), os.getpid()
    marker, rows, pool = (prefix + handoff_files.NAMESPACE + "-" for prefix in ("lens_evals-host-", "lens_evals-rows-", "lens_evals-pool-"))
    files = [  # (name without its uuid, content, kept)
        (marker, str(dead_pid), False),
        (marker, str(live_pid), True),
        (marker, "", True),  # an older marker without a pid
        (f"{rows}{dead_pid}-", "rows", False),
        (f"{rows}{live_pid}-", "rows", True),
        (f"{pool}{dead_pid}-", "pool", False),
        (f"{pool}{live_pid}-", "pool", True),
        (f"not-ours-{dead_pid}-", "x", True),
    ]
    made = {f"{prefix}{n:032x}": (text, kept) for n, (prefix, text, kept) in enumerate(files, start=1)}
    for name, (text, _) in made.items():
        (tmp_path / name).write_text(text)
    new = HandoffTarget(str(tmp_path))
    left = {p.name for p in tmp_path.iterdir()}
    assert left == {name for name, (_, kept) in made.items() if kept} | {os.path.basename(new.marker)}
    assert (tmp_path / os.path.basename(new.marker)).read_text() == str(live_pid)
    assert os.stat(new.marker).st_mode & 0o777 == 0o600  # as every hand-off file (docs/security.md)


def _core_with_rows(address: dict, requests: int = 3, steps: int = 3, hidden: int = 300, probe: bool = False):
    """A worker core (no engine) whose requests' specs name ``address`` for their rows; each
    request captures layer 1 over a 2-token prefill and decode steps (``probe``: and scores a
    probe there). (core, rows by key)."""
    from lens_evals.engine.compat.worker import BatchLayout
    from lens_evals.engine.worker.core import WorkerCore
    from lens_evals.engine.worker.requests import WorkerLensRequest, WorkerProbe
    from lens_evals.engine.worker.taps import run_layer

    core = WorkerCore(torch.device("cpu"), torch.float32, {0, 1, 2})
    names = [f"r{i}" for i in range(requests)]
    probes = [WorkerProbe(0, 1, "p", torch.ones(hidden), 0.0)] if probe else []
    for i, name in enumerate(names):
        core.ledger.track(name, WorkerLensRequest(key=f"k{i}", capture_layers=[1], probes=probes, handoff=dict(address)))
    streams: dict[str, list[torch.Tensor]] = {f"k{i}": [] for i in range(requests)}
    generator = torch.Generator().manual_seed(3)
    for step in range(steps):
        rows = [2 if step == 0 else 1] * requests
        hidden_rows, residual = (torch.randn(sum(rows), hidden, generator=generator) for _ in range(2))
        context = core.begin_step(core.plan_step(BatchLayout(names, rows, [0 if step == 0 else step + 1] * requests), None))
        run_layer(context, 1, hidden_rows, residual)
        core.store_step(context)
        for i, block in enumerate((hidden_rows + residual).split(rows)):
            streams[f"k{i}"].append(block)
    return core, {key: torch.cat(blocks)[None] for key, blocks in streams.items()}


def _wait_early(core, *keys: str) -> None:
    for key in keys:
        core.early.entries[key].done.result(timeout=60)


def test_finished_rows_are_in_the_pool_before_the_fetch_and_come_back_equal(tmp_path, target) -> None:
    """A request vLLM finished is written into the frontend's pool at once (``early_write``); the
    fetch replies with that region, and the rows equal those of a request fetched the old way."""
    core, want = _core_with_rows(target)
    core.finish("r0")
    _wait_early(core, "k0")
    written = [(s.name, offset) for s in handoff._files.pools[target["token"]].segments.values() for offset in s.used]
    assert core.early.written == 1 and len(written) == 1  # in the pool, nothing fetched yet
    reply = core.fetch_results(["k0", "k1", "k2"], sent())
    assert [(reply["k0"]["residual_stream"]["pool"], reply["k0"]["residual_stream"]["offset"])] == written
    assert all("pool" in reply[key]["residual_stream"] for key in ("k1", "k2"))  # written by the fetch
    claim_all([reply])
    for key in want:
        assert torch.equal(result_tensors(reply[key])["residual_stream"], want[key]), key
    assert core.held_bytes == 0 and len(core.early) == 0 and core.early.written == 1
    for name in ("r1", "r2"):  # fetched before vLLM finished them: nothing more to write
        core.finish(name)
    assert len(core.early) == 0


def test_rows_written_early_for_an_aborted_or_dropped_request_free_their_region(tmp_path, target, monkeypatch) -> None:
    """An abort's fetch sends no target: rows already in the pool come back inline and their
    region is free again. A request whose rows wait for the fetch (here: below the hand-off's
    minimum size) is dropped for the memory bound like any unfetched one."""
    from lens_evals.engine.compat.worker import BatchLayout

    core, want = _core_with_rows(target)
    core.finish("r0")
    _wait_early(core, "k0")
    pool = handoff._files.pools[target["token"]]
    assert sum(len(s.used) for s in pool.segments.values()) == 1
    reply = core.fetch_results(["k0"], None)
    assert "data" in reply["k0"]["residual_stream"] and "pool" not in reply["k0"]["residual_stream"]
    assert torch.equal(result_tensors(reply["k0"])["residual_stream"], want["k0"])
    assert sum(len(s.used) for s in pool.segments.values()) == 0
    monkeypatch.setenv(handoff.MIN_BYTES_ENV, str(10**9))  # too small for the pool: held for the fetch
    core.finish("r1")
    _wait_early(core, "k1")
    core.early.reap()
    assert core.held_bytes > 0 and "k1" in core.early.entries and core.early.written == 1
    core.stores.max_held_bytes = 0
    core.store_step(core.begin_step(core.plan_step(BatchLayout(["r2"], [1], [4]), None)))  # a step of r2 only
    assert "k1" not in core.early.entries and core.held_bytes == 0


def test_a_request_dropped_for_the_memory_bound_frees_its_pool_region(target, monkeypatch) -> None:
    """Its capture in the pool, its probe scores (below the hand-off's minimum) held for the
    fetch: dropped for the memory bound, the region is free again and its fetch gets an error."""
    from lens_evals.engine.compat.worker import BatchLayout

    monkeypatch.setenv(handoff.MIN_BYTES_ENV, "1000")  # captures (4,800 bytes) go to the pool, scores (16) wait
    core, _ = _core_with_rows(target, probe=True)
    core.finish("r0")
    _wait_early(core, "k0")
    core.early.reap()
    pool = handoff._files.pools[target["token"]]
    assert sum(len(s.used) for s in pool.segments.values()) == 1 and core.early.entries["k0"].taken.held is not None
    core.stores.max_held_bytes = 0
    core.store_step(core.begin_step(core.plan_step(BatchLayout(["r1"], [1], [4]), None)))  # a step of r1 only
    assert "k0" not in core.early.entries and sum(len(s.used) for s in pool.segments.values()) == 0
    assert "dropped before it was fetched" in core.fetch_results(["k0"], sent())["k0"]["error"]  # and says why


def test_a_frontend_in_this_process_gets_inline_bytes_early_counted_until_fetched(target, monkeypatch) -> None:
    """Same process, the pool without room: the early write is the inline copy the fetch would
    make; those bytes count against the worker's memory bound until fetched, and an unfetched
    one is dropped for it."""
    from lens_evals.engine.compat.worker import BatchLayout

    monkeypatch.setenv(handoff_pool.POOL_ENV, "0")
    core, want = _core_with_rows({**target, "pid": os.getpid()})
    core.finish("r0")
    core.finish("r1")
    _wait_early(core, "k0", "k1")
    core.early.reap()
    assert core.early.written == 2 and core.early.inline_bytes == 2 * want["k0"].numel() * 4
    assert core.held_bytes == core.stores.held_bytes + core.early.inline_bytes
    reply = core.fetch_results(["k1"], {**target, "pid": os.getpid()})
    assert "data" in reply["k1"]["residual_stream"] and torch.equal(result_tensors(reply["k1"])["residual_stream"], want["k1"])
    core.stores.max_held_bytes = core.held_bytes - 1  # k0's bytes are over the bound now
    core.store_step(core.begin_step(core.plan_step(BatchLayout(["r2"], [1], [4]), None)))
    assert "k0" not in core.early.entries and core.early.inline_bytes == 0
    assert "LENS_EVALS_MAX_HELD_CAPTURE_GIB" in core.fetch_results(["k0"], None)["k0"]["error"]  # dropped: no rows, the bound named


def test_a_request_cancelled_during_its_fetch_still_frees_its_pool_regions(tmp_path, target, monkeypatch) -> None:
    """A server request whose client goes while its fetch is in flight: the worker has written
    its rows into the pool, so the frontend must still claim (and drop) them, or the regions
    stay taken for the life of the server (before the fix: never reported free)."""
    import asyncio
    import gc
    from types import SimpleNamespace

    from lens_evals.engine.frontend import attach as frontend_attach
    from lens_evals.engine.frontend.pending import PendingLensRequest, ServedCall
    from lens_evals.engine.frontend.state import frontend_state

    worker = handoff_pool.SharedPool(str(tmp_path), HandoffTarget._current.marker)
    processor = type("Processor", (), {})()
    frontend_state(processor).pending.admit(PendingLensRequest(key="k", capture_layers=(0, 1), probe_names=(), prompt_len=2))
    monkeypatch.setattr(frontend_attach.compat.frontend, "input_processor", lambda engine: processor)
    written: list[dict] = []

    async def fetch_rpc(engine, method, args):  # the worker's fetch: rows into the pool, then the reply travels
        rows = row_blocks(_pieces(torch.float32))
        written.append(rows.header | worker.write(rows))
        await asyncio.sleep(0.05)
        return [{"k": {"residual_stream": dict(written[0]), "layers": [0, 1]}}]

    monkeypatch.setattr(frontend_attach.compat.rpc, "async_collective_rpc", fetch_rpc)

    async def client_goes() -> None:
        request = asyncio.ensure_future(frontend_attach.attach_async(object(), SimpleNamespace(request_id="r"), 5, ServedCall("r", "k")))
        for _ in range(1000):
            if written or request.done():
                break
            await asyncio.sleep(0.001)
        assert written and not request.done()
        request.cancel()
        with pytest.raises(asyncio.CancelledError):
            await request
        await asyncio.sleep(0.2)  # the fetch goes on without the request

    asyncio.run(client_goes())
    gc.collect()
    assert HandoffTarget.for_this_process(id(processor))["free"] == [[written[0]["pool"], written[0]["offset"]]]
    worker.close()


def test_a_pool_segment_is_not_made_when_the_directory_is_nearly_full(tmp_path, target, monkeypatch) -> None:
    """The pool never fills the hand-off directory (``/dev/shm`` is shared with every process)
    past its last ``ROOM_MARGIN`` bytes: with 300 MiB free a 64 MiB segment is not made, and the
    14 KB block goes to a file of its own, which fits (the file path's own room check). The
    directory's free space is what ``statvfs`` says; the pool is told 300 MiB here."""
    monkeypatch.setattr(handoff_pool, "free_bytes", lambda directory: 300 << 20)
    rows, want, packed = _fetch(sink_for(sent()))
    assert "file" in packed and torch.equal(rows, want)
    assert handoff._files.pools[target["token"]].pooled_bytes == 0
