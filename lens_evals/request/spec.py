"""Request-side specification of lens features. Importable without vllm or torch.

A request asks for features through ``SamplingParams.extra_args`` (offline) or
``vllm_xargs`` (HTTP)::

    {"output_residual_stream": [3, 7] (or True: every layer; or a JSON string of either),
     "apply_steering_vectors": [SteeringVector(...) or its wire dict],
     "output_probe_scores": [LinearProbe(...) or its wire dict],
     "apply_hooks": [Hook(...) or a registered hook's wire dict],
     "use_hook_set": "<id of a registered persistent hook set>",
     "output_readouts": [LensReadout(...) / SaeReadout(...) or their wire dicts] (request/readouts.py),
     "activations_encoding": "vllm-lens" (absent: the same) | "safetensors" | "safetensors-zstd"
                             | "safetensors-frame"}

A list of objects may also come as ONE JSON string of the list (vllm-lens's wire form).

:func:`parse_lens_args` turns those values into a validated :class:`LensRequest`;
:meth:`LensRequest.check_model` adds the checks that need the model's shape.
"""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Mapping
from typing import Annotated, Any, ClassVar, Self

import numpy as np
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationInfo, field_serializer, field_validator, model_validator

from lens_evals.request.hooks import Hook
from lens_evals.wire import formats as wire

CAPTURE_KEY = "output_residual_stream"
STEERING_KEY = "apply_steering_vectors"
PROBE_KEY = "output_probe_scores"
HOOKS_KEY = "apply_hooks"
HOOK_SET_KEY = "use_hook_set"
ENCODING_KEY = "activations_encoding"
READOUTS_KEY = "output_readouts"  # lens and SAE readouts: lens_evals/request/readouts.py
LENS_KEYS = (CAPTURE_KEY, STEERING_KEY, PROBE_KEY, HOOKS_KEY, HOOK_SET_KEY, ENCODING_KEY, READOUTS_KEY)
# Key the frontend adds so worker results can be fetched; never set by users.
INTERNAL_KEY = "_lens_evals"
MAX_LAYERS_PER_REQUEST = 4096
MAX_PROBES_PER_REQUEST = 4096
# Each hook runs in Python once per layer and step: 2,000 hooks at 4 layers made 8 tokens of a
# batch take 1.8 s instead of 0.04 s (tiny Llama, CPU), for every request of the batch.
MAX_HOOKS_PER_REQUEST = 256
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


def _as_tensor(array: np.ndarray) -> Any:
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


class _WireModel(BaseModel):
    """A request object that travels as a dict with wire-encoded arrays, or as a JSON string of
    that dict (HTTP ``vllm_xargs`` carry only strings and numbers). Unknown fields are refused."""

    model_config = ConfigDict(arbitrary_types_allowed=True, frozen=True)
    wire_name: ClassVar[str] = "object"

    def to_wire(self) -> dict[str, Any]:
        raise NotImplementedError

    def __deepcopy__(self, memo: dict[int, Any] | None = None) -> Self:
        """A copy that shares nothing the caller could change in place (its own arrays and
        lists), made without pydantic's field-by-field deep copy: vLLM deep-copies every request's
        ``SamplingParams``, ``extra_args`` included (a torch tensor's generic deep copy cost
        ~150 us per steering vector). Arrays and tensors are copied directly, every other field
        (lists, nested request objects, dicts) by ``copy.deepcopy``."""
        memo = {} if memo is None else memo
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


