"""JSON-safe encoding of arrays: safetensors bytes, base64 in JSON. Never pickle.

The same format is used in ``vllm_xargs`` of HTTP requests, inside the engine's
request metadata and in HTTP responses. Decoding validates everything it reads:
a malformed payload raises :class:`WireError` (a ``ValueError``) with a message
that says what is wrong.
"""

from __future__ import annotations

import base64
import binascii
import json
from typing import Any, Mapping

import numpy as np
from safetensors import SafetensorError
from safetensors.numpy import load as st_load
from safetensors.numpy import save as st_save

ENCODING = "safetensors-base64"
# Upper bound on one encoded payload (base64 characters); requests larger than
# this are refused before decoding. 2 GiB of float32 data.
MAX_ENCODED_CHARS = 3 * 2**30
_ALLOWED_DTYPES = {"float32", "float16", "float64"}


class WireError(ValueError):
    """A payload could not be decoded."""


def encode_arrays(arrays: Mapping[str, np.ndarray]) -> dict[str, Any]:
    """Encode named arrays as one JSON-safe object."""
    raw = st_save({name: np.ascontiguousarray(a) for name, a in arrays.items()})
    return {"encoding": ENCODING, "data": base64.b64encode(raw).decode("ascii")}


def encode_array(array: np.ndarray) -> dict[str, Any]:
    return encode_arrays({"tensor": array})


def decode_arrays(payload: Any) -> dict[str, np.ndarray]:
    """Decode an object made by :func:`encode_arrays`; raise WireError if malformed."""
    if not isinstance(payload, Mapping):
        raise WireError(f"expected an encoded tensor object, got {type(payload).__name__}")
    if payload.get("encoding") != ENCODING:
        raise WireError(f"unknown tensor encoding {payload.get('encoding')!r}; expected {ENCODING!r}")
    data = payload.get("data")
    if isinstance(data, (bytes, bytearray)):
        raw = bytes(data)
    elif isinstance(data, str):
        if len(data) > MAX_ENCODED_CHARS:
            raise WireError(f"encoded tensor too large ({len(data)} characters)")
        try:
            raw = base64.b64decode(data, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise WireError(f"tensor data is not valid base64: {exc}") from None
    else:
        raise WireError("tensor object has no 'data' string")
    _check_header(raw)
    try:
        arrays = st_load(raw)
    except (SafetensorError, ValueError, TypeError) as exc:
        raise WireError(f"tensor data is not a valid safetensors payload: {exc}") from None
    return arrays


def decode_array(payload: Any) -> np.ndarray:
    arrays = decode_arrays(payload)
    if len(arrays) != 1:
        raise WireError(f"expected one tensor in payload, found {len(arrays)}")
    return next(iter(arrays.values()))


def _check_header(raw: bytes) -> None:
    """Validate the safetensors header ourselves so errors are precise and cheap."""
    if len(raw) < 8:
        raise WireError("tensor payload truncated (no header)")
    header_len = int.from_bytes(raw[:8], "little")
    if header_len <= 0 or 8 + header_len > len(raw):
        raise WireError("tensor payload truncated (header length beyond data)")
    try:
        header = json.loads(raw[8 : 8 + header_len])
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise WireError(f"tensor header is not JSON: {exc}") from None
    if not isinstance(header, dict):
        raise WireError("tensor header is not an object")
    body = len(raw) - 8 - header_len
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= info.keys():
            raise WireError(f"tensor {name!r}: malformed header entry")
        dtype = str(info["dtype"]).lower()
        dtype = {"f32": "float32", "f16": "float16", "f64": "float64"}.get(dtype, dtype)
        if dtype not in _ALLOWED_DTYPES:
            raise WireError(f"tensor {name!r}: dtype {info['dtype']!r} not allowed (floating point only)")
        offsets, shape = info["data_offsets"], info["shape"]
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_int(x) for x in offsets)):
            raise WireError(f"tensor {name!r}: data_offsets must be two integers")
        if not (isinstance(shape, list) and all(_is_int(x) and x >= 0 for x in shape)):
            raise WireError(f"tensor {name!r}: shape must be a list of non-negative integers")
        start, end = offsets
        if not (0 <= start <= end <= body):
            raise WireError(f"tensor {name!r}: data offsets outside payload (truncated?)")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
