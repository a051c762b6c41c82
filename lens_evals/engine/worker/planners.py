"""Planning one step: one planner per feature (capture, steering, probes, hooks) sees each lens
request's rows of the step and then writes its part of the ``StepPlan``; ``build_plan`` only
walks the batch. ``StepPlanner`` keeps the last plan: a decode step with the same requests and
row counts reuses it (new start positions only), so it costs no device work.

The planners only record spans while walking the batch; index tensors are built once per layer
with numpy and copied to the device without waiting for it."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from lens_evals.engine.compat.worker import BatchLayout
from lens_evals.engine.worker.hooks import HookCall
from lens_evals.engine.worker.plan import CaptureSlot, LayerProbes, LayerSteer, ScoreSlot, StepPlan
from lens_evals.engine.worker.readouts import plan_readouts
from lens_evals.engine.worker.requests import WorkerLensRequest, WorkerProbe
from lens_evals.engine.worker.spans import rows_of, span_of
from lens_evals.engine.worker.transfer import to_device


class RequestRows:
    """One lens request's rows in the step: rows ``start:start+num_rows`` of the token batch,
    at absolute positions from ``first_position``; ``index``: its place in the layout."""

    __slots__ = ("req", "index", "start", "num_rows", "first_position")

    def __init__(self, req: WorkerLensRequest, index: int, start: int, num_rows: int, first_position: int) -> None:
        self.req, self.index, self.start, self.num_rows, self.first_position = req, index, start, num_rows, first_position

    @property
    def span(self) -> tuple[int, int]:
        return self.start, self.num_rows

    def positions(self) -> np.ndarray:
        return np.arange(self.first_position, self.first_position + self.num_rows, dtype=np.int64)


class CapturePlanner:
    """The rows of capturing requests, gathered once per captured layer (a slice when contiguous)."""

    def __init__(self, local_layers: set[int], device: torch.device) -> None:
        self.local_layers, self.device = local_layers, device
        self.spans: list[tuple[int, int]] = []
        self.pending: list[tuple[WorkerLensRequest, int, int, int]] = []  # (request, gathered row, rows, layout index)
        self.gathered = 0

    def add(self, rows: RequestRows) -> None:
        req = rows.req
        if req.capture_layers and self.local_layers.intersection(req.capture_layers):
            self.pending.append((req, self.gathered, rows.num_rows, rows.index))
            self.spans.append(rows.span)
            self.gathered += rows.num_rows

    def finish(self, plan: StepPlan) -> None:
        if not self.pending:
            return
        union = sorted({layer for req, *_ in self.pending for layer in req.capture_layers} & self.local_layers)
        plan.capture_layers = union
        index_of = {layer: i for i, layer in enumerate(union)}
        plan.capture_span = span_of(self.spans)
        if plan.capture_span is None:
            plan.capture_rows = to_device(rows_of(self.spans), self.device)
        for req, row_start, n_rows, index in self.pending:
            slots: tuple[int, ...] | None = tuple(index_of[layer] for layer in req.capture_layers if layer in index_of)
            if slots == tuple(range(len(union))):
                slots = None  # every captured layer of the step, in order
            plan.capture_slots.append(CaptureSlot(req.key, row_start, n_rows, index, slots))


class ProbePlanner:
    """Collects one step's probe rows per layer; distinct probes (by digest) are stacked once."""

    def __init__(self, local_layers: set[int], device: torch.device, matrix: bool = True) -> None:
        self.local_layers, self.device, self.matrix = local_layers, device, matrix
        self.spans: dict[int, list[tuple[int, int]]] = {}
        self.num_rows: dict[int, int] = {}
        self.distinct: dict[int, dict[str, tuple[int, WorkerProbe]]] = {}
        self.pair_spans: dict[int, list[tuple[int, int]]] = {}
        self.pair_probes: dict[int, list[tuple[int, int]]] = {}  # (probe slot, count)
        self.num_pairs: dict[int, int] = {}
        self.slots: list[ScoreSlot] = []
        self.matrix_at: list[tuple[int, int]] = []  # per entry of the slots, in order: (probe slot, first row in the layer's gather)

    def add(self, rows: RequestRows) -> None:
        if not rows.req.probes:
            return
        entries: list[tuple[int, int, int]] = []
        local_start: dict[int, int] = {}
        span, n = rows.span, rows.num_rows
        for probe in rows.req.probes:
            layer = probe.layer
            if layer not in self.local_layers:
                continue
            if layer not in local_start:  # the request's rows enter this layer's gather once
                local_start[layer] = self.num_rows.get(layer, 0)
                self.spans.setdefault(layer, []).append(span)
                self.num_rows[layer] = local_start[layer] + n
            distinct = self.distinct.setdefault(layer, {})
            probe_slot = distinct.setdefault(probe.digest, (len(distinct), probe))[0]
            offset = self.num_pairs.get(layer, 0)
            self.pair_spans.setdefault(layer, []).append((local_start[layer], n))
            self.pair_probes.setdefault(layer, []).append((probe_slot, n))
            self.num_pairs[layer] = offset + n
            entries.append((probe.index, layer, offset))
            self.matrix_at.append((probe_slot, local_start[layer]))
        if entries:
            self.slots.append(ScoreSlot(rows.req.key, n, rows.index, entries))

    def finish(self, plan: StepPlan) -> None:
        plan.probes = self._layers()
        plan.score_slots = self.slots
        layer_offset, total = {}, 0
        for layer, probes in plan.probes.items():  # the step's scores are copied as one flat tensor, layer after layer
            size = probes.weights.shape[0] * self.num_rows[layer] if probes.matrix else self.num_pairs[layer]
            layer_offset[layer], total = total, total + size
        matrix_at = iter(self.matrix_at)
        for slot in plan.score_slots:
            offsets = []
            for _, layer, offset in slot.entries:
                probe_slot, local_start = next(matrix_at)
                if plan.probes[layer].matrix:  # probe-major: probe ``slot``'s scores of every row of the layer
                    offset = probe_slot * self.num_rows[layer] + local_start
                offsets.append(layer_offset[layer] + offset)
            slot.flat_offsets = tuple(offsets)

    def _layers(self) -> dict[int, LayerProbes]:
        device, out = self.device, {}
        for layer, spans in self.spans.items():
            probes = [probe for _, probe in self.distinct[layer].values()]
            # every (row, distinct probe) score is at most twice the pairs asked for (the usual
            # case: every request of the step has the same probes): score them all with one
            # matmul-add, no gather of pairs (``LayerProbes.matrix``)
            matrix = self.matrix and len(probes) * self.num_rows[layer] <= 2 * self.num_pairs[layer]
            slots = self.pair_probes[layer]
            pair_probes = np.repeat(np.array([slot for slot, _ in slots], dtype=np.int64), [n for _, n in slots])
            out[layer] = LayerProbes(
                rows=to_device(rows_of(spans), device),
                weights=torch.stack([p.weights for p in probes]),
                bias=to_device(np.array([p.bias for p in probes], dtype=np.float32), device),
                pair_rows=to_device(rows_of(self.pair_spans[layer]), device),
                pair_probes=to_device(pair_probes, device),
                span=span_of(spans),
                matrix=matrix,
            )
        return out


