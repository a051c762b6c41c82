"""The per-layer forward hooks: one batched add for steering, one gather for capture, one
gather and one matmul for all probe rows of the step; generic hooks per request on its rows.

Order after a layer: steering, generic hooks, capture, probes (so captures and probes see the
stream as the next layer will)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from lens_evals.engine import compat
from lens_evals.engine.transport import timing
from lens_evals.engine.worker.hooks import HookCall, HookContext, run_calls
from lens_evals.engine.worker.plan import LayerProbes, LayerSteer, StepPlan
from lens_evals.engine.worker.readouts import Head, run_layer_readouts

logger = logging.getLogger("lens_evals")


@dataclass
class StepContext:
    """One step as the taps see it, handed to them by the worker: the step's plan, where each
    layer's captures and probe scores go, how a hook gets its context and how a request is
    failed. The taps know nothing else of the worker (no import of it)."""

    plan: StepPlan
    hook_context: Callable[[HookCall, int], HookContext]
    fail_key: Callable[[str, str], None]
    has_failed: Callable[[str], bool]
    captures: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> the step's gathered rows
    # several capture layers: each layer's rows gathered straight into its slot of one
    # (n_layers, n_rows, hidden) block, which the store copies to the host as it is (no stack)
    capture_block: torch.Tensor | None = None
    scores: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> the step's probe scores
    head: Head | None = None  # the model's final norm + logits, for lens readouts (compat.worker.readout_head)
    readout_results: list[torch.Tensor] = field(default_factory=list)  # the step's readout jobs' results, in plan order

    def fail_keys(self, keys: list[str], message: str) -> None:
        for key in keys:
            self.fail_key(key, message)


class ActiveStep:
    """Where the installed taps find the step being run: None between steps and in steps
    without a lens request."""

    __slots__ = ("step",)

    def __init__(self) -> None:
        self.step: StepContext | None = None


def install_taps(active: ActiveStep, layers: dict[int, nn.Module], contract: compat.architectures.StreamContract) -> None:
    """Register a forward hook on every decoder layer of this stage."""
    for index, layer in layers.items():
        layer.register_forward_hook(_make_tap(active, index, contract))


def install_hook_tap(
    active: ActiveStep, layer: nn.Module, site: tuple[int, str | None, bool], contract: compat.architectures.StreamContract
) -> None:
    """A tap for generic hooks at (layer index, module path inside the layer or None, pre),
    installed the first time a request asks for that site. Raises AttributeError for a bad path."""
    layer_index, module_path, pre = site
    module = layer.get_submodule(module_path) if module_path else layer

    def calls_here() -> tuple[StepContext, list[HookCall]] | None:
        step = active.step
        calls = step.plan.hook_calls.get(site) if step is not None else None
        return (step, calls) if step is not None and calls else None

    if pre:

        def pre_tap(mod: nn.Module, args: Any, kwargs: Any) -> None:
            if (here := calls_here()) is not None:
                hidden, residual = (
                    contract.read_input(layer, args, kwargs) if module_path is None else (compat.worker.first_input(args, kwargs), None)
                )
                _run_hooks(here[0], here[1], hidden, residual, layer_index)
            return None

        module.register_forward_pre_hook(pre_tap, with_kwargs=True)
    elif module_path is not None:

        def post_tap(mod: nn.Module, args: Any, output: Any) -> None:
            if (here := calls_here()) is not None:
                _run_hooks(here[0], here[1], compat.worker.first_output(output), None, layer_index)
            return None

        module.register_forward_hook(post_tap)


class HookSites:
    """The generic-hook taps installed so far, one per site (layer index, module path inside the
    layer or None, pre): a site is tapped the first time a step's plan asks for it; a module path
    the layer does not have fails the requests that asked for it."""

    def __init__(self, active: ActiveStep, layers: dict[int, nn.Module], contract: compat.architectures.StreamContract | None) -> None:
        self.active, self.layers, self.contract = active, layers, contract
        self.installed: set[tuple[int, str | None, bool]] = set()

    def install_for(self, step: StepContext) -> None:
        plan = step.plan
        for site in list(plan.hook_calls):
            if site in self.installed:
                continue
            try:
                install_hook_tap(self.active, self.layers[site[0]], site, self.contract)  # type: ignore[arg-type]  # None only with a refusal: no lens step runs
                self.installed.add(site)
            except AttributeError:
                calls = plan.hook_calls.pop(site)
                message = f"layer {site[0]} has no submodule {site[1]!r} to hook"
                for call in calls:
                    step.fail_key(call.key, message)


def _run_hooks(step: StepContext, calls: list[HookCall], hidden: torch.Tensor, residual: torch.Tensor | None, layer_index: int) -> None:
    """Rows of a fused-residual layer are hidden + residual; a replacement is written as
    hidden := new, residual := 0, so the next layer sees exactly ``new``."""

    def stream_of(start: int, stop: int) -> torch.Tensor:
        return hidden[start:stop] + residual[start:stop] if residual is not None else hidden[start:stop].clone()

    def put(start: int, stop: int, new: torch.Tensor) -> None:
        hidden[start:stop] = new.to(device=hidden.device, dtype=hidden.dtype)
        if residual is not None:
            residual[start:stop] = 0

    run_calls(calls, stream_of, put, layer_index, step.hook_context, step.fail_key, step.has_failed)


def _make_tap(active: ActiveStep, layer_index: int, contract: compat.architectures.StreamContract) -> Callable[..., None]:
    def tap(module: nn.Module, args: Any, output: Any) -> None:
        step = active.step
        if step is None or layer_index not in step.plan.hooked_layers:
            return None
        try:
            hidden, residual = contract.read_output(output)
            with timing.phase("taps (queued)"):
                run_layer(step, layer_index, hidden, residual)
        except Exception as exc:  # noqa: BLE001 - reported to every lens request of the step
            logger.exception("lens_evals: layer %d tap failed", layer_index)
            step.fail_keys(step.plan.keys, f"layer {layer_index} hook failed: {type(exc).__name__}: {exc}")
        return None

    return tap


def run_layer(step: StepContext, layer_index: int, hidden: torch.Tensor, residual: torch.Tensor | None) -> None:
    """What the step's plan does after one layer: steer, run hooks, capture, score probes."""
    plan = step.plan
    steer = plan.steer.get(layer_index)
    if steer is not None:
        _apply_steering(hidden, residual, steer)
    calls = plan.hook_calls.get((layer_index, None, False))
    if calls:
        _run_hooks(step, calls, hidden, residual, layer_index)
    read_step(step, layer_index, hidden, residual)


