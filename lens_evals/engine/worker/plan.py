"""A step's plan: which rows of the step's token batch belong to which lens request, and what
each hooked layer does with them (built by ``planners``, run by ``taps``, stored by
``step_stores``). Python loops over requests happen while planning, once per step; the layer
taps only run vectorised gathers and adds with the tensors held here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from lens_evals.engine.worker.hooks import HookCall
from lens_evals.engine.worker.readouts import StepReadouts


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
    capture_layer_indices: tuple[int, ...] | None  # indices into StepPlan.capture_layers; None: all of them


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
    # every (row, distinct probe) score, probe-major ``(n_probes, n_rows)``, in one matmul-add and
    # copied as it is: no gather of pairs (the pairs asked for are most of them)
    matrix: bool = False


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
    readouts: StepReadouts | None = None  # lens / SAE readout jobs per layer (worker/readouts.py)

    def finish(self) -> StepPlan:
        post_hooks = {layer for layer, module, pre in self.hook_calls if module is None and not pre}
        readout_layers = set(self.readouts.groups) if self.readouts is not None else set()
        self.hooked_layers = set(self.capture_layers) | set(self.steer) | set(self.probes) | post_hooks | readout_layers
        return self