class SteeringPlanner:
    """Per layer, the steered rows and their vectors (one table row per position for vectors
    given at positions: then the plan is not reusable)."""

    def __init__(self, local_layers: set[int], device: torch.device, dtype: torch.dtype) -> None:
        self.local_layers, self.device, self.dtype = local_layers, device, dtype
        self.parts: dict[int, list[tuple[Any, torch.Tensor, float, bool, str | None]]] = {}
        self.positional = False

    def add(self, rows: RequestRows) -> None:
        n_rows, span = rows.num_rows, rows.span
        for vec in rows.req.steering:
            hit: tuple[np.ndarray, Any] | None = None
            if vec.positions is not None:
                self.positional = True
                hit = self._table_rows(vec, rows.positions(), span)
                if hit is None:
                    continue
            for layer, table in vec.vectors.items():
                if layer not in self.local_layers:
                    continue
                if hit is None:
                    block = table.expand(n_rows, table.shape[-1])
                    self.parts.setdefault(layer, []).append((span, block, vec.scale, vec.norm_match, vec.digest))
                else:
                    self.parts.setdefault(layer, []).append((hit[0], table[hit[1]], vec.scale, vec.norm_match, None))

    def _table_rows(self, vec: Any, positions: np.ndarray, span: tuple[int, int]) -> tuple[np.ndarray, Any] | None:
        """For a vector with positions: (rows it hits, index into its per-position table)."""
        hit = np.isin(positions, vec.positions)
        if not hit.any():
            return None
        rows = np.arange(span[0], span[0] + span[1], dtype=np.int64)[hit]
        return rows, to_device(np.searchsorted(vec.positions, positions[hit]), self.device)

    def finish(self, plan: StepPlan) -> None:
        if self.positional:
            plan.reusable = False
        for layer, parts in self.parts.items():
            plan.steer[layer] = self._layer(parts)

    def _layer(self, parts: list[tuple[Any, torch.Tensor, float, bool, str | None]]) -> LayerSteer:
        """parts: (rows as a (start, length) span or an index array, (n, hidden) block, scale,
        norm_match, the vector's digest)."""
        device = self.device
        span = None
        if all(isinstance(r, tuple) for r, *_ in parts):
            rows = rows_of([r for r, *_ in parts])
            span = span_of([r for r, *_ in parts])
        else:
            rows = np.concatenate([np.arange(r[0], r[0] + r[1], dtype=np.int64) if isinstance(r, tuple) else r for r, *_ in parts])
        if span is not None and (shared := _shared_vector(parts)) is not None:
            return self._broadcast(shared, parts[0][2], parts[0][3], span, rows)
        counts = [len(part[1]) for part in parts]
        norm = np.repeat(np.array([p[3] for p in parts], dtype=bool), counts)
        scale = np.repeat(np.array([p[2] for p in parts], dtype=np.float32), counts)
        vectors = torch.cat([part[1] for part in parts])
        scale_t = to_device(scale, device).unsqueeze(1)  # float32: the delta is rounded once, at the add
        any_norm = bool(norm.any())
        return LayerSteer(
            rows=to_device(rows, device),
            vectors=vectors,
            scale=scale_t,
            norm_match=to_device(norm, device).unsqueeze(1),
            any_norm_match=any_norm,
            delta=None if any_norm else vectors * scale_t,
            span=span,
            row_stop=int(rows.max()) + 1 if len(rows) else 0,
        )

    def _broadcast(self, vector: torch.Tensor, scale: float, norm_match: bool, span: tuple[int, int], rows: np.ndarray) -> LayerSteer:
        """Every steered row of the layer gets the same vector, scale and norm matching (e.g. one
        steering vector sent with every request of a batch): one (1, hidden) row, broadcast over
        the span by the add, instead of a (rows, hidden) block built on the host every step."""
        scale_t = torch.full((1, 1), scale, dtype=torch.float32, device=self.device)
        return LayerSteer(
            rows=to_device(rows, self.device),
            vectors=vector,
            scale=scale_t,
            norm_match=torch.full((1, 1), norm_match, dtype=torch.bool, device=self.device),
            any_norm_match=norm_match,
            delta=None if norm_match else vector * scale_t,
            span=span,
            row_stop=span[1],
        )


