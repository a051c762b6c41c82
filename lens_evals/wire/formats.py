"""JSON-safe encoding of arrays, base64 in JSON. Never pickle. Two forms, both decoded everywhere:

* ``safetensors`` (ours): ``{"encoding": "safetensors-base64", "data": B64}`` where the bytes are a
  safetensors file (several named tensors); with ``"compression": "zstd"`` the file is
  zstd-compressed and ``"nbytes"`` declares its inflated size.
* ``vllm-lens`` (the public vllm-lens package's form): ``{"data": B64, "dtype": NUMPY_STORAGE_DTYPE,
  "original_dtype": "torch.bfloat16", "shape": [...], "compression": "zstd"}``, one tensor.

Both carry the tensor's native dtype (bfloat16 stays bfloat16). Decoding validates everything it
reads and raises :class:`WireError` (a ``ValueError``) saying what is wrong; a compressed payload
is checked against its declared size (at most ``MAX_DECODED_BYTES``) BEFORE it is inflated and
is never inflated past it (a zip bomb is refused, a truncated frame is an error). A request's
arrays are decoded under a :class:`~lens_evals.wire.codec.Bound` (the most the model can use, and
a budget for the request): every declared size (shape, ``nbytes``, base64 length) is checked
against it before anything is decoded.

Arrays decode to numpy (bfloat16 widened to float32, exactly) or, with :func:`decode_tensor`, to
a torch tensor in the native dtype. Importable without torch.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from lens_evals.wire import codec
from lens_evals.wire.codec import MAX_DECODED_BYTES, UNBOUNDED, Bound, Budget, Raw, WireError, json_loads

__all__ = ["MAX_DECODED_BYTES", "UNBOUNDED", "Bound", "Budget", "WireError", "json_loads"]
ENCODING = "safetensors-base64"
# What a request may ask its activations to come back as (``activations_encoding``): in a JSON
# body (base64 text), or (``safetensors-frame``, completions only) the same JSON with the arrays'
# bytes after it, unencoded (``lens_evals.wire.frame``).
SAFETENSORS, SAFETENSORS_ZSTD, VLLM_LENS = "safetensors", "safetensors-zstd", "vllm-lens"
SAFETENSORS_FRAME = "safetensors-frame"
JSON_ENCODINGS = (SAFETENSORS, SAFETENSORS_ZSTD, VLLM_LENS)
RESPONSE_ENCODINGS = (*JSON_ENCODINGS, SAFETENSORS_FRAME)
# A request that names no encoding gets vllm-lens's form: an unmodified vllm-lens client (which never
# sends ``activations_encoding``) reads it, our decoders read it, and it measured the same bytes and
# time as safetensors-zstd (docs/vllm_lens.md). Our clients name theirs (LensClient: the frame).
DEFAULT_RESPONSE_ENCODING = VLLM_LENS
MAX_ENCODED_CHARS = 3 * 2**30
FLOAT_DTYPES = frozenset({"float32", "float16", "float64", "bfloat16"})
# Hook arguments and results may also hold integer and boolean arrays (token ids, masks).
TREE_DTYPES = FLOAT_DTYPES | {"int8", "int16", "int32", "int64", "uint8", "bool"}
MAX_TREE_DEPTH = 32
_OURS_KEYS = {"encoding", "data", "compression", "nbytes"}
_THEIRS_KEYS = {"data", "dtype", "original_dtype", "shape", "compression"}


# --------------------------------------------------------------------------- encoding
def encode_arrays(arrays: Mapping[str, Any], compress: bool = False, binary: bool = False) -> dict[str, Any]:
    """Named arrays / tensors (native dtype) as one safetensors payload (``binary``: its bytes
    as they are, for a frame)."""
    if binary:  # the file's pieces: its header and the tensors' own bytes (no copy where none is needed)
        return {
            "encoding": ENCODING,
            "data": codec.safetensors_pieces({name: codec.raw_of(value, copy=False) for name, value in arrays.items()}),
        }
    raw = codec.safetensors_bytes({name: codec.raw_of(value) for name, value in arrays.items()})
    if not compress:
        return {"encoding": ENCODING, "data": codec.b64encode(raw)}
    packed = codec.compress(raw)
    return {"encoding": ENCODING, "data": codec.b64encode(packed), "compression": "zstd", "nbytes": len(raw)}


def encode_vllm_lens(value: Any, compress: bool = True) -> dict[str, Any]:
    """One array / tensor in vllm-lens's form (what its ``serialize_tensor`` makes)."""
    raw = codec.raw_of(value)
    storage = "int16" if raw.dtype == "bfloat16" else raw.dtype
    data = bytes(raw.data)
    out = {"dtype": storage, "original_dtype": f"torch.{raw.dtype}", "shape": list(raw.shape)}
    if compress:
        return {"data": codec.b64encode(codec.compress(data)), **out, "compression": "zstd"}
    return {"data": codec.b64encode(data), **out}


