"""Inspect ``extra_args`` (Python objects) -> vLLM ``vllm_xargs`` (strings, numbers, lists of them).

A request's lens fields reach the provider as ``GenerateConfig(extra_body={"extra_args": {...}})``:
steering vectors, probes and hooks as objects, their wire dicts or JSON strings, one or a list.
Objects and dicts are encoded by :func:`lens_evals.client.lens_xargs`, the encoder every client
uses; JSON strings go as they are (the server validates them and answers 400 with the reason)."""

from __future__ import annotations

from typing import Any

from lens_evals.client import lens_xargs
from lens_evals.hooks import Hook
from lens_evals.spec import CAPTURE_KEY, HOOKS_KEY, PROBE_KEY, STEERING_KEY, LinearProbe, SteeringVector

# extra_args key -> (lens_xargs parameter, the wire model its items are)
_OBJECT_ARGS: dict[str, tuple[str, Any]] = {
    STEERING_KEY: ("steering", SteeringVector), PROBE_KEY: ("probes", LinearProbe), HOOKS_KEY: ("hooks", Hook)}


def _encoded(key: str, item: Any) -> Any:
    if isinstance(item, str):
        return item
    param, model = _OBJECT_ARGS[key]
    return lens_xargs(**{param: [model.from_wire(item)]})[key][0]


def to_vllm_xargs(extra_args: dict[str, Any]) -> dict[str, Any]:
    """``extra_args`` as ``vllm_xargs``; keys other than the lens objects and the capture pass unchanged."""
    xargs = dict(extra_args)
    for key, (_, model) in _OBJECT_ARGS.items():
        if key in xargs:
            items = xargs[key]
            if isinstance(items, (model, dict, str)):
                items = [items]
            xargs[key] = [_encoded(key, item) for item in items]
    capture = xargs.get(CAPTURE_KEY)
    if capture is True:  # every layer; a JSON bool could reach vLLM's vllm_xargs as the number 1
        xargs[CAPTURE_KEY] = lens_xargs(capture_layers=True)[CAPTURE_KEY]
    elif CAPTURE_KEY in xargs and not isinstance(capture, str):  # a JSON string ("[15]") passes as it is
        xargs[CAPTURE_KEY] = lens_xargs(capture_layers=[int(layer) for layer in capture]).get(CAPTURE_KEY, [])
    return xargs
