"""HTTP client helpers for a lens-enabled OpenAI-compatible server. No vllm or torch needed."""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np

from lens_evals import wire
from lens_evals.spec import CAPTURE_KEY, STEERING_KEY, SteeringVector


def lens_xargs(capture_layers: Sequence[int] | None = None, steering: Sequence[SteeringVector] | None = None) -> dict[str, Any]:
    """The ``vllm_xargs`` body field for a request (steering vectors as JSON strings, since
    vLLM's ``vllm_xargs`` only carries strings and numbers)."""
    xargs: dict[str, Any] = {}
    if capture_layers:
        xargs[CAPTURE_KEY] = list(capture_layers)
    if steering:
        xargs[STEERING_KEY] = [vec.to_json() for vec in steering]
    return xargs


def activations_from_response(body: Mapping[str, Any]) -> dict[str, np.ndarray] | list[dict[str, np.ndarray]] | None:
    """Decode ``"activations"`` of a completion / chat response (a list for several prompts)."""
    raw = body.get("activations")
    if raw is None:
        return None
    if isinstance(raw, list):
        return [{name: wire.decode_array(enc) for name, enc in item.items()} for item in raw]
    return {name: wire.decode_array(enc) for name, enc in raw.items()}
