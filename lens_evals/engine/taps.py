"""The per-layer forward hooks: one batched add for steering, one gather for capture, one
gather and one matmul for all probe rows of the step."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from lens_evals.engine import compat

if TYPE_CHECKING:
    from lens_evals.engine.worker import LensWorkerState

logger = logging.getLogger("lens_evals")


def install_taps(state: "LensWorkerState", model: nn.Module, num_layers: int) -> list[int]:
    """Register a forward hook on every decoder layer of this stage; return their indices."""
    installed = []
    for index, layer in compat.decoder_layers(model, num_layers):
        layer.register_forward_hook(_make_tap(state, index))
        installed.append(index)
    return installed


def _make_tap(state: "LensWorkerState", layer_index: int):
    def tap(module: nn.Module, args: Any, output: Any) -> None:
        plan = state.plan
        if plan is None or layer_index not in plan.hooked_layers:
            return None
        try:
            hidden, residual = compat.split_layer_output(output)
            steer = plan.steer.get(layer_index)
            if steer is not None:
                _apply_steering(hidden, residual, steer)
            if layer_index in plan.capture_layers and plan.capture_rows is not None:
                rows = plan.capture_rows
                stream = hidden[rows] if residual is None else hidden[rows] + residual[rows]
                state.step_captures[layer_index] = stream
            probes = plan.probes.get(layer_index)
            if probes is not None:
                state.step_scores[layer_index] = _probe_scores(hidden, residual, probes)
        except Exception as exc:  # noqa: BLE001 - reported to every lens request of the step
            logger.exception("lens_evals: layer %d tap failed", layer_index)
            state.fail_keys(plan.keys, f"layer {layer_index} hook failed: {type(exc).__name__}: {exc}")
        return None

    return tap


def _apply_steering(hidden: torch.Tensor, residual: torch.Tensor | None, steer: Any) -> None:
    """h' = h + scale * v, or h + scale * ||h|| * v/||v|| with norm_match, on the steered rows.

    On fused-residual layers the stream is hidden + residual; adding to ``hidden`` moves the
    stream by exactly the delta."""
    delta = steer.vectors * steer.scale
    if steer.any_norm_match:
        rows_stream = hidden[steer.rows] if residual is None else hidden[steer.rows] + residual[steer.rows]
        norms = rows_stream.float().norm(dim=-1, keepdim=True).to(hidden.dtype)
        delta = delta * torch.where(steer.norm_match, norms, torch.ones_like(norms))
    hidden.index_add_(0, steer.rows, delta.to(hidden.dtype))


def _probe_scores(hidden: torch.Tensor, residual: torch.Tensor | None, probes: Any) -> torch.Tensor:
    """score = w . h + b (float32) for every (row, probe) pair the step's requests asked for."""
    rows = probes.rows
    stream = hidden[rows] if residual is None else hidden[rows] + residual[rows]
    every_pair = stream.float() @ probes.weights.T  # (n_rows, n_distinct_probes)
    return every_pair[probes.pair_rows, probes.pair_probes] + probes.bias[probes.pair_probes]
