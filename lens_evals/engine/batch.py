"""Per forward pass: which rows belong to which lens request, and what each hooked layer does.

One plan per step. Python loops over requests happen here, once per step; the layer taps
only run vectorised gathers and adds with the tensors prepared here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from lens_evals.engine.compat import BatchLayout
from lens_evals.engine.hooks import HookCall
from lens_evals.engine.requests import WorkerProbe, WorkerRequest
from lens_evals.engine.transfer import to_device


@dataclass
class LayerSteer:
    rows: torch.Tensor  # (n,) row indices in the step's token batch
    vectors: torch.Tensor  # (n, hidden): unit vectors where norm_match, raw otherwise
    scale: torch.Tensor  # (n, 1)
    norm_match: torch.Tensor  # (n, 1) bool
    any_norm_match: bool
    delta: torch.Tensor | None = None  # vectors * scale, when no row is norm-matched
    span: tuple[int, int] | None = None  # the rows as a slice, when they are contiguous
    row_stop: int = 0  # one past the highest row


@dataclass
class CaptureSlot:
    key: str
    row_start: int  # offset into the step's gathered capture rows
    num_rows: int
    batch_index: int  # the request's place in the step's layout (its first position is per step)
    layer_slots: tuple[int, ...] | None  # indices into StepPlan.capture_layers; None: all of them


@dataclass
class LayerProbes:
    """Every probe row of one layer: one gather of ``rows``, one matmul with the distinct probes'
    stacked ``weights``, then each (row, probe) pair a request asked for is picked out."""

    rows: torch.Tensor  # (n,) row indices in the step's token batch
    weights: torch.Tensor  # (n_probes, hidden) float32, each distinct probe once
    bias: torch.Tensor  # (n_probes,) float32
    pair_rows: torch.Tensor  # (m,) index into ``rows``
    pair_probes: torch.Tensor  # (m,) index into ``weights``
    span: tuple[int, int] | None = None  # the rows as a slice, when they are contiguous
    one_pair_per_row: bool = False  # one distinct probe and each row once: no pair gather


@dataclass
class ScoreSlot:
    key: str
    num_rows: int
    batch_index: int
    # (probe index in the request, layer, offset of its num_rows scores in that layer's pairs)
    entries: list[tuple[int, int, int]]
    flat_offsets: tuple[int, ...] = ()  # where each entry's scores start in the step's flat score copy


@dataclass
class StepPlan:
    capture_layers: list[int] = field(default_factory=list)
    capture_rows: torch.Tensor | None = None  # rows gathered at each capture layer ...
    capture_span: tuple[int, int] | None = None  # ... or, when they are contiguous, a slice
    capture_slots: list[CaptureSlot] = field(default_factory=list)
    steer: dict[int, LayerSteer] = field(default_factory=dict)
    probes: dict[int, LayerProbes] = field(default_factory=dict)
    score_slots: list[ScoreSlot] = field(default_factory=list)
    # generic hooks by site (layer, module path inside the layer or None, pre), in request order
    hook_calls: dict[tuple[int, str | None, bool], list[HookCall]] = field(default_factory=dict)
    keys: list[str] = field(default_factory=list)  # every lens request in this step
    # first absolute position of each request of the layout, set every step
    start_positions: list[int] = field(default_factory=list)
    # no position-dependent work (hooks, steering at given positions): the next step with the
    # same requests and row counts may reuse this plan with new start positions
    reusable: bool = True
    hooked_layers: set[int] = field(default_factory=set)

    def finish(self) -> StepPlan:
        post_hooks = {layer for layer, module, pre in self.hook_calls if module is None and not pre}
        self.hooked_layers = set(self.capture_layers) | set(self.steer) | set(self.probes) | post_hooks
        return self


def rows_of(spans: list[tuple[int, int]]) -> np.ndarray:
    """The row indices of (start, length) spans, concatenated."""
    starts = np.fromiter((s for s, _ in spans), dtype=np.int64, count=len(spans))
    lengths = np.fromiter((n for _, n in spans), dtype=np.int64, count=len(spans))
    total = int(lengths.sum())
    offsets = np.repeat(starts - (np.cumsum(lengths) - lengths), lengths)
    return offsets + np.arange(total, dtype=np.int64)


def span_of(spans: list[tuple[int, int]]) -> tuple[int, int] | None:
    """(start, stop) when the spans follow one another without gaps, else None."""
    expected = spans[0][0]
    for start, length in spans:
        if start != expected:
            return None
        expected += length
    return spans[0][0], expected


def _plan_hooks(
    plan: StepPlan, req: WorkerRequest, rows: tuple[int, int], positions: np.ndarray,
    step_ids: torch.Tensor | None, local_layers: set[int], device: torch.device,
) -> None:
    """The request's own hooks, then its hook set's; each hook's ``ctx.saved`` is its own dict,
    ``req.saved[str(index)]`` (``req.set_saved`` for the set's), index = the hook's place in its list."""
    start, stop = rows
    position_tensor = to_device(positions, device)
    token_ids = step_ids[start:stop] if step_ids is not None else None
    for hooks, saved in ((req.hooks, req.saved), (req.set_hooks, req.set_saved)):
        for index, hook in enumerate(hooks):
            for layer in hook.layers:
                if layer in local_layers:
                    own = saved.setdefault(str(index), {})
                    call = HookCall(req.key, hook, start, stop, position_tensor, token_ids, own)
                    plan.hook_calls.setdefault((layer, hook.module, hook.pre), []).append(call)


class _ProbePlanner:
    """Collects one step's probe rows per layer; distinct probes (by digest) are stacked once."""

    def __init__(self) -> None:
        self.spans: dict[int, list[tuple[int, int]]] = {}
        self.num_rows: dict[int, int] = {}
        self.distinct: dict[int, dict[str, tuple[int, WorkerProbe]]] = {}
        self.pair_spans: dict[int, list[tuple[int, int]]] = {}
        self.pair_probes: dict[int, list[tuple[int, int]]] = {}  # (probe slot, count)
        self.num_pairs: dict[int, int] = {}
        self.slots: list[ScoreSlot] = []

    def add(self, key: str, span: tuple[int, int], batch_index: int, probes: list[WorkerProbe], local_layers: set[int]) -> None:
        entries: list[tuple[int, int, int]] = []
        local_start: dict[int, int] = {}
        n = span[1]
        for probe in probes:
            layer = probe.layer
            if layer not in local_layers:
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
        if entries:
            self.slots.append(ScoreSlot(key, n, batch_index, entries))

    def layers(self, device: torch.device) -> dict[int, LayerProbes]:
        out = {}
        for layer, spans in self.spans.items():
            probes = [probe for _, probe in self.distinct[layer].values()]
            slots = self.pair_probes[layer]
            pair_probes = np.repeat(np.array([slot for slot, _ in slots], dtype=np.int64), [n for _, n in slots])
            pair_rows = rows_of(self.pair_spans[layer])
            out[layer] = LayerProbes(
                rows=to_device(rows_of(spans), device),
                weights=torch.stack([p.weights for p in probes]),
                bias=to_device(np.array([p.bias for p in probes], dtype=np.float32), device),
                pair_rows=to_device(pair_rows, device),
                pair_probes=to_device(pair_probes, device),
                span=span_of(spans),
                one_pair_per_row=len(probes) == 1 and np.array_equal(pair_rows, np.arange(self.num_rows[layer])),
            )
        return out


def _steer_table(vec: Any, positions: np.ndarray, span: tuple[int, int], device: torch.device) -> tuple[np.ndarray, Any] | None:
    """For a vector with positions: (rows it hits, index into its per-position table)."""
    hit = np.isin(positions, vec.positions)
    if not hit.any():
        return None
    rows = np.arange(span[0], span[0] + span[1], dtype=np.int64)[hit]
    return rows, to_device(np.searchsorted(vec.positions, positions[hit]), device)


def _layer_steer(parts: list[tuple[Any, torch.Tensor, float, bool]], device: torch.device, dtype: torch.dtype) -> LayerSteer:
    """parts: (rows as a (start, length) span or an index array, (n, hidden) block, scale, norm_match)."""
    span = None
    if all(isinstance(r, tuple) for r, *_ in parts):
        rows = rows_of([r for r, *_ in parts])
        span = span_of([r for r, *_ in parts])
    else:
        rows = np.concatenate([np.arange(r[0], r[0] + r[1], dtype=np.int64) if isinstance(r, tuple) else r for r, *_ in parts])
    counts = [len(block) for _, block, _, _ in parts]
    norm = np.repeat(np.array([p[3] for p in parts], dtype=bool), counts)
    scale = np.repeat(np.array([p[2] for p in parts], dtype=np.float32), counts)
    vectors = torch.cat([block for _, block, _, _ in parts])
    scale_t = to_device(scale, device).to(dtype).unsqueeze(1)
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


def build_plan(
    layout: BatchLayout,
    requests: dict[str, WorkerRequest | None],
    device: torch.device,
    dtype: torch.dtype,
    capture_here: bool,
    local_layers: set[int],
    input_ids: torch.Tensor | None = None,
    failed: set[str] | frozenset[str] = frozenset(),
) -> StepPlan | None:
    """Plan one step. ``capture_here`` is False on ranks that do not keep captures (TP > 0).

    The loop over requests only records spans; index tensors are built once per layer with
    numpy and copied to the device without waiting for it."""
    plan = StepPlan(start_positions=layout.start_positions)
    capture_spans: list[tuple[int, int]] = []
    pending_slots: list[tuple[WorkerRequest, int, int, int]] = []
    steer_parts: dict[int, list[tuple[Any, torch.Tensor, float, bool]]] = {}
    probe_planner = _ProbePlanner()
    step_ids: torch.Tensor | None = None  # the step's input ids, copied (vLLM reuses its buffer)
    offset = 0
    gathered = 0
    for index, (req_id, n_rows, start) in enumerate(zip(layout.req_ids, layout.num_rows, layout.start_positions)):
        req = requests.get(req_id)
        row_start, offset = offset, offset + n_rows
        if req is None or n_rows == 0:
            continue
        span = (row_start, n_rows)
        plan.keys.append(req.key)
        if capture_here and req.capture_layers and local_layers.intersection(req.capture_layers):
            pending_slots.append((req, gathered, n_rows, index))
            capture_spans.append(span)
            gathered += n_rows
        if capture_here and req.probes:
            probe_planner.add(req.key, span, index, req.probes, local_layers)
        positions = None
        if (req.hooks or req.set_hooks) and req.key not in failed:
            plan.reusable = False
            if step_ids is None and input_ids is not None:
                step_ids = input_ids.to(torch.int64, copy=True)
            positions = np.arange(start, start + n_rows, dtype=np.int64)
            _plan_hooks(plan, req, (row_start, offset), positions, step_ids, local_layers, device)
        for vec in req.steering:
            hit: tuple[np.ndarray, Any] | None = None
            if vec.positions is not None:
                plan.reusable = False
                if positions is None:
                    positions = np.arange(start, start + n_rows, dtype=np.int64)
                hit = _steer_table(vec, positions, span, device)
                if hit is None:
                    continue
            for layer, table in vec.vectors.items():
                if layer not in local_layers:
                    continue
                if hit is None:
                    steer_parts.setdefault(layer, []).append((span, table.expand(n_rows, table.shape[-1]), vec.scale, vec.norm_match))
                else:
                    steer_parts.setdefault(layer, []).append((hit[0], table[hit[1]], vec.scale, vec.norm_match))
    if not plan.keys:
        return None
    if pending_slots:
        union = sorted({layer for req, *_ in pending_slots for layer in req.capture_layers} & local_layers)
        plan.capture_layers = union
        index_of = {layer: i for i, layer in enumerate(union)}
        plan.capture_span = span_of(capture_spans)
        if plan.capture_span is None:
            plan.capture_rows = to_device(rows_of(capture_spans), device)
        for req, row_start, n_rows, index in pending_slots:
            slots: tuple[int, ...] | None = tuple(index_of[layer] for layer in req.capture_layers if layer in index_of)
            if slots == tuple(range(len(union))):
                slots = None  # every captured layer of the step, in order
            plan.capture_slots.append(CaptureSlot(req.key, row_start, n_rows, index, slots))
    plan.probes = probe_planner.layers(device)
    plan.score_slots = probe_planner.slots
    layer_offset, total = {}, 0
    for layer in plan.probes:  # the step's scores are copied as one flat tensor, layer after layer
        layer_offset[layer], total = total, total + probe_planner.num_pairs[layer]
    for slot in plan.score_slots:
        slot.flat_offsets = tuple(layer_offset[layer] + offset for _, layer, offset in slot.entries)
    for layer, parts in steer_parts.items():
        plan.steer[layer] = _layer_steer(parts, device, dtype)
    return plan.finish()