def _is_expanded_row(block: torch.Tensor) -> bool:
    """A (n, hidden) block that is one row repeated (``expand``: stride 0 along the rows)."""
    return block.dim() == 2 and (block.shape[0] == 1 or block.stride(0) == 0)


def _shared_vector(parts: list[tuple[Any, torch.Tensor, float, bool, str | None]]) -> torch.Tensor | None:
    """The (1, hidden) vector when every part repeats the same row with the same scale and norm
    matching; else None. Rows are the same when they are one tensor or their vectors' digests are
    equal: decided on the host, never by comparing device tensors (which waits for the GPU: 2-3 s
    of 12 prefill steps of 1,000 requests on the H200, 2026-12-04)."""
    first, scale, norm, digest = parts[0][1], parts[0][2], parts[0][3], parts[0][4]
    if not all(_is_expanded_row(part[1]) for part in parts):
        return None
    row = first[:1]
    for _, block, part_scale, part_norm, part_digest in parts[1:]:
        if part_scale != scale or part_norm != norm:
            return None
        same = block[:1].data_ptr() == row.data_ptr() or (digest is not None and part_digest == digest)
        if not same:
            return None
    return row.contiguous()


class HookPlanner:
    """Generic hook calls by site, in request order: the request's own hooks, then its hook
    set's; each hook's ``ctx.saved`` is its own dict, ``req.saved[str(index)]``
    (``req.set_saved`` for the set's), index = the hook's place in its list. Hooks see
    positions and token ids, so a step with hooks is never reused."""

    def __init__(
        self, local_layers: set[int], device: torch.device, input_ids: torch.Tensor | None, failed: set[str] | frozenset[str]
    ) -> None:
        self.local_layers, self.device, self.input_ids, self.failed = local_layers, device, input_ids, failed
        self.calls: dict[tuple[int, str | None, bool], list[HookCall]] = {}
        self.step_ids: torch.Tensor | None = None  # the step's input ids, copied (vLLM reuses its buffer)
        self.planned = False  # a request with hooks is in the step

    def add(self, rows: RequestRows) -> None:
        req = rows.req
        if not (req.hooks or req.set_hooks) or req.key in self.failed:
            return
        if self.step_ids is None and self.input_ids is not None:
            self.step_ids = self.input_ids.to(torch.int64, copy=True)
        start, stop = rows.start, rows.start + rows.num_rows
        position_tensor = to_device(rows.positions(), self.device)
        token_ids = self.step_ids[start:stop] if self.step_ids is not None else None
        for hooks, saved in ((req.hooks, req.saved), (req.set_hooks, req.set_saved)):
            for index, hook in enumerate(hooks):
                for layer in hook.layers:
                    if layer in self.local_layers:
                        own = saved.setdefault(str(index), {})
                        call = HookCall(req.key, hook, start, stop, position_tensor, token_ids, own)
                        self.calls.setdefault((layer, hook.module, hook.pre), []).append(call)
        self.planned = True

    def finish(self, plan: StepPlan) -> None:
        if self.planned:
            plan.reusable = False
        plan.hook_calls = self.calls


