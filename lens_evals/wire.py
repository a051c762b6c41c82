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
from typing import Any, Callable, Mapping

import numpy as np
from safetensors import SafetensorError
from safetensors.numpy import load as st_load
from safetensors.numpy import save as st_save

ENCODING = "safetensors-base64"
# Upper bound on one encoded payload (base64 characters); requests larger than
# this are refused before decoding. 2 GiB of float32 data.
MAX_ENCODED_CHARS = 3 * 2**30
FLOAT_DTYPES = frozenset({"float32", "float16", "float64"})
# Hook arguments and results may also hold integer and boolean arrays (token ids, masks).
TREE_DTYPES = FLOAT_DTYPES | {"int8", "int16", "int32", "int64", "uint8", "bool"}
_HEADER_DTYPES = {"f32": "float32", "f16": "float16", "f64": "float64", "i8": "int8", "i16": "int16",
                  "i32": "int32", "i64": "int64", "u8": "uint8", "bool": "bool"}
MAX_TREE_DEPTH = 32


class WireError(ValueError):
    """A payload could not be decoded."""


def encode_arrays(arrays: Mapping[str, np.ndarray]) -> dict[str, Any]:
    """Encode named arrays as one JSON-safe object."""
    raw = st_save({name: np.ascontiguousarray(a) for name, a in arrays.items()})
    return {"encoding": ENCODING, "data": base64.b64encode(raw).decode("ascii")}


def encode_array(array: np.ndarray) -> dict[str, Any]:
    return encode_arrays({"tensor": array})


def decode_arrays(payload: Any, allowed_dtypes: frozenset[str] = FLOAT_DTYPES) -> dict[str, np.ndarray]:
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
    _check_header(raw, allowed_dtypes)
    try:
        arrays = st_load(raw)
    except (SafetensorError, ValueError, TypeError) as exc:
        raise WireError(f"tensor data is not a valid safetensors payload: {exc}") from None
    return arrays


def decode_array(payload: Any, allowed_dtypes: frozenset[str] = FLOAT_DTYPES) -> np.ndarray:
    arrays = decode_arrays(payload, allowed_dtypes)
    if len(arrays) != 1:
        raise WireError(f"expected one tensor in payload, found {len(arrays)}")
    return next(iter(arrays.values()))


def _check_header(raw: bytes, allowed_dtypes: frozenset[str]) -> None:
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
        dtype = _HEADER_DTYPES.get(dtype, dtype)
        if dtype not in allowed_dtypes:
            raise WireError(f"tensor {name!r}: dtype {info['dtype']!r} not allowed ({', '.join(sorted(allowed_dtypes))})")
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


# --------------------------------------------------------------------------- trees
def is_encoded_array(value: Any) -> bool:
    return isinstance(value, Mapping) and set(value) == {"encoding", "data"} and value.get("encoding") == ENCODING


def encode_tree(value: Any, path: str = "value", depth: int = 0) -> Any:
    """A JSON-safe copy of ``value``: None, bools, ints, finite floats, strings, lists and
    string-keyed dicts of them, with arrays / tensors (float, int, bool) as encoded arrays."""
    if depth > MAX_TREE_DEPTH:
        raise WireError(f"{path}: nested deeper than {MAX_TREE_DEPTH} levels")
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        if not np.isfinite(value):
            raise WireError(f"{path}: non-finite float {value} (store it in an array)")
        return value
    if isinstance(value, np.generic):
        return encode_tree(value.item(), path, depth)
    if hasattr(value, "detach"):  # torch.Tensor, without importing torch
        tensor = value.detach().cpu()
        if str(tensor.dtype) == "torch.bfloat16":
            tensor = tensor.float()
        value = tensor.numpy()
    if isinstance(value, np.ndarray):
        if value.dtype.name not in TREE_DTYPES:
            raise WireError(f"{path}: array dtype {value.dtype} not allowed ({', '.join(sorted(TREE_DTYPES))})")
        return encode_array(value)
    if isinstance(value, (list, tuple)):
        return [encode_tree(item, f"{path}[{i}]", depth + 1) for i, item in enumerate(value)]
    if isinstance(value, Mapping):
        if is_encoded_array(value):
            raise WireError(f"{path}: a dict with exactly the keys 'encoding' and 'data' is reserved for arrays")
        out = {}
        for key, item in value.items():
            if not isinstance(key, str):
                raise WireError(f"{path}: dict keys must be strings, got {key!r}")
            out[key] = encode_tree(item, f"{path}.{key}", depth + 1)
        return out
    raise WireError(
        f"{path}: unsupported type {type(value).__name__} (allowed: None, bool, int, float, str, "
        "list, dict with string keys, numpy arrays, torch tensors)"
    )


def decode_tree(value: Any, convert: Callable[[np.ndarray], Any] = lambda array: array, depth: int = 0) -> Any:
    """Inverse of :func:`encode_tree`; each decoded array goes through ``convert``."""
    if depth > MAX_TREE_DEPTH:
        raise WireError(f"value nested deeper than {MAX_TREE_DEPTH} levels")
    if is_encoded_array(value):
        return convert(decode_array(value, TREE_DTYPES))
    if isinstance(value, list):
        return [decode_tree(item, convert, depth + 1) for item in value]
    if isinstance(value, Mapping):
        return {str(key): decode_tree(item, convert, depth + 1) for key, item in value.items()}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise WireError(f"unsupported value of type {type(value).__name__} in an encoded tree")


def json_object(payload: Any, what: str, fields: Any) -> dict[str, Any]:
    """The dict form of a request object given as a dict or as a JSON string of one (HTTP
    ``vllm_xargs`` carry only strings and numbers); unknown fields are refused."""
    if isinstance(payload, str):
        try:
            payload = json.loads(payload)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{what} string is not valid JSON: {exc}") from None
    if not isinstance(payload, Mapping):
        raise ValueError(f"a {what} must be an object, got {type(payload).__name__}")
    unknown = set(payload) - set(fields)
    if unknown:
        raise ValueError(f"unknown {what} fields: {sorted(unknown)}")
    return dict(payload)
