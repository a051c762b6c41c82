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

from typing import Any, ClassVar

import numpy as np
from pydantic import BaseModel, Field, ValidationInfo, field_serializer, field_validator, model_validator

from lens_evals.request.hooks import Hook
from lens_evals.request.wire_model import FiniteFloat, Float32, WireModel, as_tensor, check_scaled, owned_float32_array
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


class SteeringVector(WireModel):
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
        return as_tensor(owned_float32_array(value, info))

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
        checked = self.memo()  # the same content passed before (a copy vLLM made for a request)
        if checked.get("checked"):
            return self
        if not np.isfinite(acts).all():
            raise ValueError("activations contain NaN or inf")
        added = acts
        if self.norm_match:  # the direction v / ||v|| is added (times scale and the row's norm)
            norms = np.linalg.norm(acts.astype(np.float64), axis=-1, keepdims=True)  # float32 squares underflow
            if (norms == 0).any():
                raise ValueError("norm_match needs non-zero vectors (a zero vector has no direction)")
            added = acts / norms
        check_scaled("activations", added, self.scale)
        checked["checked"] = True
        return self

    def content_key(self) -> tuple[Any, ...]:
        acts = self.array
        positions = None if self.position_indices is None else list(self.position_indices)  # copies: the lists may change in place
        return (acts.tobytes(), acts.shape, acts.dtype.str, list(self.layer_indices), positions, self.scale, self.norm_match)

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


class LinearProbe(WireModel):
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

    def content_key(self) -> tuple[Any, ...]:
        weights = self.weights
        return (weights.tobytes(), weights.shape, weights.dtype.str, self.name, self.layer, self.bias)

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
