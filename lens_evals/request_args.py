"""Parsing a request's ``extra_args`` into a :class:`~lens_evals.spec.LensRequest`: every form
a client may send (objects, wire dicts, JSON strings of one item or of the whole list,
``output_residual_stream=True``), and the refusal of misspelled keys. Raises ValueError with the
reason; nothing is executed or unpickled."""

from __future__ import annotations

import difflib
import functools
import json
from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import ValidationError

from lens_evals import wire
from lens_evals.hooks import Hook
from lens_evals.spec import (
    CAPTURE_KEY,
    ENCODING_KEY,
    HOOK_SET_KEY,
    HOOKS_KEY,
    INTERNAL_KEY,
    LENS_KEYS,
    MAX_LAYERS_PER_REQUEST,
    PROBE_KEY,
    STEERING_KEY,
    LensRequest,
    LinearProbe,
    SteeringVector,
)


def parse_lens_args(extra_args: Mapping[str, Any] | None) -> LensRequest:
    """Validate the lens keys of ``extra_args``; raise ValueError with the reason."""
    if not extra_args:
        return LensRequest()
    capture = extra_args.get(CAPTURE_KEY)
    layers: list[int] = []
    capture_all = False
    if capture is not None:
        capture_all, layers = _parse_capture(capture)
    encoding = extra_args.get(ENCODING_KEY, wire.DEFAULT_RESPONSE_ENCODING)
    steering = _parse_items(extra_args.get(STEERING_KEY), SteeringVector, STEERING_KEY, "steering vectors")
    probes = _parse_probes(extra_args.get(PROBE_KEY))
    hooks = _parse_items(extra_args.get(HOOKS_KEY), Hook, HOOKS_KEY, "hooks")
    hook_set = extra_args.get(HOOK_SET_KEY)
    if hook_set is not None and not isinstance(hook_set, str):
        raise ValueError(f"{HOOK_SET_KEY} must be the id (a string) of a registered hook set")
    try:
        return LensRequest(
            capture_layers=layers,
            capture_all=capture_all,
            steering=steering,
            probes=probes,
            hooks=hooks,
            hook_set=hook_set,
            encoding=encoding,
        )
    except ValidationError as exc:
        raise ValueError("; ".join(str(err["msg"]).removeprefix("Value error, ") for err in exc.errors())) from None


def refuse_misspelled_keys(extra_args: Mapping[str, Any]) -> None:
    """A key close to one of ours but not it (``output_residual_streams``) would silently ask for
    nothing; refuse it. Other keys belong to other plugins and pass."""
    for key in extra_args:
        if key in LENS_KEYS or key == INTERNAL_KEY or not isinstance(key, str):
            continue
        close = difflib.get_close_matches(key, LENS_KEYS, n=1, cutoff=0.8)
        if close:
            raise ValueError(f"unknown extra_args key {key!r}; did you mean {close[0]!r}?")


def _parse_items(raw: Any, model: Any, key: str, what: str) -> list[Any]:
    """A list of ``model`` objects from their objects, wire dicts or JSON strings (or one of them),
    or ONE JSON string of the whole list (vllm-lens's ``vllm_xargs`` form)."""
    if raw is None:
        return []
    if isinstance(raw, str) and raw.lstrip().startswith("["):
        try:
            raw = wire.json_loads(raw)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{key} string is not valid JSON: {exc}") from None
    if isinstance(raw, (model, Mapping, str)):
        raw = [raw]
    if not isinstance(raw, Sequence) or isinstance(raw, (str, bytes)):
        raise ValueError(f"{key} must be a list of {what}")
    items = []
    for n, item in enumerate(raw):
        try:
            items.append(model.from_wire(item))
        except ValueError as exc:
            raise ValueError(f"{key}[{n}]: {exc}") from None
    return items


def _parse_probes(raw: Any) -> list[LinearProbe]:
    """Probes; those sent as JSON strings (over HTTP every request sends the same strings again)
    parsed once per distinct string (bounded, see ``_probe_json``)."""
    if isinstance(raw, str):
        texts = [(raw, raw.lstrip().startswith("["))]
    elif isinstance(raw, list) and raw and all(isinstance(item, str) and not item.lstrip().startswith("[") for item in raw):
        texts = [(item, False) for item in raw]
    else:
        return _parse_items(raw, LinearProbe, PROBE_KEY, "probes")
    try:
        return [probe for text, whole_list in texts for probe in _probe_json(text, whole_list)]
    except ValueError:
        return _parse_items(raw, LinearProbe, PROBE_KEY, "probes")  # raises again, naming the bad item


@functools.lru_cache(maxsize=128)
def _probe_json(text: str, whole_list: bool) -> tuple[LinearProbe, ...]:
    """One probe's JSON string, or (``whole_list``) the JSON string of the whole list. Errors are
    not cached. The probes are shared by the requests that send the string: they are only read."""
    if whole_list:
        return tuple(_parse_items(text, LinearProbe, PROBE_KEY, "probes"))
    return (LinearProbe.from_wire(text),)


def _parse_capture(value: Any) -> tuple[bool, list[int]]:
    """(every layer?, the layers) from a list, an int, True, or a JSON string of one of them."""
    if isinstance(value, str):
        try:
            value = wire.json_loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f'{CAPTURE_KEY} string is not valid JSON (expected e.g. "[15]" or "true"): {exc}') from None
    if value is True:
        return True, []
    if value is False:
        raise ValueError(f"{CAPTURE_KEY}=False asks for nothing: pass True (every layer), a list of layers, or leave the key out")
    return False, _parse_layer_list(value)


def _parse_layer_list(value: Any) -> list[int]:
    if isinstance(value, bool) or not isinstance(value, (list, tuple, int)):
        raise ValueError(f"{CAPTURE_KEY} must be a list of layer indices, got {type(value).__name__}")
    items = [value] if isinstance(value, int) else list(value)
    if not items:
        raise ValueError(f"{CAPTURE_KEY} must name at least one layer")
    if len(items) > MAX_LAYERS_PER_REQUEST:
        raise ValueError(f"{CAPTURE_KEY} names too many layers ({len(items)})")
    for item in items:
        if isinstance(item, bool) or not isinstance(item, int):
            raise ValueError(f"{CAPTURE_KEY} entries must be integers, got {item!r}")
        if item < 0:
            raise ValueError(f"{CAPTURE_KEY}: layer {item} is negative")
    if len(set(items)) != len(items):
        raise ValueError(f"{CAPTURE_KEY} has duplicate layers: {items}")
    return sorted(items)
