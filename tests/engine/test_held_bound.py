"""The worker's bound on captured rows held until fetched (``LENS_EVALS_MAX_HELD_CAPTURE_GIB``,
issue #47): rows on their way to the frontend's pool are waited for, not dropped; a capture that
cannot fit fails with an error naming the bound, its bytes and the variable, while the other
requests of the call keep their captures; the default follows the host's memory."""

from __future__ import annotations

import threading

import pytest
import torch

from lens_evals import host_memory, settings
from lens_evals.engine.frontend.rows import result_tensors
from lens_evals.engine.transport.handoff import claim_all
from tests.conftest import TINY_PROMPTS, capture, greedy, make_llm
from tests.engine.test_handoff import _core_with_rows, sent, target  # noqa: F401  (``target`` is a fixture)

LAYERS = [0, 1, 2, 3]
BOUND_GIB = "0.00005"  # 53,687 bytes: 2 or 3 of these prompts' captures (4 layers x ~6-14 tokens x 128 x 4 B)


def test_a_call_past_the_bound_keeps_what_fits_and_names_the_bound_for_the_rest(tiny_path, monkeypatch) -> None:
    """In-process (the frontend's rows are written early as inline bytes, which stay in the
    worker's memory until the call's one fetch), one request per step: the call's 8 captures
    (~170 KB) pass a ~54 KB bound, so the oldest finished ones are dropped. Their error names the
    variable and the bytes (before the fix: "no capture came back for layers [0, 1, 2, 3]"); the
    others, the last one among them, equal each prompt captured alone."""
    from lens_evals.engine.frontend.attach import LensRequestError

    monkeypatch.setenv("LENS_EVALS_MAX_HELD_CAPTURE_GIB", BOUND_GIB)  # read when the worker starts
    with make_llm(tiny_path, max_num_seqs=1, enable_prefix_caching=False) as engine:
        solo = [capture(engine.generate([prompt], greedy(1, output_residual_stream=LAYERS), use_tqdm=False)[0]) for prompt in TINY_PROMPTS]
        with pytest.raises(LensRequestError) as info:
            engine.generate(TINY_PROMPTS, greedy(1, output_residual_stream=LAYERS), use_tqdm=False)
        assert engine.collective_rpc("lens_evals_memory")[0]["held_bytes"] == 0
    message = str(info.value)
    assert "no capture came back" not in message, message
    errors = [part for part in message.split("; request ") if part]
    assert all("dropped before it was fetched" in error for error in errors), message
    assert "over LENS_EVALS_MAX_HELD_CAPTURE_GIB (5e-05 GiB = 53687 bytes)" in errors[0] and "raise it" in errors[0]
    outputs = info.value.outputs
    assert outputs is not None
    kept = [i for i, output in enumerate(outputs) if output.activations is not None]
    assert len(errors) + len(kept) == len(TINY_PROMPTS) and len(TINY_PROMPTS) - 1 in kept and len(kept) >= 2
    for i in kept:
        assert torch.equal(capture(outputs[i]), solo[i]), i


def _block_the_writer(gate: threading.Event) -> None:
    """The worker's early writes queue up behind a task that waits for ``gate`` (as behind a
    writer slower than the steps: issue #47's 11 GB capture on an H100)."""
    from lens_evals.engine.worker.stream_write import writer

    writer().submit(gate.wait, 60)


def test_rows_being_written_into_the_pool_are_waited_for_not_dropped(target) -> None:  # noqa: F811
    """Three finished requests (14,400 bytes of step buffers) wait for a blocked writer when the
    next step passes a 7,000-byte bound: the worker waits for the writes (the writer is let go
    after 0.3 s), the rows leave for the pool, and nothing is dropped; every request's rows come
    back equal to those computed. Before the fix the three were dropped unfetched."""
    from lens_evals.engine.compat.worker import BatchLayout
    from lens_evals.engine.worker.requests import WorkerLensRequest
    from lens_evals.engine.worker.taps import run_layer

    core, want = _core_with_rows(target)
    gate = threading.Event()
    _block_the_writer(gate)
    for name in ("r0", "r1", "r2"):
        core.finish(name)
    assert core.held_bytes == 14400 and core.early.written == 0
    core.stores.max_held_bytes = 7000
    core.ledger.track("r3", WorkerLensRequest(key="k3", capture_layers=[1], handoff=dict(target)))
    context = core.begin_step(core.plan_step(BatchLayout(["r3"], [2], [0]), None))
    hidden, residual = torch.randn(2, 300), torch.randn(2, 300)
    run_layer(context, 1, hidden, residual)
    threading.Timer(0.3, gate.set).start()
    core.store_step(context)
    assert gate.is_set() and core.early.written == 3 and core.held_bytes == 2 * 300 * 4  # r3's step only
    reply = core.fetch_results(["k0", "k1", "k2", "k3"], sent())
    claim_all([reply])
    for key, rows in (want | {"k3": (hidden + residual)[None]}).items():
        assert reply[key] is not None and "error" not in reply[key], (key, reply[key])
        assert torch.equal(result_tensors(reply[key])["residual_stream"], rows), key


def test_the_default_bound_is_a_quarter_of_the_host_memory(monkeypatch) -> None:
    """Hand-computed: a 128 GB host (issue #47's H100) holds 32 GB, so its 11 GB capture fits; a
    24 GiB host keeps the 8 GiB floor; a host whose memory cannot be read, 8 GiB. The variable
    still wins."""
    monkeypatch.delenv("LENS_EVALS_MAX_HELD_CAPTURE_GIB", raising=False)
    for memory, held in ((128 * 10**9, 32 * 10**9), (24 * 2**30, 8 * 2**30), (None, 8 * 2**30)):
        monkeypatch.setattr(host_memory, "host_memory_bytes", lambda memory=memory: memory)
        assert settings.MAX_HELD_CAPTURE_GIB.in_bytes() == held, memory
    monkeypatch.setenv("LENS_EVALS_MAX_HELD_CAPTURE_GIB", "2")
    assert settings.MAX_HELD_CAPTURE_GIB.in_bytes() == 2 * 2**30