def read_step(step: StepContext, layer_index: int, hidden: torch.Tensor, residual: torch.Tensor | None = None) -> None:
    """Capture and score the step's rows of one layer's stream (hidden + residual)."""
    plan = step.plan
    if layer_index in plan.capture_layers:
        with timing.phase(timing.DETAIL + "capture rows"):
            step.captures[layer_index] = _capture(step, layer_index, hidden, residual)
    probes = plan.probes.get(layer_index)
    if probes is not None:
        with timing.phase(timing.DETAIL + "probe scores"):
            step.scores[layer_index] = _probe_scores(hidden, residual, probes)
    groups = plan.readouts.groups.get(layer_index) if plan.readouts is not None else None
    if groups:
        step.readout_results += run_layer_readouts(groups, hidden, residual, step.head)


def _apply_steering(hidden: torch.Tensor, residual: torch.Tensor | None, steer: LayerSteer) -> None:
    """h' = h + scale * v, or h + scale * ||h|| * v/||v|| with norm_match, on the steered rows.

    On fused-residual layers the stream is hidden + residual; adding to ``hidden`` moves the
    stream by exactly the delta."""
    delta = steer.delta if steer.delta is not None else steer.vectors * steer.scale
    if steer.any_norm_match:
        rows_stream = _gather_stream(hidden, residual, steer.span, steer.rows)
        norms = rows_stream.float().norm(dim=-1, keepdim=True)
        delta = delta * torch.where(steer.norm_match, norms, torch.ones_like(norms))
    if steer.span is not None:
        hidden[steer.span[0] : steer.span[1]].add_(delta.to(hidden.dtype))
    else:
        hidden.index_add_(0, steer.rows, delta.to(hidden.dtype))


def _probe_scores(hidden: torch.Tensor, residual: torch.Tensor | None, probes: LayerProbes) -> torch.Tensor:
    """score = w . h + b (float32) for every (row, probe) pair the step's requests asked for
    (``probes.matrix``: for every row and distinct probe, probe-major, flattened)."""
    stream = _stream_rows(hidden, residual, probes.span, probes.rows).float()
    if probes.matrix:
        return torch.addmm(probes.bias.unsqueeze(1), probes.weights, stream.T).reshape(-1)
    every_pair = stream @ probes.weights.T  # (n_rows, n_distinct_probes)
    return every_pair[probes.pair_rows, probes.pair_probes] + probes.bias[probes.pair_probes]


def _stream_rows(hidden: torch.Tensor, residual: torch.Tensor | None, span: tuple[int, int] | None, rows: torch.Tensor) -> torch.Tensor:
    """The stream of some rows to read at once (a view of ``hidden`` when it can be: no copy)."""
    if span is not None and residual is None:
        return hidden[span[0] : span[1]]
    return _gather_stream(hidden, residual, span, rows)


def _capture(step: StepContext, layer_index: int, hidden: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
    """The step's capture rows of one layer: a tensor of their own for one capture layer, else
    this layer's slot of the step's block (made at the first capture layer of the step)."""
    plan = step.plan
    if len(plan.capture_layers) == 1:
        return _gather_stream(hidden, residual, plan.capture_span, plan.capture_rows)
    block = step.capture_block
    if block is None or block.dtype != hidden.dtype or block.device != hidden.device:
        if plan.capture_span is not None:
            n_rows = plan.capture_span[1] - plan.capture_span[0]
        else:
            assert plan.capture_rows is not None
            n_rows = plan.capture_rows.shape[0]
        block = step.capture_block = hidden.new_empty((len(plan.capture_layers), n_rows, hidden.shape[-1]))
    out = block[plan.capture_layers.index(layer_index)]
    return _gather_stream(hidden, residual, plan.capture_span, plan.capture_rows, out)


def _gather_stream(
    hidden: torch.Tensor,
    residual: torch.Tensor | None,
    span: tuple[int, int] | None,
    rows: torch.Tensor | None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The residual stream (hidden + residual on fused-residual layers) of some rows, as a new
    tensor (or written into ``out``): a slice when the rows are contiguous, else one
    index_select (much faster than advanced indexing)."""
    if span is not None:
        start, stop = span
        if out is None:
            return hidden[start:stop] + residual[start:stop] if residual is not None else hidden[start:stop].clone()
        if residual is not None:
            return torch.add(hidden[start:stop], residual[start:stop], out=out)
        return out.copy_(hidden[start:stop])
    assert rows is not None
    if out is None:
        picked = hidden.index_select(0, rows)
        return picked + residual.index_select(0, rows) if residual is not None else picked
    torch.index_select(hidden, 0, rows, out=out)
    return out.add_(residual.index_select(0, rows)) if residual is not None else out
