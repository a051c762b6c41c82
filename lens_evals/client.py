"""HTTP client helpers for a lens-enabled OpenAI-compatible server. No vllm or torch needed."""

from __future__ import annotations

from typing import Any, Mapping, Sequence


from lens_evals import wire
from lens_evals.hooks import Hook
from lens_evals.spec import CAPTURE_KEY, HOOK_SET_KEY, HOOKS_KEY, PROBE_KEY, STEERING_KEY, LinearProbe, SteeringVector

# "residual_stream": array, "probe_scores": {name: array}, "saved": hook results (arrays decoded)
ActivationsDict = dict[str, Any]


def lens_xargs(
    capture_layers: Sequence[int] | None = None,
    steering: Sequence[SteeringVector] | None = None,
    probes: Sequence[LinearProbe] | None = None,
    hooks: Sequence[Hook] | None = None,
    hook_set: str | None = None,
) -> dict[str, Any]:
    """The ``vllm_xargs`` body field for a request (steering vectors, probes and registered
    hooks as JSON strings, since vLLM's ``vllm_xargs`` only carries strings and numbers)."""
    xargs: dict[str, Any] = {}
    if capture_layers:
        xargs[CAPTURE_KEY] = list(capture_layers)
    if steering:
        xargs[STEERING_KEY] = [vec.to_json() for vec in steering]
    if probes:
        xargs[PROBE_KEY] = [probe.to_json() for probe in probes]
    if hooks:
        xargs[HOOKS_KEY] = [hook.to_json() for hook in hooks]
    if hook_set:
        xargs[HOOK_SET_KEY] = hook_set
    return xargs


def hook_set_body(hooks: Sequence[Hook]) -> dict[str, Any]:
    """The JSON body of ``POST /lens/hook_sets`` (registered hooks only)."""
    return {"hooks": [hook.to_wire() for hook in hooks]}


def hook_results_from_response(body: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Decode the ``results`` of ``POST /lens/hook_sets/{id}/collect``."""
    return [{"request_id": r["request_id"], "saved": wire.decode_tree(r["saved"])} for r in body.get("results", [])]


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
        elif name == "saved":
            out[name] = wire.decode_tree(encoded)
        else:
            out[name] = wire.decode_array(encoded)
    return out