def encode_array(value: Any, encoding: str = SAFETENSORS) -> dict[str, Any]:
    """One array / tensor in a response encoding (see ``RESPONSE_ENCODINGS``)."""
    if encoding == VLLM_LENS:
        return encode_vllm_lens(value)
    if encoding not in (SAFETENSORS, SAFETENSORS_ZSTD, SAFETENSORS_FRAME):
        raise WireError(f"unknown encoding {encoding!r}; one of {', '.join(RESPONSE_ENCODINGS)}")
    return encode_arrays({"tensor": value}, compress=encoding == SAFETENSORS_ZSTD, binary=encoding == SAFETENSORS_FRAME)


# --------------------------------------------------------------------------- decoding
def _b64(data: Any, limit: int = MAX_ENCODED_CHARS) -> bytes | memoryview:
    """base64 text decoded; bytes (a frame's, ``lens_evals.wire.frame``) as they are."""
    if isinstance(data, (bytes, memoryview)):
        return data
    if isinstance(data, bytearray):
        return bytes(data)
    if not isinstance(data, str):
        raise WireError("tensor object has no 'data' string")
    if len(data) > limit:
        raise WireError(f"encoded tensor too large ({len(data)} characters, at most {limit})")
    return codec.b64decode(data)


def _compression(payload: Mapping[str, Any]) -> str | None:
    compression = payload.get("compression")
    if compression not in (None, "zstd"):
        raise WireError(f"unknown compression {compression!r}; only 'zstd' (or none)")
    return compression


def is_vllm_lens_form(payload: Any) -> bool:
    return isinstance(payload, Mapping) and "encoding" not in payload and {"data", "dtype", "shape"} <= set(payload)


