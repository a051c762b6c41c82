"""The base of the request objects that travel on the wire (steering vectors, probes, readouts'
weights) and the checks of their arrays: every array becomes float32 of its own, finite, and a
scale times it stays finite in float32. Importable without vllm or torch."""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Mapping
from typing import Annotated, Any, ClassVar, Self

import numpy as np
from pydantic import AfterValidator, BaseModel, ConfigDict, PrivateAttr, ValidationInfo

from lens_evals.request.content_memo import ContentMemo, current_values
from lens_evals.wire import formats as wire

BOUND_CONTEXT = "bound"  # validation context key: the wire.Bound an encoded array is decoded under


def float32_array(value: Any, bound: wire.Bound = wire.UNBOUNDED) -> np.ndarray:
    """``value`` as a float32 numpy array: a torch tensor of any dtype (bfloat16 included, which
    numpy cannot hold: ``tensor.numpy()`` and ``np.asarray(tensor)`` refuse it), a numpy array, nested
    lists, or one encoded wire array (refused unread if larger than ``bound``). Not numeric: a
    ValueError."""
    if isinstance(value, Mapping):
        return wire.decode_array(value, bound=bound).astype(np.float32)
    if hasattr(value, "detach"):  # torch.Tensor, without importing torch
        value = value.detach()
        value = value.resolve_conj().cpu().numpy() if value.is_complex() else value.float().cpu().numpy()
    try:
        array = np.asarray(value)
        if not np.iscomplexobj(array):
            return np.asarray(array, dtype=np.float32)
    except (TypeError, ValueError, OverflowError) as exc:
        raise ValueError(f"activations must be a numeric array: {exc}") from None
    # complex (np.linalg.eig's eigenvectors): the real part, unless it would drop an imaginary one
    if np.any(array.imag != 0):
        raise ValueError("activations must be real, got non-zero imaginary parts")
    return array.real.astype(np.float32)


def owned_float32_array(value: Any, info: ValidationInfo | None = None) -> np.ndarray:
    """:func:`float32_array` as a copy of its own: a float32 array or tensor would otherwise be
    shared with the caller, who may refill or normalise it in place before the request is sent.
    An encoded array is decoded under the validation context's bound (``from_wire``'s)."""
    context = info.context if info is not None and isinstance(info.context, Mapping) else {}
    return np.array(float32_array(value, context.get(BOUND_CONTEXT, wire.UNBOUNDED)), dtype=np.float32, copy=True)


def as_tensor(array: np.ndarray) -> Any:
    """A torch tensor sharing ``array``'s memory where torch is installed (vllm-lens's users call
    tensor methods on ``activations``), else the array itself."""
    try:
        import torch
    except ImportError:
        return array
    return torch.from_numpy(array)


FLOAT32_MAX = float(np.finfo(np.float32).max)


def _finite(value: float) -> float:
    if not math.isfinite(value):
        raise ValueError("must be finite")
    return value


def _float32(value: float) -> float:
    if not math.isfinite(value) or abs(value) > FLOAT32_MAX:
        raise ValueError(f"must be finite in float32 (|x| <= {FLOAT32_MAX:.4g}), got {value}")
    return value


FiniteFloat = Annotated[float, AfterValidator(_finite)]
# A number the engine uses in float32 (a scale, a value put in the stream): 1e39 is finite in
# Python but inf there.
Float32 = Annotated[float, AfterValidator(_float32)]


def check_scaled(name: str, array: np.ndarray, scale: float) -> None:
    """Refuse ``array`` with NaN / inf, or whose ``scale`` times it is not finite in float32 (a
    scale of 3e38 times a vector with an entry of 2 is inf: the stream would turn to inf / NaN)."""
    if not np.isfinite(array).all():
        raise ValueError(f"{name} contains NaN or inf")
    peak = float(np.abs(array).max(initial=0.0))
    if abs(scale) * peak > FLOAT32_MAX:
        raise ValueError(f"scale x {name} is not finite in float32: |scale| {abs(scale):.4g} x max |{name}| {peak:.4g} > {FLOAT32_MAX:.4g}")


class WireModel(BaseModel):
    """A request object that travels as a dict with wire-encoded arrays, or as a JSON string of
    that dict (HTTP ``vllm_xargs`` carry only strings and numbers). Unknown fields are refused."""

    model_config = ConfigDict(arbitrary_types_allowed=True, frozen=True)
    wire_name: ClassVar[str] = "object"
    _memo: ContentMemo | None = PrivateAttr(default=None)

    def to_wire(self) -> dict[str, Any]:
        raise NotImplementedError

    def content_key(self) -> tuple[Any, ...] | None:
        """Everything this object's checks, digest and wire form read (arrays as bytes); None: no memo."""
        return None

    def memo(self) -> dict[str, Any]:
        """What was computed from this object's content as it is now (``content_memo``), shared
        with the copies made while it held that content; empty after a change in place."""
        private = self.__pydantic_private__  # read directly: this runs several times per request
        memo = private.get("_memo") if private is not None else None
        kept, values = current_values(memo, self.content_key())
        if kept is not memo:
            self._memo = kept
        return values

    def __deepcopy__(self, memo: dict[int, Any] | None = None) -> Self:
        """A copy that shares nothing the caller could change in place (its own arrays and
        lists), made without pydantic's field-by-field deep copy: vLLM deep-copies every request's
        ``SamplingParams``, ``extra_args`` included (a torch tensor's generic deep copy cost
        ~150 us per steering vector). Arrays and tensors are copied directly, every other field
        (lists, nested request objects, dicts) by ``copy.deepcopy``."""
        memo = {} if memo is None else memo
        self.memo()  # made before the copy, so that the copies share it
        copied = copy.copy(self)
        memo[id(self)] = copied
        fields = copied.__dict__
        for name, value in self.__dict__.items():
            if isinstance(value, np.ndarray):
                fields[name] = value.copy()
            elif hasattr(value, "detach"):  # torch.Tensor, without importing torch
                fields[name] = value.detach().clone()
            elif not isinstance(value, (int, float, str, bool, type(None))):
                fields[name] = copy.deepcopy(value, memo)
        return copied

    def to_json(self) -> str:
        """The form to put in HTTP ``vllm_xargs``."""
        return json.dumps(self.to_wire())

    @classmethod
    def from_wire(cls, payload: Any, bound: wire.Bound = wire.UNBOUNDED) -> Self:
        """Accept the object itself, its wire dict or that dict as a JSON string; its encoded
        array is refused unread if it declares more than ``bound``."""
        if isinstance(payload, cls):
            return payload
        fields = wire.json_object(payload, cls.wire_name, cls.model_fields)
        return cls.model_validate(fields, context={BOUND_CONTEXT: bound})
