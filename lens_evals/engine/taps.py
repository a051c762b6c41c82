"""The per-layer forward hooks: one batched add for steering, one gather for capture, one
gather and one matmul for all probe rows of the step; generic hooks per request on its rows.

Order after a layer: steering, generic hooks, capture, probes (so captures and probes see the
stream as the next layer will)."""

from __future__ import annotations

import logging
from typing import Any, Protocol

import torch
from torch import nn

from lens_evals.engine import compat, timing
from lens_evals.engine.batch import StepPlan
from lens_evals.engine.hooks import HookCall, HookContext, run_calls

logger = logging.getLogger("lens_evals")


class StepHost(Protocol):
    """What the taps read and write during a forward pass: the step's plan (None: no lens request
    in this step), where the step's captures and probe scores go, and how a hook gets its context
    and reports a failed request. The worker's state provides it; the taps know nothing else of
    the worker (no import of it)."""

    plan: StepPlan | None
    step_captures: dict[int, torch.Tensor]
    step_scores: dict[int, torch.Tensor]

    def hook_context(self, call: HookCall, layer: int) -> HookContext: ...

    def fail_key(self, key: str, message: str) -> None: ...

    def has_failed(self, key: str) -> bool: ...

    def fail_keys(self, keys: list[str], message: str) -> None: ...


def install_taps(state: StepHost, layers: dict[int, nn.Module], contract: compat.StreamContract) -> None:
    """Register a forward hook on every decoder layer of this stage."""
    for index, layer in layers.items():
        layer.register_forward_hook(_make_tap(state, index, contract))


def install_hook_tap(state: StepHost, layer: nn.Module, site: tuple[int, str | None, bool], contract: compat.StreamContract) -> None:
    """A tap for generic hooks at (layer index, module path inside the layer or None, pre),
    installed the first time a request asks for that site. Raises AttributeError for a bad path."""
    layer_index, module_path, pre = site
    module = layer.get_submodule(module_path) if module_path else layer

    def run(hidden: torch.Tensor, residual: torch.Tensor | None) -> None:
        calls = state.plan.hook_calls.get(site) if state.plan is not None else None
        if calls:
            _run_hooks(state, calls, hidden, residual, layer_index)

    if pre:
        def pre_tap(mod: nn.Module, args: Any, kwargs: Any) -> None:
            if state.plan is not None and site in state.plan.hook_calls:
                run(*(contract.read_input(layer, args, kwargs) if module_path is None else (compat.first_input(args, kwargs), None)))
            return None

        module.register_forward_pre_hook(pre_tap, with_kwargs=True)
    elif module_path is not None:
        def post_tap(mod: nn.Module, args: Any, output: Any) -> None:
            if state.plan is not None and site in state.plan.hook_calls:
                run(compat.first_output(output), None)
            return None

        module.register_forward_hook(post_tap)


def _run_hooks(state: StepHost, calls: list[HookCall], hidden: torch.Tensor, residual: torch.Tensor | None, layer_index: int) -> None:
    """Rows of a fused-residual layer are hidden + residual; a replacement is written as
    hidden := new, residual := 0, so the next layer sees exactly ``new``."""

    def stream_of(start: int, stop: int) -> torch.Tensor:
        return hidden[start:stop] + residual[start:stop] if residual is not None else hidden[start:stop].clone()

    def put(start: int, stop: int, new: torch.Tensor) -> None:
        hidden[start:stop] = new.to(device=hidden.device, dtype=hidden.dtype)
        if residual is not None:
            residual[start:stop] = 0

    run_calls(calls, stream_of, put, layer_index, state.hook_context, state.fail_key, state.has_failed)


def _make_tap(state: StepHost, layer_index: int, contract: compat.StreamContract):
    def tap(module: nn.Module, args: Any, output: Any) -> None:
        plan = state.plan
        if plan is None or layer_index not in plan.hooked_layers:
            return None
        try:
            hidden, residual = contract.read_output(output)
            with timing.phase("taps (queued)"):
                run_layer(state, plan, layer_index, hidden, residual)
        except Exception as exc:  # noqa: BLE001 - reported to every lens request of the step
            logger.exception("lens_evals: layer %d tap failed", layer_index)
            state.fail_keys(plan.keys, f"layer {layer_index} hook failed: {type(exc).__name__}: {exc}")
        return None

    return tap


def run_layer(state: StepHost, plan: StepPlan, layer_index: int, hidden: torch.Tensor, residual: torch.Tensor | None) -> None:
    """What the step's plan does after one layer: steer, run hooks, capture, score probes."""
    steer = plan.steer.get(layer_index)
    if steer is not None:
        _apply_steering(hidden, residual, steer)
    calls = plan.hook_calls.get((layer_index, None, False))
    if calls:
        _run_hooks(state, calls, hidden, residual, layer_index)
    read_step(state, plan, layer_index, hidden, residual)


def read_step(state: StepHost, plan: StepPlan, layer_index: int, hidden: torch.Tensor, residual: torch.Tensor | None = None) -> None:
    """Capture and score the step's rows of one layer's stream (hidden + residual)."""
    if layer_index in plan.capture_layers:
        state.step_captures[layer_index] = _gather_stream(hidden, residual, plan.capture_span, plan.capture_rows)
    probes = plan.probes.get(layer_index)
    if probes is not None:
        state.step_scores[layer_index] = _probe_scores(hidden, residual, probes)


def _apply_steering(hidden: torch.Tensor, residual: torch.Tensor | None, steer: Any) -> None:
    """h' = h + scale * v, or h + scale * ||h|| * v/||v|| with norm_match, on the steered rows.

    On fused-residual layers the stream is hidden + residual; adding to ``hidden`` moves the
    stream by exactly the delta."""
    delta = steer.delta if steer.delta is not None else steer.vectors * steer.scale
    if steer.any_norm_match:
        rows_stream = _gather_stream(hidden, residual, steer.span, steer.rows)
        norms = rows_stream.float().norm(dim=-1, keepdim=True).to(hidden.dtype)
        delta = delta * torch.where(steer.norm_match, norms, torch.ones_like(norms))
    if steer.span is not None:
        hidden[steer.span[0] : steer.span[1]].add_(delta.to(hidden.dtype))
    else:
        hidden.index_add_(0, steer.rows, delta.to(hidden.dtype))


def _probe_scores(hidden: torch.Tensor, residual: torch.Tensor | None, probes: Any) -> torch.Tensor:
    """score = w . h + b (float32) for every (row, probe) pair the step's requests asked for."""
    stream = _gather_stream(hidden, residual, probes.span, probes.rows)
    every_pair = stream.float() @ probes.weights.T  # (n_rows, n_distinct_probes)
    if probes.one_pair_per_row:
        return every_pair[:, 0] + probes.bias[0]
    return every_pair[probes.pair_rows, probes.pair_probes] + probes.bias[probes.pair_probes]


def _gather_stream(hidden: torch.Tensor, residual: torch.Tensor | None, span: tuple[int, int] | None, rows: torch.Tensor | None) -> torch.Tensor:
    """The residual stream (hidden + residual on fused-residual layers) of some rows, as a new
    tensor: a slice when the rows are contiguous, else one index_select (much faster than
    advanced indexing)."""
    if span is not None:
        start, stop = span
        return hidden[start:stop] + residual[start:stop] if residual is not None else hidden[start:stop].clone()
    assert rows is not None
    picked = hidden.index_select(0, rows)
    return picked + residual.index_select(0, rows) if residual is not None else picked
