"""Parsing a request's ``extra_args`` into a :class:`~lens_evals.request.spec.LensRequest`: every form
a client may send (objects, wire dicts, JSON strings of one item or of the whole list,
``output_residual_stream=True``), and the refusal of misspelled keys. Raises ValueError with the
reason; nothing is executed or unpickled.

Given :class:`LensLimits` (the frontend builds them from the model and the request), every
encoded array is checked against the largest the model can use BEFORE it is base64-decoded or
inflated, and the request's arrays in all against ``LENS_EVALS_MAX_REQUEST_ARRAYS_GIB``."""

from __future__ import annotations

import difflib
import json
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from lens_evals import settings
from lens_evals.request.hooks import Hook
from lens_evals.request.readouts import LensReadout, SaeReadout, parse_readout, readout_bounds
from lens_evals.request.spec import (
    CAPTURE_KEY,
    ENCODING_KEY,
    HOOK_SET_KEY,
    HOOKS_KEY,
    INTERNAL_KEY,
    LENS_KEYS,
    MAX_LAYERS_PER_REQUEST,
    PROBE_KEY,
    READOUTS_KEY,
    STEERING_KEY,
    LensRequest,
    LinearProbe,
    SteeringVector,
)
from lens_evals.wire import formats as wire


@dataclass(frozen=True)
class LensLimits:
    """What the model can use of a request's arrays: the model's layers and hidden size and the
    request's positions (prompt + max_tokens - 1), and what its arrays may decode to in all."""

    num_layers: int
    hidden_size: int
    max_positions: int
    total_bytes: int

    @classmethod
    def for_model(cls, num_layers: int, hidden_size: int, max_positions: int) -> LensLimits:
        return cls(num_layers, hidden_size, max(max_positions, 1), settings.MAX_REQUEST_ARRAYS_GIB.in_bytes())

    def bounds(self) -> tuple[wire.Bound, wire.Bound, wire.Bound]:
        """(steering vector, probe weights, hook arg) bounds, sharing one budget for the request."""
        budget = wire.Budget(self.total_bytes)
        layers, positions, hidden = self.num_layers, self.max_positions, self.hidden_size
        return (
            wire.Bound(layers * positions * hidden, f"a steering vector ({layers} layers x {positions} positions x {hidden})", budget),
            wire.Bound(hidden, f"a probe's weights (hidden size {hidden})", budget),
            # per-layer and per-position vectors (add / patch values) or a (hidden, hidden) matrix
            wire.Bound(max(layers * positions, hidden) * hidden, "a hook argument", budget),
        )


_NO_LIMITS = (wire.UNBOUNDED, wire.UNBOUNDED, wire.UNBOUNDED)


def parse_lens_args(extra_args: Mapping[str, Any] | None, limits: LensLimits | None = None) -> LensRequest:
    """Validate the lens keys of ``extra_args``; raise ValueError with the reason. With
    ``limits``, an encoded array larger than the model can use is refused before it is decoded."""
    if not extra_args:
        return LensRequest()
    steer_bound, probe_bound, hook_bound = _NO_LIMITS if limits is None else limits.bounds()
    capture = extra_args.get(CAPTURE_KEY)
    layers: list[int] = []
    capture_all = False
    if capture is not None:
        capture_all, layers = _parse_capture(capture)
    encoding = extra_args.get(ENCODING_KEY, wire.DEFAULT_RESPONSE_ENCODING)
    steering = _parse_items(extra_args.get(STEERING_KEY), SteeringVector, STEERING_KEY, "steering vectors", steer_bound)
    probes = _parse_probes(extra_args.get(PROBE_KEY), probe_bound)
    hooks = _parse_items(extra_args.get(HOOKS_KEY), Hook, HOOKS_KEY, "hooks", hook_bound)
    readouts = _parse_readouts(extra_args.get(READOUTS_KEY), limits)
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
            readouts=readouts,
        )
    except ValidationError as exc:
        raise ValueError("; ".join(str(err["msg"]).removeprefix("Value error, ") for err in exc.errors())) from None


class _AnyReadout:
    """``_parse_items``'s model for readouts: the kind picks the class (``parse_readout``)."""

    from_wire = staticmethod(parse_readout)


