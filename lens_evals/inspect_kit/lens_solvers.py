"""Solvers usable from any task: generate while capturing the residual stream, or while
steering it. Tensors stay in memory (the task state's store); compact, readable summaries
go into the assistant message's metadata, which the Inspect log viewer shows."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from inspect_ai.model import ChatMessageAssistant
from inspect_ai.solver import Generate, Solver, TaskState, solver

from lens_evals.inspect_kit.provider.outputs import ACTIVATIONS_KEY, output_activations
from lens_evals.request.spec import CAPTURE_KEY, STEERING_KEY, SteeringVector
from lens_evals.request.wire_model import float32_array

ACTIVATIONS_STORE_KEY = "lens_evals:activations"
CAPTURE_LAYERS_STORE_KEY = "lens_evals:capture_layers"


def _summary(stream: Any, layers: Sequence[int]) -> dict[str, Any]:
    norms = stream.float().norm(dim=-1)  # (n_layers, n_positions)
    return {
        "layers": list(layers),
        "n_positions": int(stream.shape[1]),
        "mean_norm": {str(layer): round(float(norms[i].mean()), 3) for i, layer in enumerate(layers)},
    }


def _last_assistant(state: TaskState) -> ChatMessageAssistant | None:
    for message in reversed(state.messages):
        if isinstance(message, ChatMessageAssistant):
            return message
    return None


@solver
def capture_activations(layers: Sequence[int], **generate_args: Any) -> Solver:
    """Generate, capturing the residual stream after ``layers`` for prompt and response.

    The tensor ``(n_layers, n_positions, hidden)`` goes to ``state.store`` under
    ``"lens_evals:activations"`` (not written to the log); per-layer mean norms go into the
    assistant message's metadata."""
    layer_list = sorted(int(layer) for layer in layers)

    async def solve(state: TaskState, generate: Generate) -> TaskState:
        extra_args = {CAPTURE_KEY: layer_list}
        state = await generate(state, extra_body={"extra_args": extra_args}, **generate_args)
        stream = output_activations(state.output, "residual_stream", keep=True)["residual_stream"]
        state.store.set(ACTIVATIONS_STORE_KEY, stream)
        state.store.set(CAPTURE_LAYERS_STORE_KEY, layer_list)
        message = _last_assistant(state)
        if message is not None:
            message.metadata = {**(message.metadata or {}), "lens_capture": _summary(stream, layer_list)}
        return state

    return solve


@solver
def steer(
    vector: Any,
    layers: Sequence[int],
    scale: float = 1.0,
    norm_match: bool = False,
    positions: Sequence[int] | None = None,
    capture_layers: Sequence[int] | None = None,
    **generate_args: Any,
) -> Solver:
    """Generate with ``vector`` added to the residual stream after each of ``layers``.

    ``vector`` is ``(hidden,)`` (same vector at every layer), ``(n_layers, hidden)`` or
    ``(n_layers, n_positions, hidden)`` with absolute ``positions``. With ``capture_layers``
    the steered run's residual stream is captured too."""
    layer_list = [int(layer) for layer in layers]
    acts = float32_array(vector)
    if acts.ndim == 1:
        acts = np.repeat(acts[None, :], len(layer_list), axis=0)
    steering = SteeringVector(
        activations=acts,
        layer_indices=layer_list,
        scale=scale,
        norm_match=norm_match,
        position_indices=list(positions) if positions is not None else None,
    )

    async def solve(state: TaskState, generate: Generate) -> TaskState:
        extra_args: dict[str, Any] = {STEERING_KEY: [steering]}
        if capture_layers:
            extra_args[CAPTURE_KEY] = sorted(int(layer) for layer in capture_layers)
        state = await generate(state, extra_body={"extra_args": extra_args}, **generate_args)
        message = _last_assistant(state)
        if message is not None:
            message.metadata = {
                **(message.metadata or {}),
                "lens_steering": {
                    "layers": layer_list,
                    "scale": scale,
                    "norm_match": norm_match,
                    "positions": list(positions) if positions is not None else None,
                    "vector_norm": round(float(np.linalg.norm(acts, axis=-1).mean()), 3),
                },
            }
        activations = (state.output.metadata or {}).get(ACTIVATIONS_KEY) if state.output else None
        if capture_layers and activations:  # a steered run whose capture came back empty stores nothing
            state.store.set(ACTIVATIONS_STORE_KEY, activations["residual_stream"])
            state.store.set(CAPTURE_LAYERS_STORE_KEY, sorted(int(layer) for layer in capture_layers))
        return state

    return solve
