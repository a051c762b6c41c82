"""What Inspect records of a lens request: every array replaced by its digest.

Inspect logs each model call's request as it was built (``ModelEvent.call.request``). Steering
vectors, probe weights and hook arguments travel in ``vllm_xargs`` as JSON strings that hold
base64 arrays (the default probe's 576 weights are 3.3 KB), so logging them as sent would store
them again in every sample. The provider builds the request with the *logged form* of each such
item (the same JSON, each array's data replaced by its sha256 and size) and swaps the real
payloads back in just before the request leaves (:func:`wire_request`).
"""

from __future__ import annotations

import copy
import hashlib
import json
from typing import Any

from lens_evals import wire

DIGEST_CHARS = 16


def array_digest(data: str) -> str:
    return hashlib.sha256(data.encode("ascii")).hexdigest()[:DIGEST_CHARS]


def _redacted(value: Any) -> Any:
    if isinstance(value, dict):
        if value.get("encoding") == wire.ENCODING and isinstance(value.get("data"), str):
            return {"encoding": wire.ENCODING, "sha256": array_digest(value["data"]), "base64_chars": len(value["data"])}
        return {key: _redacted(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_redacted(item) for item in value]
    return value


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