def _parse_readouts(raw: Any, limits: LensLimits | None) -> list[Any]:
    """Readouts (``request/readouts.py``) from their objects, wire dicts, JSON strings, or ONE
    JSON string of the list; arrays bounded by the model when ``limits`` are given."""
    bounds: Any = (wire.UNBOUNDED, wire.UNBOUNDED)
    if limits is not None:
        bounds = readout_bounds(limits.num_layers, limits.hidden_size, wire.Budget(limits.total_bytes))
    return _parse_items([raw] if isinstance(raw, (LensReadout, SaeReadout)) else raw, _AnyReadout, READOUTS_KEY, "readouts", bounds)


def refuse_misspelled_keys(extra_args: Mapping[str, Any]) -> None:
    """A key close to one of ours but not it (``output_residual_streams``) would silently ask for
    nothing; refuse it. Other keys belong to other plugins and pass."""
    for key in extra_args:
        if key in LENS_KEYS or key == INTERNAL_KEY or not isinstance(key, str):
            continue
        close = difflib.get_close_matches(key, LENS_KEYS, n=1, cutoff=0.8)
        if close:
            raise ValueError(f"unknown extra_args key {key!r}; did you mean {close[0]!r}?")


def _parse_items(raw: Any, model: Any, key: str, what: str, bound: wire.Bound = wire.UNBOUNDED) -> list[Any]:
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
            items.append(model.from_wire(item, bound))
        except ValueError as exc:
            raise ValueError(f"{key}[{n}]: {exc}") from None
    return items


# Probes sent as JSON strings (over HTTP every request sends the same strings again), parsed once
# per distinct string: (string, whole list?) -> its probes. Filled by ``remember_probes`` once a
# request is accepted, so a refused request leaves nothing here.
_probe_texts: OrderedDict[tuple[str, bool], tuple[LinearProbe, ...]] = OrderedDict()
_probe_texts_lock = threading.Lock()
CACHED_PROBE_TEXTS = 128


def _probe_strings(raw: Any) -> list[tuple[str, bool]] | None:
    """The probe key's JSON strings (each with: is it the whole list?), None if it holds others."""
    if isinstance(raw, str):
        return [(raw, raw.lstrip().startswith("["))]
    if isinstance(raw, list) and raw and all(isinstance(item, str) and not item.lstrip().startswith("[") for item in raw):
        return [(item, False) for item in raw]
    return None


def _parse_probes(raw: Any, bound: wire.Bound) -> list[LinearProbe]:
    """Probes; a JSON string an accepted request sent before is not parsed again."""
    texts = _probe_strings(raw)
    if texts is None:
        return _parse_items(raw, LinearProbe, PROBE_KEY, "probes", bound)
    probes: list[LinearProbe] = []
    for n, (text, whole_list) in enumerate(texts):
        with _probe_texts_lock:
            cached = _probe_texts.get((text, whole_list))
            if cached is not None:
                _probe_texts.move_to_end((text, whole_list))
        if cached is not None:
            probes += cached
        elif whole_list:
            probes += _parse_items(text, LinearProbe, PROBE_KEY, "probes", bound)
        else:
            try:
                probes.append(LinearProbe.from_wire(text, bound))
            except ValueError as exc:
                raise ValueError(f"{PROBE_KEY}[{n}]: {exc}") from None
    return probes


def remember_probes(extra_args: Mapping[str, Any], probes: Sequence[LinearProbe]) -> None:
    """Keep an accepted request's probe strings, parsed (the probes are only read: the requests
    that send the same string share them)."""
    texts = _probe_strings(extra_args.get(PROBE_KEY))
    if texts is None:
        return
    if len(texts) == 1 and texts[0][1]:
        parsed = {texts[0]: tuple(probes)}
    elif len(texts) == len(probes):
        parsed = {text: (probe,) for text, probe in zip(texts, probes, strict=True)}
    else:
        return
    with _probe_texts_lock:
        for key, value in parsed.items():
            _probe_texts[key] = value
            _probe_texts.move_to_end(key)
        while len(_probe_texts) > CACHED_PROBE_TEXTS:
            _probe_texts.popitem(last=False)


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
