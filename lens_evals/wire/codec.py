"""Bytes under :mod:`lens_evals.wire`: tensors as (bytes, dtype, shape), the safetensors layout
(written and read here because numpy has no bfloat16: the files are what ``safetensors.torch``
writes and reads), zstd with a bound on the inflated size. Importable without torch."""

from __future__ import annotations

import base64
import binascii
import io
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from types import ModuleType
from typing import Any, TypeGuard

import numpy as np
import zstandard

MAX_DECODED_BYTES = 2 * 2**30  # one decoded payload; larger declared sizes are refused unread
MAX_ITEMSIZE = 8  # the widest dtype that travels (float64, int64)
# What a safetensors file of one tensor may hold beside its data: its header (~100 bytes; some
# writers add ``__metadata__``), padded to 8 bytes.
HEADER_SLACK = 4096
MAX_DIMS = 8
ZSTD_LEVEL = 1
# dtype name -> (safetensors code, numpy storage dtype)
DTYPES: dict[str, tuple[str, str]] = {
    "float64": ("F64", "float64"),
    "float32": ("F32", "float32"),
    "float16": ("F16", "float16"),
    "bfloat16": ("BF16", "uint16"),
    "int64": ("I64", "int64"),
    "int32": ("I32", "int32"),
    "int16": ("I16", "int16"),
    "int8": ("I8", "int8"),
    "uint8": ("U8", "uint8"),
    "bool": ("BOOL", "bool"),
}
_BY_CODE = {code: name for name, (code, _) in DTYPES.items()}


class WireError(ValueError):
    """A payload could not be decoded."""


def _fastest_base64() -> ModuleType:
    """pybase64 (SIMD; a vLLM dependency, so on every server) where installed, else the standard
    library's module (a client-only install): the same functions, the same results."""
    try:
        import pybase64
    except ImportError:
        return base64
    return pybase64


_base64 = _fastest_base64()


def b64encode(data: bytes | memoryview) -> str:
    """Standard base64 with padding, as ``base64.b64encode``: ~2.5x faster with pybase64 (1.5 GB/s
    on the 2-core machine, 2026-12-04)."""
    encoded: bytes = _base64.b64encode(data)
    return encoded.decode("ascii")


def b64decode(text: str) -> bytes:
    """Strict standard base64 (anything outside the alphabet is an error), as
    ``base64.b64decode(text, validate=True)``: ~7x faster with pybase64 (1.8 GB/s against 0.24)."""
    try:
        decoded: bytes = _base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise WireError(f"tensor data is not valid base64: {exc}") from None
    return decoded


def json_loads(text: str | bytes | bytearray) -> Any:
    """``json.loads``, with nesting too deep for Python's parser (a RecursionError, which no
    caller expects from bad input) raised as the ``JSONDecodeError`` bad JSON gets."""
    try:
        return json.loads(text)
    except RecursionError:
        doc = text if isinstance(text, str) else bytes(text[:64]).decode("utf-8", "replace")
        raise json.JSONDecodeError("JSON nested too deeply", doc, 0) from None


def has_torch() -> bool:
    try:
        import torch  # noqa: F401
    except ImportError:
        return False
    return True