def build_plan(
    layout: BatchLayout,
    requests: dict[str, WorkerLensRequest | None],
    device: torch.device,
    dtype: torch.dtype,
    capture_here: bool,
    local_layers: set[int],
    input_ids: torch.Tensor | None = None,
    failed: set[str] | frozenset[str] = frozenset(),
    probe_matrix: bool = True,
) -> StepPlan | None:
    """Plan one step (None: no lens request in it). ``capture_here`` is False on ranks that do
    not keep captures (TP > 0): no capture or probe rows there. ``probe_matrix`` False: probe
    scores always by pairs (``LayerProbes.matrix`` never; the profile's comparison)."""
    planners: list[CapturePlanner | ProbePlanner | SteeringPlanner | HookPlanner] = []
    if capture_here:
        planners += [CapturePlanner(local_layers, device), ProbePlanner(local_layers, device, probe_matrix)]
    planners += [HookPlanner(local_layers, device, input_ids, failed), SteeringPlanner(local_layers, device, dtype)]
    keys: list[str] = []
    with_readouts: list[tuple[WorkerLensRequest, int, int, int]] = []
    row_start = 0
    for index, (req_id, n_rows, first_position) in enumerate(zip(layout.req_ids, layout.num_rows, layout.start_positions)):
        req = requests.get(req_id)
        if req is not None and n_rows:
            keys.append(req.key)
            rows = RequestRows(req, index, row_start, n_rows, first_position)
            for planner in planners:
                planner.add(rows)
            if req.readouts and req.key not in failed:
                with_readouts.append((req, index, row_start, n_rows))
        row_start += n_rows
    if not keys:
        return None
    plan = StepPlan(start_positions=layout.start_positions, keys=keys)
    for planner in planners:
        planner.finish(plan)
    if with_readouts:
        plan.readouts = plan_readouts(with_readouts, device, capture_here, local_layers)
    return plan.finish()


class StepPlanner:
    """Plans the steps of one worker and keeps the last reusable plan."""

    def __init__(self, device: torch.device, dtype: torch.dtype, capture_here: bool, local_layers: set[int]) -> None:
        self.device, self.dtype, self.capture_here, self.local_layers = device, dtype, capture_here, local_layers
        self._last: tuple[tuple[list[str], list[int]], StepPlan] | None = None
        self.probe_matrix = True  # see ``build_plan``

    def plan(
        self, layout: BatchLayout, requests: dict[str, WorkerLensRequest | None], input_ids: torch.Tensor | None, failed: set[str]
    ) -> StepPlan | None:
        """The step's plan; a decode step with the same requests and row counts as the last
        one reuses its tensors (only the start positions change)."""
        signature = (layout.req_ids, layout.num_rows)
        if self._last is not None and self._last[0] == signature:
            reused = self._last[1]
            reused.start_positions = layout.start_positions
            return reused
        plan = build_plan(
            layout, requests, self.device, self.dtype, self.capture_here, self.local_layers, input_ids, failed, self.probe_matrix
        )
        self._last = (signature, plan) if plan is not None and plan.reusable else None
        return plan