class SteeringVector(_WireModel):
    """Add ``scale * v`` (or ``scale * ||h|| * v / ||v||`` with ``norm_match``) to the
    residual stream after each layer in ``layer_indices``.

    ``activations`` is ``(n_layers, hidden)`` (at every position, or at each entry of
    ``position_indices`` when given) or ``(n_layers, n_positions, hidden)`` with one row per
    entry of ``position_indices``, which are absolute token positions in the sequence
    (prompt and generated tokens counted from 0; None with 3-D activations: 0..n_positions-1).
    ``activations`` is held as float32: a torch tensor where torch is installed, else numpy
    (``array`` is always numpy). ``model_dump(mode="json")`` encodes it (see ``lens_evals.wire``).
    """

    wire_name: ClassVar[str] = "steering vector"

    activations: Any
    layer_indices: list[int]
    scale: Float32 = 1.0
    norm_match: bool = False
    position_indices: list[int] | None = None

    @field_validator("activations", mode="before")
    @classmethod
    def _to_array(cls, value: Any, info: ValidationInfo) -> Any:
        return _as_tensor(owned_float32_array(value, info))

    @field_serializer("activations")
    def _encode_activations(self, value: Any) -> dict[str, Any]:
        return wire.encode_array(self.array)

    @property
    def array(self) -> np.ndarray:
        """``activations`` as a float32 numpy array (shares memory)."""
        return np.asarray(self.activations)

    @field_validator("layer_indices", "position_indices")
    @classmethod
    def _indices(cls, value: list[int] | None, info: Any) -> list[int] | None:
        if value is None:
            return None
        if len(value) == 0:
            raise ValueError(f"{info.field_name} must not be empty")
        if len(value) > MAX_LAYERS_PER_REQUEST and info.field_name == "layer_indices":
            raise ValueError(f"too many layer indices ({len(value)})")
        if any(i < 0 for i in value):
            raise ValueError(f"{info.field_name} must be >= 0, got {value}")
        if len(set(value)) != len(value):
            raise ValueError(f"{info.field_name} has duplicates: {value}")
        return list(value)

    @model_validator(mode="after")
    def _shapes(self) -> SteeringVector:
        acts = self.array
        if acts.ndim not in (2, 3):
            raise ValueError(f"activations must be (n_layers, hidden) or (n_layers, n_positions, hidden), got shape {acts.shape}")
        if acts.shape[0] != len(self.layer_indices):
            raise ValueError(f"activations has {acts.shape[0]} layer rows but layer_indices has {len(self.layer_indices)}")
        if acts.ndim == 3:
            positions = self.position_indices
            if positions is None:  # vllm-lens's rule: positions 0..n-1
                positions = self.__dict__["position_indices"] = list(range(acts.shape[1]))
            if acts.shape[1] != len(positions):
                raise ValueError(f"activations has {acts.shape[1]} position rows but position_indices has {len(positions)}")
        if not np.isfinite(acts).all():
            raise ValueError("activations contain NaN or inf")
        added = acts
        if self.norm_match:  # the direction v / ||v|| is added (times scale and the row's norm)
            norms = np.linalg.norm(acts.astype(np.float64), axis=-1, keepdims=True)  # float32 squares underflow
            if (norms == 0).any():
                raise ValueError("norm_match needs non-zero vectors (a zero vector has no direction)")
            added = acts / norms
        check_scaled("activations", added, self.scale)
        return self

    @property
    def hidden_size(self) -> int:
        return int(self.array.shape[-1])

    def per_position(self) -> np.ndarray:
        """Vectors as (n_layers, n_positions or 1, hidden)."""
        acts = self.array
        return acts[:, None, :] if acts.ndim == 2 else acts

    def to_wire(self) -> dict[str, Any]:
        return {
            "activations": wire.encode_array(self.array),
            "layer_indices": self.layer_indices,
            "scale": self.scale,
            "norm_match": self.norm_match,
            "position_indices": self.position_indices,
        }


class LinearProbe(_WireModel):
    """A linear read-out of the residual stream after layer ``layer``: for every token row
    the engine returns ``weights . h + bias`` (one score per token; only scores leave the worker)."""

    wire_name: ClassVar[str] = "probe"

    name: str
    layer: int = Field(ge=0, strict=True)
    weights: np.ndarray
    bias: FiniteFloat = 0.0

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("probe name must not be empty")
        return value

    @field_validator("weights", mode="before")
    @classmethod
    def _to_array(cls, value: Any, info: ValidationInfo) -> np.ndarray:
        return owned_float32_array(value, info)

    @field_serializer("weights")
    def _encode_weights(self, value: np.ndarray) -> dict[str, Any]:
        return wire.encode_array(value)

    @field_validator("weights")
    @classmethod
    def _weights(cls, value: np.ndarray) -> np.ndarray:
        if value.ndim != 1 or value.size == 0:
            raise ValueError(f"probe weights must be a non-empty 1-D array (hidden,), got shape {value.shape}")
        if not np.isfinite(value).all():
            raise ValueError("probe weights contain NaN or inf")
        return value

    @property
    def hidden_size(self) -> int:
        return int(self.weights.shape[0])

    def to_wire(self) -> dict[str, Any]:
        return {"name": self.name, "layer": self.layer, "weights": wire.encode_array(self.weights), "bias": self.bias}


