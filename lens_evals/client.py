"""HTTP client helpers for a lens-enabled OpenAI-compatible server. No vllm or torch needed."""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np

from lens_evals import wire
from lens_evals.spec import CAPTURE_KEY, PROBE_KEY, STEERING_KEY, LinearProbe, SteeringVector

ActivationsDict = dict[str, Any]  # "residual_stream": array, "probe_scores": {name: array}


def lens_xargs(
    capture_layers: Sequence[int] | None = None,
    steering: Sequence[SteeringVector] | None = None,
    probes: Sequence[LinearProbe] | None = None,
) -> dict[str, Any]:
    """The ``vllm_xargs`` body field for a request (steering vectors and probes as JSON strings,
    since vLLM's ``vllm_xargs`` only carries strings and numbers)."""
    xargs: dict[str, Any] = {}
    if capture_layers:
        xargs[CAPTURE_KEY] = list(capture_layers)
    if steering:
        xargs[STEERING_KEY] = [vec.to_json() for vec in steering]
    if probes:
        xargs[PROBE_KEY] = [probe.to_json() for probe in probes]
    return xargs


def activations_from_response(body: Mapping[str, Any]) -> ActivationsDict | list[ActivationsDict] | None:
    """Decode ``"activations"`` of a completion / chat response (a list for several prompts):
    ``"residual_stream"`` -> array (n_layers, n_tokens, hidden), ``"probe_scores"`` -> {name: array (n_tokens,)}."""
    raw = body.get("activations")
    if raw is None:
        return None
    if isinstance(raw, list):
        return [_decode_activations(item) for item in raw]
    return _decode_activations(raw)


def _decode_activations(item: Mapping[str, Any]) -> ActivationsDict:
    out: ActivationsDict = {}
    for name, encoded in item.items():
        if name == "probe_scores":
            out[name] = {probe: wire.decode_array(scores) for probe, scores in encoded.items()}
        else:
            out[name] = wire.decode_array(encoded)
    return out
