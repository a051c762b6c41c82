"""What Inspect records of a lens request: every array replaced by its digest.

Inspect logs each model call twice over: the request as it was built (``ModelEvent.call.request``)
and the generate config (``ModelEvent.config``). Steering vectors, probe weights and hook
arguments travel in ``vllm_xargs`` as JSON strings that hold base64 arrays (the default probe's
576 weights are 3.3 KB), and sit as objects in the config's ``extra_body["extra_args"]``; logged
as they are, they would be stored again in every sample. The provider puts the *logged form* of
each such item in both places (the same wire dict, each array's data replaced by its sha256 and
size): in the config as a :class:`LoggedItem` (a dict that still holds the real object), in the
request as that JSON, swapped back for the real payload just before it leaves (:func:`wire_request`).
"""

from __future__ import annotations

import copy
import hashlib
import json
from typing import Any

DIGEST_CHARS = 16
MIN_ARRAY_CHARS = 64  # shorter data strings are logged as they are


def array_digest(data: str) -> str:
    return hashlib.sha256(data.encode("ascii")).hexdigest()[:DIGEST_CHARS]


def _redacted(value: Any) -> Any:
    """Every encoded array (a dict whose ``data`` is a long string: ours, ``{"encoding":
    "safetensors-base64", "data"}``, or another wire form with dtype / shape beside it) as its digest."""
    if isinstance(value, dict):
        data = value.get("data")
        if isinstance(data, str) and len(data) > MIN_ARRAY_CHARS:
            return {**{k: v for k, v in value.items() if k != "data"}, "sha256": array_digest(data), "base64_chars": len(data)}
        return {key: _redacted(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_redacted(item) for item in value]
    return value


class LoggedItem(dict):  # type: ignore[type-arg]
    """The logged (digest) form of a request object; ``real`` is the object itself, which is what is sent."""

    real: Any


def _wire_dict(item: Any) -> Any:
    if isinstance(item, str):
        try:
            return json.loads(item)
        except json.JSONDecodeError:
            return item
    return item.to_wire() if hasattr(item, "to_wire") else item


def logged_item(item: Any) -> Any:
    """``item`` (an object, its wire dict or JSON) as a :class:`LoggedItem` when it carries arrays."""
    if isinstance(item, LoggedItem):
        return item
    wire_form = _wire_dict(item)
    redacted = _redacted(wire_form)
    if redacted == wire_form:
        return item
    logged = LoggedItem(redacted)
    logged.real = item
    return logged


def logged_extra_args(extra_args: dict[str, Any]) -> dict[str, Any]:
    """``extra_args`` with every array-carrying item as a :class:`LoggedItem`."""
    return {
        key: [logged_item(item) for item in value] if isinstance(value, list) else logged_item(value) for key, value in extra_args.items()
    }


def real_extra_args(extra_args: dict[str, Any]) -> dict[str, Any]:
    """The objects to send: :class:`LoggedItem` entries unwrapped."""

    def real(item: Any) -> Any:
        return item.real if isinstance(item, LoggedItem) else item

    return {key: [real(item) for item in value] if isinstance(value, list) else real(value) for key, value in extra_args.items()}


def logged_form(item: str) -> str:
    """A JSON-string xarg item with its arrays as digests (unchanged when it holds none)."""
    try:
        parsed = json.loads(item)
    except json.JSONDecodeError:
        return item  # not JSON: nothing to redact, and the server says what is wrong with it
    redacted = _redacted(parsed)
    return item if redacted == parsed else json.dumps(redacted)


def split_xargs(xargs: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """(xargs to log, {logged item: wire item}) for the items that carry arrays."""
    logged: dict[str, Any] = {}
    payloads: dict[str, str] = {}
    for key, value in xargs.items():
        if isinstance(value, list):
            items = []
            for item in value:
                shown = logged_form(item) if isinstance(item, str) else item
                if shown is not item:
                    payloads[shown] = item
                items.append(shown)
            logged[key] = items
        else:
            logged[key] = value
    return logged, payloads


def wire_request(request: dict[str, Any], payloads: dict[str, str]) -> dict[str, Any]:
    """A copy of ``request`` whose ``vllm_xargs`` carry the real payloads again."""
    if not payloads:
        return request
    sent = copy.copy(request)
    extra_body = dict(sent.get("extra_body") or {})
    xargs = dict(extra_body.get("vllm_xargs") or {})
    for key, value in xargs.items():
        if isinstance(value, list):
            xargs[key] = [payloads.get(item, item) if isinstance(item, str) else item for item in value]
    extra_body["vllm_xargs"] = xargs
    sent["extra_body"] = extra_body
    return sent
