"""Decode runs (``worker/decode_runs.py``): the steps of one batch composition stored as one
piece per request, without an engine. Reference: each request's rows and probe scores computed
here from the step tensors, by absolute position (a later row of a position wins, as after a
recomputation), scores as w.h+b on the host."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from lens_evals.engine.compat.worker import BatchLayout
from lens_evals.engine.frontend.rows import result_tensors
from lens_evals.engine.transport import handoff
from lens_evals.engine.worker import decode_runs
from lens_evals.engine.worker.core import WorkerCore
from lens_evals.engine.worker.requests import WorkerLensRequest, WorkerProbe
from lens_evals.engine.worker.taps import run_layer

HIDDEN, LAYERS = 8, {0, 1, 2, 3}


def _probe(index: int, layer: int, seed: int, bias: float) -> WorkerProbe:
    return WorkerProbe(index, layer, f"w{seed}", torch.randn(HIDDEN, generator=torch.Generator().manual_seed(seed)), bias)


def _requests(shared_probes: bool) -> dict[str, WorkerLensRequest]:
    """Five requests: captures of one or two layers, and probes (the same three on most requests:
    scored as a matrix; else each its own: scored as pairs)."""
    out = {}
    for i in range(5):
        probes = [_probe(j, 2, 10 + j, 0.25 * j) for j in range(3)] if shared_probes and i != 4 else [_probe(0, 2, 20 + i, 0.5)]
        layers = [1, 2] if i % 2 else [2]
        out[f"r{i}"] = WorkerLensRequest(key=f"k{i}", capture_layers=layers, probes=probes)
    return out


def _copied(rows: Any) -> dict[str, Any]:
    """A sink that writes as the hand-off pool does (``copy_into`` a buffer), not by joining
    contiguous blocks as ``handoff.inline`` does."""
    data = bytearray(rows.nbytes)
    rows.copy_into(memoryview(data))
    return {"data": data}


SINKS = {"inline": handoff.inline, "copied": _copied}


def note_rows(seen: dict, positions: dict[str, int], names: list[str], rows: list[int], stream: dict[int, torch.Tensor]) -> None:
    """The reference: each request's rows of the step (``stream``: layer -> the step's rows, in
    request order) by absolute position, a later row of a position replacing an earlier one;
    each request's position moves on by its rows."""
    offset = 0
    for name, n in zip(names, rows):
        for layer, by_position in seen[name].items():
            for i in range(n):
                by_position[positions[name] + i] = stream[layer][offset + i]
        positions[name] += n
        offset += n


def _run(
    monkeypatch: pytest.MonkeyPatch,
    shared_probes: bool,
    fetch_at: int,
    fail_at: int,
    back_at: int,
    steps: int = 45,
    sink: handoff.Sink = handoff.inline,
):
    monkeypatch.setattr(decode_runs, "MAX_SEGMENT_STEPS", 8)  # several segments in one run
    core = WorkerCore(torch.device("cpu"), torch.float32, LAYERS)
    requests = _requests(shared_probes)
    for req_id, req in requests.items():
        core.ledger.track(req_id, req)
    seen: dict[str, dict[int, dict[int, torch.Tensor]]] = {k: {1: {}, 2: {}} for k in requests}  # request -> layer -> position -> row
    generator = torch.Generator().manual_seed(0)
    results, positions = {}, {k: 0 for k in requests}
    names = list(requests)
    for step in range(steps):
        rows = [3 if step == 0 else 1] * len(names)
        if step == back_at:  # a position computed again (a rejected speculative token, say)
            for name in names:
                positions[name] -= 1
        layout = BatchLayout(list(names), rows, [positions[n] for n in names])
        plan = core.plan_step(layout, None)
        context = core.begin_step(plan)
        stream = {}
        for layer in (1, 2):
            hidden = torch.randn(sum(rows), HIDDEN, generator=generator)
            residual = torch.randn(sum(rows), HIDDEN, generator=generator)
            run_layer(context, layer, hidden, residual)
            stream[layer] = hidden + residual
        core.store_step(context)
        note_rows(seen, positions, names, rows, stream)
        if step == fetch_at:  # fetched while it runs: the rows so far
            results["r1"] = core.pop_result("k1", sink)
            frozen_r1 = {layer: dict(v) for layer, v in seen["r1"].items()}
        if step == fail_at:
            core.ledger.fail_key("k3", "failed on purpose")
    for name in names:
        core.finish(name)
        if name != "r1":
            results[name] = core.pop_result(requests[name].key, sink)
    seen["r1"] = frozen_r1
    return core, requests, seen, results


@pytest.mark.parametrize("sink", sorted(SINKS))
@pytest.mark.parametrize("shared_probes", [True, False])
def test_a_decode_run_returns_every_row_and_score_by_position(monkeypatch: pytest.MonkeyPatch, shared_probes: bool, sink: str) -> None:
    """``copied``: the segments' strided views written straight into place (the pool's path)."""
    core, requests, seen, results = _run(monkeypatch, shared_probes, fetch_at=20, fail_at=30, back_at=37, sink=SINKS[sink])
    assert "error" in results["r3"] and "failed on purpose" in results["r3"]["error"]
    for name, req in requests.items():
        if name == "r3":
            continue
        tensors = result_tensors(results[name])
        last = max(seen[name][2])
        for index, layer in enumerate(req.capture_layers):
            want = torch.stack([seen[name][layer][p] for p in range(last + 1)])
            assert torch.equal(tensors["residual_stream"][index], want), (name, layer)
        stream = torch.stack([seen[name][2][p] for p in range(last + 1)])
        for probe in req.probes:
            torch.testing.assert_close(
                tensors["probe_scores"][probe.index], stream @ probe.weights + probe.bias, msg=f"{name} probe {probe.index}"
            )
    assert core.held_bytes == 0


def test_a_decode_run_keeps_one_piece_per_segment_not_per_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """30 decode steps of one composition, segments of 8 steps: a handful of pieces per
    request (one per step before decode runs)."""
    monkeypatch.setattr(decode_runs, "MAX_SEGMENT_STEPS", 8)
    core = WorkerCore(torch.device("cpu"), torch.float32, LAYERS)
    for req_id, req in _requests(True).items():
        core.ledger.track(req_id, req)
    names = [f"r{i}" for i in range(5)]
    for step in range(31):
        layout = BatchLayout(names, [1] * 5, [step] * 5)
        context = core.begin_step(core.plan_step(layout, None))
        for layer in (1, 2):
            run_layer(context, layer, torch.randn(5, HIDDEN), torch.randn(5, HIDDEN))
        core.store_step(context)
    # rows held, not a segment's room: 31 steps x (2 layers x 5 rows x 8 floats + 4 probes x 5 rows) x 4 bytes
    assert core.held_bytes == 31 * (2 * 5 * 8 + 4 * 5) * 4
    core.stores.end_runs()
    pieces = core.stores.captures.by_key["k0"]
    assert len(pieces) <= 6 and sum(piece.num_rows for piece in pieces) == 31
    assert len(core.stores.scores.by_key["k0"]) <= 6
