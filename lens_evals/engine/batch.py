"""Per forward pass: which rows belong to which lens request, and what each hooked layer does.

One plan per step. Python loops over requests happen here, once per step; the layer taps
only run vectorised gathers and adds with the tensors prepared here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from lens_evals.engine.compat import BatchLayout
from lens_evals.engine.hooks import HookCall
from lens_evals.engine.requests import WorkerProbe, WorkerRequest


@dataclass
class LayerSteer:
    rows: torch.Tensor  # (n,) row indices in the step's token batch
    vectors: torch.Tensor  # (n, hidden): unit vectors where norm_match, raw otherwise
    scale: torch.Tensor  # (n, 1)
    norm_match: torch.Tensor  # (n, 1) bool
    any_norm_match: bool


@dataclass
class CaptureSlot:
    key: str
    row_start: int  # offset into the step's gathered capture rows
    num_rows: int
    positions: np.ndarray  # absolute positions of those rows
    layer_slots: list[int]  # indices into StepPlan.capture_layers


@dataclass
class LayerProbes:
    """Every probe row of one layer: one gather of ``rows``, one matmul with the distinct probes'
    stacked ``weights``, then each (row, probe) pair a request asked for is picked out."""

    rows: torch.Tensor  # (n,) row indices in the step's token batch
    weights: torch.Tensor  # (n_probes, hidden) float32, each distinct probe once
    bias: torch.Tensor  # (n_probes,) float32
    pair_rows: torch.Tensor  # (m,) index into ``rows``
    pair_probes: torch.Tensor  # (m,) index into ``weights``


@dataclass
class ScoreSlot:
    key: str
    num_rows: int
    positions: np.ndarray  # absolute positions of the request's rows in this step
    # (probe index in the request, layer, offset of its num_rows scores in that layer's pairs)
    entries: list[tuple[int, int, int]]


@dataclass
class StepPlan:
    capture_layers: list[int] = field(default_factory=list)
    capture_rows: torch.Tensor | None = None  # rows gathered at each capture layer
    capture_slots: list[CaptureSlot] = field(default_factory=list)
    steer: dict[int, LayerSteer] = field(default_factory=dict)
    probes: dict[int, LayerProbes] = field(default_factory=dict)
    score_slots: list[ScoreSlot] = field(default_factory=list)
    # generic hooks by site (layer, module path inside the layer or None, pre), in request order
    hook_calls: dict[tuple[int, str | None, bool], list[HookCall]] = field(default_factory=dict)
    keys: list[str] = field(default_factory=list)  # every lens request in this step

    @property
    def hooked_layers(self) -> set[int]:
        post_hooks = {layer for layer, module, pre in self.hook_calls if module is None and not pre}
        return set(self.capture_layers) | set(self.steer) | set(self.probes) | post_hooks


def _plan_hooks(
    plan: StepPlan, req: WorkerRequest, rows: tuple[int, int], positions: np.ndarray,
    step_ids: torch.Tensor | None, local_layers: set[int], device: torch.device,
) -> None:
    """The request's own hooks (sharing ``req.saved``), then its hook set's (``req.set_saved``)."""
    start, stop = rows
    position_tensor = torch.from_numpy(positions).to(device, non_blocking=True)
    token_ids = step_ids[start:stop] if step_ids is not None else None
    for hooks, saved in ((req.hooks, req.saved), (req.set_hooks, req.set_saved)):
        for hook in hooks:
            for layer in hook.layers:
                if layer in local_layers:
                    call = HookCall(req.key, hook, start, stop, position_tensor, token_ids, saved)
                    plan.hook_calls.setdefault((layer, hook.module, hook.pre), []).append(call)


class _ProbePlanner:
    """Collects one step's probe rows per layer; distinct probes (by digest) are stacked once."""

    def __init__(self) -> None:
        self.rows: dict[int, list[np.ndarray]] = {}
        self.num_rows: dict[int, int] = {}
        self.distinct: dict[int, dict[str, tuple[int, WorkerProbe]]] = {}
        self.pair_rows: dict[int, list[np.ndarray]] = {}
        self.pair_probes: dict[int, list[np.ndarray]] = {}
        self.num_pairs: dict[int, int] = {}
        self.slots: list[ScoreSlot] = []

    def add(self, key: str, rows: np.ndarray, positions: np.ndarray, probes: list[WorkerProbe], local_layers: set[int]) -> None:
        entries: list[tuple[int, int, int]] = []
        local_start: dict[int, int] = {}
        n = len(rows)
        for probe in probes:
            layer = probe.layer
            if layer not in local_layers:
                continue
            if layer not in local_start:  # the request's rows enter this layer's gather once
                local_start[layer] = self.num_rows.get(layer, 0)
                self.rows.setdefault(layer, []).append(rows)
                self.num_rows[layer] = local_start[layer] + n
            distinct = self.distinct.setdefault(layer, {})
            probe_slot = distinct.setdefault(probe.digest, (len(distinct), probe))[0]
            offset = self.num_pairs.get(layer, 0)
            self.pair_rows.setdefault(layer, []).append(np.arange(local_start[layer], local_start[layer] + n))
            self.pair_probes.setdefault(layer, []).append(np.full(n, probe_slot, dtype=np.int64))
            self.num_pairs[layer] = offset + n
            entries.append((probe.index, layer, offset))
        if entries:
            self.slots.append(ScoreSlot(key, n, positions, entries))

    def layers(self, device: torch.device) -> dict[int, LayerProbes]:
        out = {}
        for layer, rows in self.rows.items():
            probes = [probe for _, probe in self.distinct[layer].values()]
            out[layer] = LayerProbes(
                rows=torch.from_numpy(np.concatenate(rows)).to(device, non_blocking=True),
                weights=torch.stack([p.weights for p in probes]),
                bias=torch.tensor([p.bias for p in probes], dtype=torch.float32, device=device),
                pair_rows=torch.from_numpy(np.concatenate(self.pair_rows[layer])).to(device, non_blocking=True),
                pair_probes=torch.from_numpy(np.concatenate(self.pair_probes[layer])).to(device, non_blocking=True),
            )
        return out


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
    """Plan one step. ``capture_here`` is False on ranks that do not keep captures (TP > 0)."""
    plan = StepPlan()
    capture_rows: list[np.ndarray] = []
    pending_slots: list[tuple[WorkerRequest, int, np.ndarray, np.ndarray]] = []
    steer_parts: dict[int, list[tuple[np.ndarray, torch.Tensor, float, bool]]] = {}
    probe_planner = _ProbePlanner()
    step_ids: torch.Tensor | None = None  # the step's input ids, copied (vLLM reuses its buffer)
    offset = 0
    gathered = 0
    for req_id, n_rows, start in zip(layout.req_ids, layout.num_rows, layout.start_positions):
        req = requests.get(req_id)
        row_start, offset = offset, offset + n_rows
        if req is None or n_rows == 0:
            continue
        rows = np.arange(row_start, offset, dtype=np.int64)
        positions = np.arange(start, start + n_rows, dtype=np.int64)
        plan.keys.append(req.key)
        if capture_here and req.capture_layers and local_layers.intersection(req.capture_layers):
            pending_slots.append((req, gathered, rows, positions))
            capture_rows.append(rows)
            gathered += n_rows
        if capture_here and req.probes:
            probe_planner.add(req.key, rows, positions, req.probes, local_layers)
        if (req.hooks or req.set_hooks) and req.key not in failed:
            if step_ids is None and input_ids is not None:
                step_ids = input_ids.to(torch.int64, copy=True)
            _plan_hooks(plan, req, (row_start, offset), positions, step_ids, local_layers, device)
        for vec in req.steering:
            if vec.positions is None:
                vec_rows, vec_index = rows, None
            else:
                hit = np.isin(positions, vec.positions)
                if not hit.any():
                    continue
                vec_rows = rows[hit]
                vec_index = np.searchsorted(vec.positions, positions[hit])
            for layer, table in vec.vectors.items():
                if layer not in local_layers:
                    continue
                if vec_index is None:
                    block = table.expand(len(vec_rows), table.shape[-1])
                else:
                    block = table[torch.from_numpy(vec_index).to(device)]
                steer_parts.setdefault(layer, []).append((vec_rows, block, vec.scale, vec.norm_match))
    if not plan.keys:
        return None
    if pending_slots:
        union = sorted({layer for req, *_ in pending_slots for layer in req.capture_layers} & local_layers)
        plan.capture_layers = union
        index_of = {layer: i for i, layer in enumerate(union)}
        plan.capture_rows = torch.from_numpy(np.concatenate(capture_rows)).to(device, non_blocking=True)
        for req, row_start, rows, positions in pending_slots:
            slots = [index_of[layer] for layer in req.capture_layers if layer in index_of]
            plan.capture_slots.append(CaptureSlot(req.key, row_start, len(rows), positions, slots))
    plan.probes = probe_planner.layers(device)
    plan.score_slots = probe_planner.slots
    for layer, parts in steer_parts.items():
        rows = np.concatenate([p[0] for p in parts])
        norm = np.concatenate([np.full(len(p[0]), p[3]) for p in parts])
        scale = np.concatenate([np.full(len(p[0]), p[2], dtype=np.float32) for p in parts])
        plan.steer[layer] = LayerSteer(
            rows=torch.from_numpy(rows).to(device, non_blocking=True),
            vectors=torch.cat([p[1] for p in parts]),
            scale=torch.from_numpy(scale).to(device=device, dtype=dtype).unsqueeze(1),
            norm_match=torch.from_numpy(norm).to(device).unsqueeze(1),
            any_norm_match=bool(norm.any()),
        )
    return plan