def is_int(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class Raw:
    """One tensor's bytes (C order), dtype name (a key of ``DTYPES``) and shape."""

    data: bytes | memoryview
    dtype: str
    shape: tuple[int, ...]

    def to_numpy(self) -> np.ndarray:
        """A writable array; bfloat16 widened to float32 (exact)."""
        array = np.frombuffer(self.data, dtype=DTYPES[self.dtype][1]).reshape(self.shape)
        if self.dtype == "bfloat16":
            return (array.astype(np.uint32) << 16).view(np.float32)
        return array.copy()

    def to_torch(self) -> Any:
        import torch

        array = np.frombuffer(self.data, dtype=DTYPES[self.dtype][1]).reshape(self.shape).copy()
        if self.dtype == "bfloat16":
            return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
        return torch.from_numpy(array)


def raw_dtype_name(value: Any) -> str:
    if hasattr(value, "detach"):
        return str(value.dtype).removeprefix("torch.")
    return np.asarray(value).dtype.name


def raw_of(value: Any, copy: bool = True) -> Raw:
    """A numpy array or torch tensor (any device) as Raw, native dtype (``copy=False``: a view of
    the host array's bytes, which it keeps alive, where no copy is needed to make one)."""
    dtype = raw_dtype_name(value)
    if dtype not in DTYPES:
        raise WireError(f"dtype {dtype} cannot travel ({', '.join(DTYPES)})")
    if hasattr(value, "detach"):
        tensor = value.detach().cpu().contiguous()
        if dtype == "bfloat16":
            import torch

            tensor = tensor.view(torch.int16)
        array = tensor.numpy()
    else:
        array = np.ascontiguousarray(value)
    data = array.tobytes() if copy else memoryview(array.reshape(-1)).cast("B")
    return Raw(data, dtype, tuple(int(n) for n in array.shape))


# --------------------------------------------------------------------------- bounds
class Budget:
    """The bytes a request's arrays may still decode to, in all (shared by its :class:`Bound` s)."""

    def __init__(self, nbytes: int) -> None:
        self.total = self.left = nbytes

    def take(self, nbytes: int) -> None:
        if nbytes > self.left:
            raise WireError(
                f"the request's arrays would decode to more than {self.total} bytes in all "
                "(LENS_EVALS_MAX_REQUEST_ARRAYS_GIB); refused before decoding"
            )
        self.left -= nbytes


@dataclass(frozen=True)
class Bound:
    """The most one array may decode to: ``max_elements`` (the largest the model can use, e.g. its
    hidden size for a probe's weights; ``what`` says which) and bytes taken from ``budget``. Each
    size a payload declares (its shape, its zstd ``nbytes``, its base64 length) is checked against
    it BEFORE anything is decoded or inflated."""

    max_elements: int
    what: str = "an array"
    budget: Budget | None = None

    @property
    def max_bytes(self) -> int:
        """The largest payload that can hold a legal array (in the widest dtype), with its header."""
        return min(MAX_DECODED_BYTES, self.max_elements * MAX_ITEMSIZE + HEADER_SLACK)

    def check_elements(self, shape: tuple[int, ...]) -> None:
        if math.prod(shape) > self.max_elements:
            raise WireError(
                f"tensor of shape {list(shape)} has {math.prod(shape)} elements, over the {self.max_elements} "
                f"that {self.what} may have; refused before decoding"
            )

    def reserve(self, nbytes: int, declared: str) -> None:
        """Take ``nbytes`` (what the payload's ``declared`` size says it decodes to) or refuse it."""
        if nbytes > self.max_bytes:
            raise WireError(
                f"tensor {declared} {nbytes} bytes, over the {self.max_bytes} that {self.what} may take "
                f"(at most {self.max_elements} elements); refused before decoding"
            )
        if self.budget is not None:
            self.budget.take(nbytes)


UNBOUNDED = Bound(MAX_DECODED_BYTES, "any array")  # no model to size against: the global bound alone


# --------------------------------------------------------------------------- sizes
def checked_shape(shape: Any) -> tuple[int, ...]:
    if not (isinstance(shape, list) and len(shape) <= MAX_DIMS and all(is_int(n) and n >= 0 for n in shape)):
        raise WireError(f"shape must be a list of at most {MAX_DIMS} non-negative integers, got {shape!r}")
    return tuple(shape)


def check_size(nbytes: int) -> None:
    if nbytes > MAX_DECODED_BYTES:
        raise WireError(f"tensor would decode to {nbytes} bytes, over the bound of {MAX_DECODED_BYTES} bytes; refused before decoding")


def nbytes_of(dtype: str, shape: tuple[int, ...]) -> int:
    nbytes = math.prod(shape) * np.dtype(DTYPES[dtype][1]).itemsize
    check_size(nbytes)
    return nbytes


def b64_chars(nbytes: int) -> int:
    return 4 * (-(-nbytes // 3))


def compress_bound(nbytes: int) -> int:
    """At least zstd's worst case (ZSTD_COMPRESSBOUND) for ``nbytes`` of input."""
    return nbytes + nbytes // 128 + 1024


# --------------------------------------------------------------------------- zstd
def compress(data: bytes) -> bytes:
    return zstandard.ZstdCompressor(level=ZSTD_LEVEL).compress(data)


def inflate(packed: bytes | memoryview, expected: int) -> bytes:
    """Inflate one zstd frame that must hold exactly ``expected`` bytes (already checked against
    MAX_DECODED_BYTES). A frame declaring another size is refused unread; an undeclared size is
    read at most ``expected + 1`` bytes far, so nothing past the bound is ever inflated."""
    try:
        declared = zstandard.frame_content_size(packed)
    except zstandard.ZstdError as exc:
        raise WireError(f"tensor data is not a zstd frame: {exc}") from None
    if declared not in (-1, expected):
        raise WireError(f"zstd frame declares {declared} bytes but the tensor needs {expected}; refused before inflating")
    reader = zstandard.ZstdDecompressor().stream_reader(io.BytesIO(packed), read_across_frames=False)
    out = bytearray()
    try:
        while len(out) <= expected:
            chunk = reader.read(min(expected + 1 - len(out), 1 << 20))
            if not chunk:
                break
            out += chunk
    except zstandard.ZstdError as exc:
        raise WireError(f"zstd data is corrupt: {exc}") from None
    if len(out) > expected:
        raise WireError(f"zstd frame inflates past the {expected} bytes the tensor needs; refused")
    if len(out) < expected:
        raise WireError(f"zstd frame truncated: it inflates to {len(out)} of {expected} bytes")
    return bytes(out)


# --------------------------------------------------------------------------- vllm-lens dtypes
def vllm_lens_dtype(storage: Any, original: Any, allowed: frozenset[str]) -> str:
    """The tensor's dtype from vllm-lens's ``dtype`` (numpy storage) and ``original_dtype``."""
    if not isinstance(storage, str) or storage not in DTYPES or storage == "bfloat16":
        raise WireError(f"unknown storage dtype {storage!r} ({', '.join(n for n in DTYPES if n != 'bfloat16')})")
    if original is None:
        dtype = storage
    elif not isinstance(original, str) or original.removeprefix("torch.") not in DTYPES:
        raise WireError(f"unknown original_dtype {original!r}")
    else:
        dtype = original.removeprefix("torch.")
        if dtype != storage and not (dtype == "bfloat16" and storage == "int16"):
            raise WireError(f"original_dtype {original} does not match the storage dtype {storage}")
    if dtype not in allowed:
        raise WireError(f"dtype {dtype} not allowed ({', '.join(sorted(allowed))})")
    return dtype


# --------------------------------------------------------------------------- safetensors
class Buffers(tuple[bytes | memoryview, ...]):
    """Buffers that are one byte string laid end to end, not joined (a frame sends them as they are)."""

    @property
    def nbytes(self) -> int:
        return sum(memoryview(piece).nbytes for piece in self)


def safetensors_pieces(tensors: Mapping[str, Raw]) -> Buffers:
    """A safetensors file of these tensors as its header and the tensors' own buffers."""
    header: dict[str, Any] = {}
    offset = 0
    for name, raw in tensors.items():
        size = memoryview(raw.data).nbytes
        header[name] = {"dtype": DTYPES[raw.dtype][0], "shape": list(raw.shape), "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return Buffers((len(text).to_bytes(8, "little") + text, *(raw.data for raw in tensors.values())))


def safetensors_bytes(tensors: Mapping[str, Raw]) -> bytes:
    return b"".join(safetensors_pieces(tensors))


def parse_safetensors(raw: bytes | memoryview, allowed: frozenset[str], bound: Bound = UNBOUNDED) -> dict[str, Raw]:
    """Read a safetensors file, validating every header entry before touching the body."""
    if len(raw) < 8:
        raise WireError("tensor payload truncated (no header)")
    header_len = int.from_bytes(raw[:8], "little")
    if header_len <= 0 or 8 + header_len > len(raw):
        raise WireError("tensor payload truncated (header length beyond data)")
    try:
        header = json_loads(bytes(raw[8 : 8 + header_len]))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise WireError(f"tensor header is not JSON: {exc}") from None
    if not isinstance(header, dict):
        raise WireError("tensor header is not an object")
    body = memoryview(raw)[8 + header_len :]
    out: dict[str, Raw] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= info.keys():
            raise WireError(f"tensor {name!r}: malformed header entry")
        dtype = _BY_CODE.get(str(info["dtype"]).upper()) if isinstance(info["dtype"], str) else None
        if dtype not in allowed:
            raise WireError(f"tensor {name!r}: dtype {info['dtype']!r} not allowed ({', '.join(sorted(allowed))})")
        offsets = info["data_offsets"]
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(is_int(x) for x in offsets)):
            raise WireError(f"tensor {name!r}: data_offsets must be two integers")
        try:
            shape = checked_shape(info["shape"])
        except WireError as exc:
            raise WireError(f"tensor {name!r}: {exc}") from None
        bound.check_elements(shape)
        start, end = offsets
        if not (0 <= start <= end <= len(body)):
            raise WireError(f"tensor {name!r}: data offsets outside payload (truncated?)")
        if end - start != nbytes_of(dtype, shape):
            raise WireError(f"tensor {name!r}: {end - start} bytes do not match dtype {dtype} and shape {list(shape)}")
        out[name] = Raw(body[start:end], dtype, shape)
    return out
