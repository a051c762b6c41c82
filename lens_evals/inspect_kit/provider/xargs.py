"""Inspect ``extra_args`` (Python objects) -> vLLM ``vllm_xargs`` (strings, numbers, lists of them).

A request's lens fields reach the provider as ``GenerateConfig(extra_body={"extra_args": {...}})``:
steering vectors, probes, hooks and readouts (``output_readouts``) as objects, their wire dicts or JSON strings, one or a list.
Objects and dicts are encoded by :func:`lens_evals.client.lens_xargs`, the encoder every client
uses; JSON strings go as they are (the server validates them and answers 400 with the reason)."""

from __future__ import annotations

from typing import Any

from lens_evals.client import lens_xargs
from lens_evals.request.hooks import Hook
from lens_evals.request.readouts import LensReadout, SaeReadout
from lens_evals.request.spec import CAPTURE_KEY, HOOKS_KEY, PROBE_KEY, READOUTS_KEY, STEERING_KEY, LinearProbe, SteeringVector

# extra_args key -> the wire model its items are
_OBJECT_ARGS: dict[str, Any] = {STEERING_KEY: SteeringVector, PROBE_KEY: LinearProbe, HOOKS_KEY: Hook}


def _encoded(key: str, item: Any) -> Any:
    if isinstance(item, str):
        return item
    obj = _OBJECT_ARGS[key].from_wire(item)
    encoded = (
        lens_xargs(steering=[obj]) if key == STEERING_KEY else (lens_xargs(probes=[obj]) if key == PROBE_KEY else lens_xargs(hooks=[obj]))
    )
    return encoded[key][0]


def to_vllm_xargs(extra_args: dict[str, Any]) -> dict[str, Any]:
    """``extra_args`` as ``vllm_xargs``; keys other than the lens objects and the capture pass unchanged."""
    xargs = dict(extra_args)
    for key, model in _OBJECT_ARGS.items():
        if key in xargs:
            items = xargs[key]
            if isinstance(items, (model, dict, str)):
                items = [items]
            xargs[key] = [_encoded(key, item) for item in items]
    readouts = xargs.get(READOUTS_KEY)
    if readouts is not None and not isinstance(readouts, str):  # a JSON string of the list passes as it is
        items = [readouts] if isinstance(readouts, (LensReadout, SaeReadout, dict)) else readouts
        xargs[READOUTS_KEY] = [item if isinstance(item, str) else lens_xargs(readouts=[item])[READOUTS_KEY][0] for item in items]
    capture = xargs.get(CAPTURE_KEY)
    if capture is True:  # every layer; a JSON bool could reach vLLM's vllm_xargs as the number 1
        xargs[CAPTURE_KEY] = lens_xargs(capture_layers=True)[CAPTURE_KEY]
    elif CAPTURE_KEY in xargs and not isinstance(capture, str):  # a JSON string ("[15]") passes as it is
        xargs[CAPTURE_KEY] = lens_xargs(capture_layers=[int(layer) for layer in xargs[CAPTURE_KEY]]).get(CAPTURE_KEY, [])
    return xargs
