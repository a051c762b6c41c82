"""Binary responses: the ``safetensors-frame`` activations encoding.

A JSON response carries each array as base64 text: 4/3 of its bytes, encoded by the server,
then scanned by the client's JSON parser and decoded again. A request that asks for
``activations_encoding: "safetensors-frame"`` gets instead (content type :data:`CONTENT_TYPE`)::

    b"LENSFRM1" | head length (8 bytes, little-endian) | head (UTF-8 JSON) | blob

where the head is the usual JSON response with each encoded array's ``"data"`` replaced by
``{"frame": [offset, length]}``: a byte range of the blob holding what the base64 text would
have held (the safetensors file). :func:`unframe` validates the layout and every range before
anything reads them and gives back the JSON form with raw bytes as ``"data"``, which
``lens_evals.wire``'s decoders take as they take base64. Importable without torch; nothing is
unpickled or executed.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from lens_evals.wire.codec import MAX_DECODED_BYTES, Buffers, WireError, json_loads

CONTENT_TYPE = "application/vnd.lens-evals.frame"
MAGIC = b"LENSFRM1"
PREFIX_BYTES = len(MAGIC) + 8
MAX_HEAD_BYTES = 64 * 2**20  # the JSON around the arrays: token ids, text, logprobs
FRAME_KEY = "frame"
MAX_DEPTH = 64


def is_frame(content_type: str | None) -> bool:
    return content_type is not None and content_type.split(";", 1)[0].strip().lower() == CONTENT_TYPE


def frame_bytes(value: Any) -> Buffers:
    """``value`` (a JSON-able tree in which encoded arrays hold raw bytes, or :class:`Buffers` laid
    end to end, as ``"data"``) as a frame, in pieces to send one after another (the blob's pieces
    are the arrays' own buffers)."""
    blob: list[bytes | memoryview] = []
    offset = 0  # the blob's length so far

    def lift(node: Any) -> Any:
        nonlocal offset
        if isinstance(node, Mapping):
            out = {}
            for key, item in node.items():
                if key == "data" and isinstance(item, (bytes, memoryview, Buffers)):
                    pieces = item if isinstance(item, Buffers) else Buffers((item,))
                    out[key] = {FRAME_KEY: [offset, pieces.nbytes]}
                    blob.extend(pieces)
                    offset += pieces.nbytes
                else:
                    out[key] = lift(item)
            return out
        if isinstance(node, (list, tuple)):
            return [lift(item) for item in node]
        return node

    head = json.dumps(lift(value), separators=(",", ":")).encode()
    return Buffers((MAGIC + len(head).to_bytes(8, "little") + head, *blob))


def unframe(body: bytes | memoryview) -> Any:
    """The JSON form of a frame, each array's ``"data"`` a read-only view of the blob; a
    :class:`WireError` saying what is wrong with a malformed frame."""
    view = memoryview(body)
    if view.nbytes < PREFIX_BYTES or bytes(view[: len(MAGIC)]) != MAGIC:
        raise WireError("not a lens-evals frame (no LENSFRM1 prefix)")
    head_length = int.from_bytes(view[len(MAGIC) : PREFIX_BYTES], "little")
    if head_length > MAX_HEAD_BYTES or PREFIX_BYTES + head_length > view.nbytes:
        raise WireError(f"frame head of {head_length} bytes does not fit the {view.nbytes}-byte frame (at most {MAX_HEAD_BYTES})")
    try:
        head = json_loads(bytes(view[PREFIX_BYTES : PREFIX_BYTES + head_length]))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise WireError(f"frame head is not JSON: {exc}") from None
    blob = view[PREFIX_BYTES + head_length :].toreadonly()
    return _resolve(head, blob, 0)


def _resolve(node: Any, blob: memoryview, depth: int) -> Any:
    if depth > MAX_DEPTH:
        raise WireError(f"frame head nested deeper than {MAX_DEPTH} levels")
    if isinstance(node, list):
        return [_resolve(item, blob, depth + 1) for item in node]
    if not isinstance(node, dict):
        return node
    out = {}
    for key, item in node.items():
        if key == "data" and isinstance(item, dict) and FRAME_KEY in item:
            out[key] = _blob_range(item, blob)
        else:
            out[key] = _resolve(item, blob, depth + 1)
    return out


def _blob_range(reference: dict[str, Any], blob: memoryview) -> memoryview:
    where = reference.get(FRAME_KEY)
    if set(reference) != {FRAME_KEY} or not (isinstance(where, list) and len(where) == 2 and all(type(n) is int and n >= 0 for n in where)):
        raise WireError(f"a frame reference is {{'frame': [offset, length]}} with two non-negative integers, got {reference!r}")
    offset, length = where
    if length > MAX_DECODED_BYTES or offset + length > blob.nbytes:
        raise WireError(f"frame range [{offset}, {offset + length}) lies outside the {blob.nbytes}-byte blob (truncated?)")
    return blob[offset : offset + length]


def response_body(content: bytes, content_type: str | None) -> Any:
    """A lens server's response body: a frame unframed, else JSON."""
    if is_frame(content_type):
        return unframe(content)
    return json_loads(content)
