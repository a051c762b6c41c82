"""The step copy to the host on a CUDA side stream, overlapped with the next step (issue #21,
``engine/host_copy.py``). GPU only: on CPU there is no copy (``tests/engine/test_store.py`` checks that).

References: the rows the step computed, copied to the host synchronously (``.cpu()``) before the
store; the same engine's captures with the overlap off (``lens_evals_copy``), bit for bit. The
side stream is shown to be used by the copier's counts and by the next step's kernels finishing
while the copy's stream is held by an event (with the overlap off they queue behind it)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from lens_evals import LinearProbe
from lens_evals.engine.transport.protocol import COPY_METHOD
from tests.conftest import TINY_PROMPTS, capture, greedy, make_llm, on_gpu

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not on_gpu(), reason="needs a CUDA device")]

HIDDEN = 128
LAYERS = [1, 2]
LONG_PROMPT = " ".join(f"the probe reads {n} small data." for n in range(30))
PROMPTS = [LONG_PROMPT, *TINY_PROMPTS]  # mixed lengths: 2 to ~200 tokens
PROBE = LinearProbe(name="p", layer=2, weights=np.random.default_rng(4).normal(size=HIDDEN).astype(np.float32), bias=0.5)


def _store_steps(overlap: bool) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], Any]:
    """A WorkerCore on the GPU stores 4 prefill/decode steps of 3 mixed-length requests (2 capture
    layers, a probe); after each store the step's tensors are dropped and the memory refilled and
    overwritten by the next kernels. Returns the fetched rows, the rows computed (synchronously
    copied), and the copier."""
    from lens_evals.engine.compat.worker import BatchLayout
    from lens_evals.engine.frontend.rows import result_tensors
    from lens_evals.engine.worker.core import WorkerCore
    from lens_evals.engine.worker.host_copy import host_copier
    from lens_evals.engine.worker.requests import WorkerLensRequest, WorkerProbe
    from lens_evals.engine.worker.taps import run_layer

    device = torch.device("cuda")
    core = WorkerCore(device, torch.bfloat16, {0, 1, 2, 3})
    core.stores.copier = host_copier(device, overlap)
    weights = torch.randn(4096, device=device, generator=torch.Generator(device).manual_seed(1))
    names, lengths = ["a", "b", "c"], [5, 301, 47]
    for name in names:
        probes = [WorkerProbe(0, 2, "w", weights, 0.25)] if name == "b" else []
        core.ledger.track(name, WorkerLensRequest(key=f"k{name}", capture_layers=LAYERS, probes=probes))
    generator = torch.Generator(device).manual_seed(0)
    want: dict[str, list[torch.Tensor]] = {name: [] for name in names}
    want_scores: list[torch.Tensor] = []
    for step in range(4):
        rows = lengths if step == 0 else [1, 1, 1]
        positions = [0, 0, 0] if step == 0 else [n + step - 1 for n in lengths]
        plan = core.plan_step(BatchLayout(names, rows, positions), None)
        context = core.begin_step(plan)
        streams = {}
        for layer in LAYERS:
            hidden = torch.randn(sum(rows), 4096, device=device, generator=generator, dtype=torch.bfloat16)
            residual = torch.randn(sum(rows), 4096, device=device, generator=generator, dtype=torch.bfloat16)
            streams[layer] = (hidden + residual).cpu()
            run_layer(context, layer, hidden, residual)
            del hidden, residual
        step_scores = context.scores[2].float().cpu()
        core.store_step(context)
        del context  # the gathered rows' memory goes back to the allocator while the copy may run
        for _ in range(4):  # the next kernels take that memory and overwrite it
            torch.full((sum(rows) * 2, 4096), float(step + 7), device=device, dtype=torch.bfloat16).mul_(3)
        offset = 0
        for name, n in zip(names, rows):
            want[name].append(torch.stack([streams[layer][offset : offset + n] for layer in LAYERS]))
            if name == "b":
                want_scores.append(step_scores[:n])
            offset += n
    got = {name: result_tensors(core.pop_result(f"k{name}")) for name in names}
    expected = {name: torch.cat(parts, dim=1) for name, parts in want.items()}
    fetched = {name: tensors["residual_stream"] for name, tensors in got.items()}
    fetched["b-scores"] = got["b"]["probe_scores"][0]
    expected["b-scores"] = torch.cat(want_scores)
    assert core.held_bytes == 0
    return fetched, expected, core.stores.copier


@pytest.mark.parametrize("overlap", [True, False])
def test_stored_rows_equal_the_computed_rows_bit_for_bit(overlap: bool) -> None:
    fetched, expected, copier = _store_steps(overlap)
    for name, want in expected.items():
        assert fetched[name].shape == want.shape, name
        assert torch.equal(fetched[name], want), f"{name}: the host rows differ from what the step computed"
    assert copier.copies == 8  # 4 steps x (captures, scores)
    assert copier.overlapped == (8 if overlap else 0)


@pytest.mark.parametrize("overlap", [True, False])
def test_the_next_steps_kernels_do_not_wait_for_the_copy(overlap: bool) -> None:
    """The copy's stream is held by an event (``gate``) that a third stream records after sleeping
    ~1 s on the device; the next step's kernel is queued on the compute stream after the copy.
    With the overlap it finishes while the gate is still closed, the copy not begun; without, the
    compute stream itself waits for the gate, so the kernel finishes only after the copy. The
    order comes from the events, not from racing a copy's duration against a kernel's (that race
    failed once on the H200, 2026-12-04)."""
    from lens_evals.engine.worker.host_copy import PinnedArena, StreamCopy, host_copier

    device = torch.device("cuda")
    copier = host_copier(device, overlap)
    assert isinstance(copier, StreamCopy) and copier.overlap == overlap
    arena = PinnedArena(chunk_bytes=2**20)
    rows = torch.ones(2**24, device=device, dtype=torch.bfloat16)
    small = torch.ones(1024, device=device)  # allocated now: an allocation later could wait for the device
    small.add_(0)  # the kernel loaded now (CUDA loads a kernel at its first launch, waiting for the device)
    torch.cuda.synchronize()
    gate, gate_stream = torch.cuda.Event(), torch.cuda.Stream(device)
    with torch.cuda.stream(gate_stream):
        torch.cuda._sleep(2_000_000_000)  # ~1 s of device clock cycles
        gate.record(gate_stream)
    (copier.side_stream() if overlap else torch.cuda.current_stream(device)).wait_event(gate)
    host, ready, _ = copier.to_host(rows, arena)
    next_step = torch.cuda.Event()
    small.add_(1)  # the next step's first kernel
    next_step.record()
    next_step.synchronize()
    gate_open, copy_done = gate.query(), ready.query()
    ready.synchronize()
    assert bool((host[:: 2**16] == 1).all()) and bool((small == 2).all())
    if overlap:
        assert not gate_open and not copy_done, "the next step's kernel waited for the copy's stream"
    else:
        assert gate_open and copy_done, "without the overlap the kernel ran before the copy queued before it"


@pytest.fixture(scope="module", params=["eager", "graph"])
def engine(request, tiny_path):
    options: dict[str, Any] = {"enable_prefix_caching": False}
    if request.param == "graph":
        options.update(enforce_eager=False, additional_config={"lens_evals": {"graph_layers": LAYERS}})
    with make_llm(tiny_path, **options) as llm:
        yield llm


def _run(llm: Any) -> list[dict[str, torch.Tensor]]:
    params = [
        greedy(3, output_residual_stream=LAYERS, output_probe_scores=[PROBE]) if i % 2 == 0 else greedy(3, output_residual_stream=[2])
        for i in range(len(PROMPTS))
    ]
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    return [{"stream": capture(o), **({"scores": o.activations["probe_scores"]["p"]} if i % 2 == 0 else {})} for i, o in enumerate(outputs)]


def test_engine_captures_with_and_without_overlap_are_equal_bit_for_bit(engine) -> None:
    (start,) = engine.collective_rpc(COPY_METHOD, args=(True,))
    assert start["overlap"] is True
    overlapped = _run(engine)
    (after_on,) = engine.collective_rpc(COPY_METHOD, args=(False,))
    synchronous = _run(engine)
    (after_off,) = engine.collective_rpc(COPY_METHOD, args=(None,))
    engine.collective_rpc(COPY_METHOD, args=(True,))
    assert after_off["overlap"] is False
    assert after_on["overlapped"] - start["overlapped"] == after_on["copies"] - start["copies"] > 0  # all on the side stream
    assert after_off["overlapped"] == after_on["overlapped"] and after_off["copies"] > after_on["copies"]  # none
    for index, (a, b) in enumerate(zip(overlapped, synchronous)):
        assert a.keys() == b.keys()
        for key in a:
            assert a[key].shape == b[key].shape and torch.equal(a[key], b[key]), f"request {index} {key}"
    lengths = {tuple(item["stream"].shape[1:2]) for item in overlapped}
    assert len(lengths) > 3  # mixed lengths really were batched