class LensRequest(BaseModel):
    """What one request asks of the engine, validated."""

    capture_layers: list[int] = Field(default_factory=list)
    capture_all: bool = False  # output_residual_stream=True: every layer (see ``for_model``)
    steering: list[SteeringVector] = Field(default_factory=list)
    probes: list[LinearProbe] = Field(default_factory=list)
    hooks: list[Hook] = Field(default_factory=list)
    hook_set: str | None = None
    encoding: str = wire.DEFAULT_RESPONSE_ENCODING
    readouts: list[Any] = Field(default_factory=list)  # readouts.LensReadout / SaeReadout, checked there

    @field_validator("encoding")
    @classmethod
    def _encoding(cls, value: str) -> str:
        if value not in wire.RESPONSE_ENCODINGS:
            raise ValueError(f"{ENCODING_KEY} must be one of {', '.join(wire.RESPONSE_ENCODINGS)}, got {value!r}")
        return value

    @field_validator("hooks")
    @classmethod
    def _few_hooks(cls, value: list[Hook]) -> list[Hook]:
        if len(value) > MAX_HOOKS_PER_REQUEST:
            raise ValueError(f"{HOOKS_KEY}: too many hooks ({len(value)}), at most {MAX_HOOKS_PER_REQUEST} per request")
        return value

    @field_validator("probes")
    @classmethod
    def _unique_probe_names(cls, value: list[LinearProbe]) -> list[LinearProbe]:
        names = [probe.name for probe in value]
        duplicates = sorted({name for name in names if names.count(name) > 1})
        if duplicates:
            raise ValueError(f"{PROBE_KEY}: probe names must be unique per request, duplicated: {duplicates}")
        if len(value) > MAX_PROBES_PER_REQUEST:
            raise ValueError(f"{PROBE_KEY}: too many probes ({len(value)})")
        return value

    @property
    def active(self) -> bool:
        return bool(self.capture_layers or self.capture_all or self.steering or self.probes or self.hooks or self.hook_set or self.readouts)

    def for_model(self, num_layers: int) -> LensRequest:
        """This request with ``capture_all`` resolved to the model's layers."""
        if not self.capture_all:
            return self
        return self.model_copy(update={"capture_layers": list(range(num_layers)), "capture_all": False})

    def check_model(self, num_layers: int, hidden_size: int, max_positions: int, max_capture_bytes: int) -> None:
        """Raise ValueError if the request does not fit the model or the limits."""
        for layer in self.capture_layers:
            if layer >= num_layers:
                raise ValueError(f"capture layer {layer} out of range: the model has {num_layers} layers (0..{num_layers - 1})")
        for n, vec in enumerate(self.steering):
            for layer in vec.layer_indices:
                if layer >= num_layers:
                    raise ValueError(f"steering vector {n}: layer {layer} out of range: the model has {num_layers} layers")
            if vec.hidden_size != hidden_size:
                raise ValueError(f"steering vector {n}: hidden size {vec.hidden_size} does not match the model's {hidden_size}")
            for pos in vec.position_indices or []:
                if pos >= max_positions:
                    raise ValueError(
                        f"steering vector {n}: position {pos} out of range: this request has at most {max_positions} positions"
                    )
        for probe in self.probes:
            if probe.layer >= num_layers:
                raise ValueError(
                    f"probe {probe.name!r}: layer {probe.layer} out of range: the model has {num_layers} layers (0..{num_layers - 1})"
                )
            if probe.hidden_size != hidden_size:
                raise ValueError(
                    f"probe {probe.name!r}: weights length {probe.hidden_size} does not match the model's hidden size {hidden_size}"
                )
        for hook in self.hooks:
            out_of_range = [layer for layer in hook.layer_indices if layer >= num_layers]
            if out_of_range:
                raise ValueError(f"hook {hook.name}: layers {out_of_range} out of range: the model has {num_layers} layers")
        capture_bytes = len(self.capture_layers) * max_positions * hidden_size * 4
        if capture_bytes > max_capture_bytes:
            raise ValueError(
                f"capture of {len(self.capture_layers)} layers x {max_positions} positions x {hidden_size} "
                f"needs {capture_bytes / 2**30:.2f} GiB, over the per-request limit of "
                f"{max_capture_bytes / 2**30:.2f} GiB (LENS_EVALS_MAX_CAPTURE_GIB)"
            )