def _decode_ours(payload: Mapping[str, Any], allowed: frozenset[str], bound: Bound) -> dict[str, Raw]:
    if payload.get("encoding") != ENCODING:
        raise WireError(f"unknown tensor encoding {payload.get('encoding')!r}; expected {ENCODING!r}")
    extra = set(payload) - _OURS_KEYS
    if extra:
        raise WireError(f"unknown tensor object fields {sorted(extra)}")
    data = payload.get("data")
    if _compression(payload) is None:
        if isinstance(data, (str, bytes, bytearray, memoryview)):  # its length says what it holds
            bound.reserve(len(data) // 4 * 3 if isinstance(data, str) else memoryview(data).nbytes, "data of")
        return codec.parse_safetensors(_b64(data, codec.b64_chars(bound.max_bytes)), allowed, bound)
    declared = payload.get("nbytes")
    if not codec.is_int(declared) or declared < 8:
        raise WireError("a zstd-compressed tensor object needs 'nbytes': the inflated size in bytes")
    nbytes = int(declared)
    codec.check_size(nbytes)
    bound.reserve(nbytes, "declares")
    packed = _b64(data, codec.b64_chars(codec.compress_bound(nbytes)))
    return codec.parse_safetensors(codec.inflate(packed, nbytes), allowed, bound)


def _decode_theirs(payload: Mapping[str, Any], allowed: frozenset[str], bound: Bound) -> Raw:
    extra = set(payload) - _THEIRS_KEYS - {"__type__"}
    if extra:
        raise WireError(f"unknown tensor object fields {sorted(extra)}")
    dtype = codec.vllm_lens_dtype(payload.get("dtype"), payload.get("original_dtype"), allowed)
    shape = codec.checked_shape(payload.get("shape"))
    bound.check_elements(shape)
    nbytes = codec.nbytes_of(dtype, shape)  # checked against MAX_DECODED_BYTES before any decoding
    bound.reserve(nbytes, "needs")
    if _compression(payload) is None:
        data = _b64(payload.get("data"), codec.b64_chars(nbytes))
    else:
        data = codec.inflate(_b64(payload.get("data"), codec.b64_chars(codec.compress_bound(nbytes))), nbytes)
    if len(data) != nbytes:
        raise WireError(f"tensor data has {len(data)} bytes, its dtype {dtype} and shape {list(shape)} need {nbytes} (truncated?)")
    return Raw(data, dtype, shape)


def decode_raws(payload: Any, allowed_dtypes: frozenset[str] = FLOAT_DTYPES, bound: Bound = UNBOUNDED) -> dict[str, Raw]:
    """Either form -> named raw tensors (bytes, dtype name, shape); WireError if malformed or
    (declared) larger than ``bound``."""
    if not isinstance(payload, Mapping):
        raise WireError(f"expected an encoded tensor object, got {type(payload).__name__}")
    if is_vllm_lens_form(payload):
        return {"tensor": _decode_theirs(payload, allowed_dtypes, bound)}
    return _decode_ours(payload, allowed_dtypes, bound)


def _one(payload: Any, allowed_dtypes: frozenset[str], bound: Bound = UNBOUNDED) -> Raw:
    raws = decode_raws(payload, allowed_dtypes, bound)
    if len(raws) != 1:
        raise WireError(f"expected one tensor in payload, found {len(raws)}")
    return next(iter(raws.values()))


def array_bytes(value: Any, depth: int = 0) -> int:
    """Bytes of the arrays (torch tensors, numpy arrays) in a tree of dicts and lists, as hook
    results and a response's activations hold them; nothing below :data:`MAX_TREE_DEPTH`, which
    the wire refuses anyway. Torch is not imported: a tensor is what has ``numel`` and
    ``element_size``."""
    if hasattr(value, "numel") and hasattr(value, "element_size"):
        return int(value.numel() * value.element_size())
    if isinstance(value, np.ndarray):
        return int(value.nbytes)
    if depth > MAX_TREE_DEPTH:
        return 0
    if isinstance(value, dict):
        return sum(array_bytes(item, depth + 1) for item in value.values())
    if isinstance(value, (list, tuple)):
        return sum(array_bytes(item, depth + 1) for item in value)
    return 0


def decode_array(payload: Any, allowed_dtypes: frozenset[str] = FLOAT_DTYPES, bound: Bound = UNBOUNDED) -> np.ndarray:
    """One array (numpy; bfloat16 widened to float32), refused unread if larger than ``bound``."""
    return _one(payload, allowed_dtypes, bound).to_numpy()


def decode_tensor(payload: Any, allowed_dtypes: frozenset[str] = TREE_DTYPES) -> Any:
    """One tensor as torch in its native dtype (needs torch)."""
    return _one(payload, allowed_dtypes).to_torch()


def decode_native(payload: Any, allowed_dtypes: frozenset[str] = TREE_DTYPES) -> Any:
    """A torch tensor (native dtype) where torch is installed, else a numpy array."""
    raw = _one(payload, allowed_dtypes)
    return raw.to_torch() if codec.has_torch() else raw.to_numpy()


# --------------------------------------------------------------------------- trees
def is_encoded_array(value: Any) -> bool:
    if not isinstance(value, Mapping):
        return False
    if value.get("__type__") == "tensor":
        return True
    return value.get("encoding") == ENCODING and {"encoding", "data"} <= set(value) <= _OURS_KEYS


def encode_tree(value: Any, path: str = "value", depth: int = 0, encoding: str = SAFETENSORS) -> Any:
    """A JSON-safe copy of ``value``: None, bools, ints, finite floats, strings, lists and
    string-keyed dicts of them, with arrays / tensors (float, int, bool; native dtype) encoded
    (``encoding`` vllm-lens: as ``{"__type__": "tensor", ...}``, its hook-result form)."""
    if depth > MAX_TREE_DEPTH:
        raise WireError(f"{path}: nested deeper than {MAX_TREE_DEPTH} levels")
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        if not np.isfinite(value):
            raise WireError(f"{path}: non-finite float {value} (store it in an array)")
        return value
    if isinstance(value, np.generic):
        return encode_tree(value.item(), path, depth, encoding)
    if isinstance(value, np.ndarray) or hasattr(value, "detach"):  # torch.Tensor, without importing torch
        dtype = codec.raw_dtype_name(value)
        if dtype not in TREE_DTYPES:
            raise WireError(f"{path}: array dtype {value.dtype} not allowed ({', '.join(sorted(TREE_DTYPES))})")
        if encoding == VLLM_LENS:
            return {"__type__": "tensor", **encode_vllm_lens(value)}
        return encode_array(value, encoding)
    if isinstance(value, (list, tuple)):
        return [encode_tree(item, f"{path}[{i}]", depth + 1, encoding) for i, item in enumerate(value)]
    if isinstance(value, Mapping):
        if is_encoded_array(value):
            raise WireError(f"{path}: a dict with exactly the keys 'encoding' and 'data' is reserved for arrays")
        out = {}
        for key, item in value.items():
            if not isinstance(key, str):
                raise WireError(f"{path}: dict keys must be strings, got {key!r}")
            out[key] = encode_tree(item, f"{path}.{key}", depth + 1, encoding)
        return out
    raise WireError(
        f"{path}: unsupported type {type(value).__name__} (allowed: None, bool, int, float, str, "
        "list, dict with string keys, numpy arrays, torch tensors)"
    )


def decode_tree(value: Any, convert: Callable[[np.ndarray], Any] = lambda array: array, depth: int = 0, bound: Bound = UNBOUNDED) -> Any:
    """Inverse of :func:`encode_tree`; each decoded array (numpy, each within ``bound``) goes
    through ``convert``."""
    return _walk(value, lambda payload: convert(decode_array(payload, TREE_DTYPES, bound)), depth)


def decode_tree_native(value: Any) -> Any:
    """Inverse of :func:`encode_tree` with arrays as torch tensors in their native dtype (numpy
    arrays where torch is not installed)."""
    return _walk(value, decode_native, 0)


def _walk(value: Any, leaf: Callable[[Any], Any], depth: int) -> Any:
    if depth > MAX_TREE_DEPTH:
        raise WireError(f"value nested deeper than {MAX_TREE_DEPTH} levels")
    if isinstance(value, Mapping) and value.get("__type__") == "cloudpickle":
        raise WireError("a cloudpickled value: refused, never unpickled (send tensors, numbers, strings, lists, dicts)")
    if is_encoded_array(value):
        return leaf({k: v for k, v in value.items() if k != "__type__"})
    if isinstance(value, list):
        return [_walk(item, leaf, depth + 1) for item in value]
    if isinstance(value, Mapping):
        return {str(key): _walk(item, leaf, depth + 1) for key, item in value.items()}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise WireError(f"unsupported value of type {type(value).__name__} in an encoded tree")


def json_object(payload: Any, what: str, fields: Any) -> dict[str, Any]:
    """The dict form of a request object given as a dict or as a JSON string of one (HTTP
    ``vllm_xargs`` carry only strings and numbers); unknown fields are refused."""
    if isinstance(payload, str):
        try:
            payload = json_loads(payload)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{what} string is not valid JSON: {exc}") from None
    if not isinstance(payload, Mapping):
        raise ValueError(f"a {what} must be an object, got {type(payload).__name__}")
    unknown = set(payload) - set(fields)
    if unknown:
        raise ValueError(f"unknown {what} fields: {sorted(unknown)}")
    return dict(payload)


# --------------------------------------------------------------------------- JSON bytes
_SPLICE_MIN_CHARS = 4096
_BASE64_ALPHABET = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/="


def _lift_data_strings(value: Any, mark: str, lifted: list[bytes]) -> Any:
    """A copy of ``value`` with every long ``"data"`` string that is base64 (which JSON writes as
    it is: no character needs escaping) replaced by ``mark`` and its number; its bytes go to
    ``lifted``."""
    if isinstance(value, Mapping):
        out = {}
        for key, item in value.items():
            raw = _base64_bytes(item) if key == "data" else None
            if raw is not None:
                out[key] = f"{mark}{len(lifted)}"
                lifted.append(raw)
            else:
                out[key] = _lift_data_strings(item, mark, lifted)
        return out
    if isinstance(value, (list, tuple)):
        return [_lift_data_strings(item, mark, lifted) for item in value]
    return value


def _base64_bytes(item: Any) -> bytes | None:
    if not isinstance(item, str) or len(item) < _SPLICE_MIN_CHARS or not item.isascii():
        return None
    raw = item.encode("ascii")
    return raw if not raw.translate(None, _BASE64_ALPHABET) else None  # base64 characters only


def json_bytes(value: Any) -> bytes:
    """``json.dumps(value).encode()``, byte for byte, without JSON-escaping the long base64 strings
    of encoded arrays character by character: they are written in as they are (json.dumps scans
    ~0.4 GB/s of them on the 2-core machine, this ~1.2 GB/s; 2026-12-04)."""
    lifted: list[bytes] = []
    mark = f"lens-splice-{secrets.token_hex(16)}-"  # new each call: no other text can hold it
    text = json.dumps(_lift_data_strings(value, mark, lifted))
    if not lifted:
        return text.encode()
    parts = text.split(mark)
    if len(parts) != len(lifted) + 1:  # not with a fresh random mark; the plain path if ever
        return json.dumps(value).encode()
    pieces = [parts[0].encode()]
    for part in parts[1:]:
        digits = len(part) - len(part.lstrip("0123456789"))
        pieces += [lifted[int(part[:digits])], part[digits:].encode()]
    return b"".join(pieces)
