"""Readouts computed on the worker (``output_readouts``): lens readouts (the top-k tokens of a
layer's stream read through the model's own final norm and unembedding, optionally after an
affine translator per layer) and sparse-autoencoder latents (the top-k active latents of an
encoder on one layer). Importable without vllm or torch; docs/readouts.md is the reference.

Wire forms (dicts with wire-encoded arrays, or JSON strings of them)::

    {"kind": "lens", "name": "logit", "layers": [0, 5] | "all", "top_k": 10,
     "lens": null | {"weights": [n, d, d], "biases": [n, d] | null, "layers": [...]} | {"digest": "..."}}
    {"kind": "sae", "name": "sae", "layer": 3, "top_k": 16,
     "sae": {"W_enc": [d, n], "b_enc": [n], "b_dec": [d] | null, "threshold": [n] | null,
             "activation": "relu" | "topk" | "jumprelu", "k": int | null,
             "apply_b_dec_to_input": bool} | {"digest": "..."}}

Weights are named by a digest (SHA-256 of their content, :meth:`AffineLens.content_digest` /
:meth:`SaeEncoder.content_digest`): a request may send ``{"digest": ...}`` alone once the engine has
the weights from an earlier request (``engine/transport/readout_cache.py``)."""

from __future__ import annotations

import hashlib
from typing import Any, ClassVar, Literal

import numpy as np
from pydantic import Field, ValidationError, ValidationInfo, field_validator, model_validator

from lens_evals.request.spec import BOUND_CONTEXT, MAX_LAYERS_PER_REQUEST, READOUTS_KEY, _WireModel, owned_float32_array
from lens_evals.wire import formats as wire

MAX_READOUTS_PER_REQUEST = 64
MAX_LENS_TOP_K = 64
MAX_SAE_TOP_K = 256
MAX_SAE_LATENTS = 1 << 24  # latent ids travel as float32 beside their values: exact below 2**24
LOGIT_CHUNK_ROWS = 256  # rows whose full-vocabulary logits a lens readout makes at once (256 x 152k vocab x 4 B = 156 MiB)
ACTIVATIONS = ("relu", "topk", "jumprelu")


def _digest(*parts: Any) -> str:
    """SHA-256 of arrays (float32 bytes and shape) and plain values, in order."""
    h = hashlib.sha256()
    for part in parts:
        if isinstance(part, np.ndarray):
            h.update(repr(part.shape).encode() + np.ascontiguousarray(part, dtype=np.float32).tobytes())
        else:
            h.update(repr(part).encode())
        h.update(b"|")
    return h.hexdigest()


def _array(value: Any, info: ValidationInfo) -> np.ndarray | None:
    if value is None:
        return None
    array = owned_float32_array(value, info)
    if not np.isfinite(array).all():
        raise ValueError(f"{info.field_name} contains NaN or inf")
    return array


class AffineLens(_WireModel):
    """Per layer ``T_i(h) = h @ weights[i].T + biases[i]`` before the final norm and unembedding
    (a tuned lens stores ``I + A_i``, a Jacobian lens ``J_i``). ``weights`` (n, d, d) and
    ``biases`` (n, d) are given for ``layers`` (n entries), or the lens is named by ``digest``
    alone (weights sent by an earlier request)."""

    wire_name: ClassVar[str] = "affine lens"

    layers: list[int] | None = None
    weights: Any = None
    biases: Any = None
    digest: str | None = None

    @field_validator("weights", "biases", mode="before")
    @classmethod
    def _arrays(cls, value: Any, info: ValidationInfo) -> np.ndarray | None:
        return _array(value, info)

    @property
    def inline(self) -> bool:
        return self.weights is not None

    @model_validator(mode="after")
    def _shapes(self) -> AffineLens:
        if self.weights is None:
            if self.digest is None:
                raise ValueError("an affine lens needs weights (with layers) or the digest of weights sent before")
            if self.biases is not None or self.layers is not None:
                raise ValueError("an affine lens given by digest takes no layers or biases")
            return self
        w = self.weights
        if self.layers is None or not self.layers:
            raise ValueError("an affine lens with weights needs its layers")
        if len(set(self.layers)) != len(self.layers) or min(self.layers) < 0:
            raise ValueError(f"affine lens layers must be distinct and >= 0, got {self.layers}")
        if w.ndim != 3 or w.shape[0] != len(self.layers) or w.shape[1] != w.shape[2] or w.shape[1] == 0:
            raise ValueError(f"affine lens weights must be (n_layers={len(self.layers)}, d, d), got shape {list(w.shape)}")
        if self.biases is not None and self.biases.shape != w.shape[:2]:
            raise ValueError(f"affine lens biases must be (n_layers, d) = {list(w.shape[:2])}, got {list(self.biases.shape)}")
        if self.digest is not None and self.digest != self.content_digest():
            raise ValueError("affine lens digest does not match its weights")
        return self

    @property
    def hidden_size(self) -> int:
        return int(self.weights.shape[1])

    def content_digest(self) -> str:
        """What names these weights (the digest given when they are not inline)."""
        if self.weights is None:
            assert self.digest is not None
            return self.digest
        biases = self.biases if self.biases is not None else np.zeros(self.weights.shape[:2], dtype=np.float32)
        return _digest("affine", self.layers, self.weights, biases)

    def nbytes(self) -> int:
        return 0 if self.weights is None else int(self.weights.nbytes + (0 if self.biases is None else self.biases.nbytes))

    def to_wire(self) -> dict[str, Any]:
        if self.weights is None:
            return {"digest": self.content_digest()}
        return {
            "layers": self.layers,
            "weights": wire.encode_array(self.weights),
            "biases": None if self.biases is None else wire.encode_array(self.biases),
            "digest": self.content_digest(),
        }


class SaeEncoder(_WireModel):
    """A sparse autoencoder's encoder (SAE-Lens layout): ``latents = act((h - b_dec) @ W_enc +
    b_enc)`` (``b_dec`` subtracted only with ``apply_b_dec_to_input``); relu: max(0, .);
    jumprelu: pre * (pre > threshold); topk: the ``k`` largest kept (others 0), then relu."""

    wire_name: ClassVar[str] = "sae encoder"

    W_enc: Any = None
    b_enc: Any = None
    b_dec: Any = None
    threshold: Any = None
    activation: Literal["relu", "topk", "jumprelu"] = "relu"
    k: int | None = Field(default=None, ge=1, le=MAX_SAE_LATENTS, strict=True)
    apply_b_dec_to_input: bool = False
    digest: str | None = None

    @field_validator("W_enc", "b_enc", "b_dec", "threshold", mode="before")
    @classmethod
    def _arrays(cls, value: Any, info: ValidationInfo) -> np.ndarray | None:
        return _array(value, info)

    @property
    def inline(self) -> bool:
        return self.W_enc is not None

    @model_validator(mode="after")
    def _shapes(self) -> SaeEncoder:
        if self.W_enc is None:
            if self.digest is None:
                raise ValueError("an SAE encoder needs W_enc and b_enc, or the digest of an encoder sent before")
            if any(x is not None for x in (self.b_enc, self.b_dec, self.threshold)):
                raise ValueError("an SAE encoder given by digest takes no arrays")
            return self
        w = self.W_enc
        if w.ndim != 2 or 0 in w.shape:
            raise ValueError(f"W_enc must be (d_in, d_sae), got shape {list(w.shape)}")
        d, n = w.shape
        if n > MAX_SAE_LATENTS:
            raise ValueError(f"an SAE may have at most {MAX_SAE_LATENTS} latents, got {n}")
        if self.b_enc is None or self.b_enc.shape != (n,):
            raise ValueError(f"b_enc must be ({n},), got {None if self.b_enc is None else list(self.b_enc.shape)}")
        if self.b_dec is not None and self.b_dec.shape != (d,):
            raise ValueError(f"b_dec must be ({d},), got {list(self.b_dec.shape)}")
        if self.apply_b_dec_to_input and self.b_dec is None:
            raise ValueError("apply_b_dec_to_input needs b_dec")
        if self.activation == "jumprelu" and (self.threshold is None or self.threshold.shape != (n,)):
            raise ValueError(f"a jumprelu SAE needs threshold ({n},)")
        if self.activation != "jumprelu" and self.threshold is not None:
            raise ValueError("threshold is for jumprelu SAEs only")
        if (self.activation == "topk") != (self.k is not None):
            raise ValueError("k is required for (and only for) topk SAEs")
        if self.k is not None and self.k > n:
            raise ValueError(f"k {self.k} is larger than the SAE's {n} latents")
        if self.digest is not None and self.digest != self.content_digest():
            raise ValueError("SAE digest does not match its weights")
        return self

    @property
    def hidden_size(self) -> int:
        return int(self.W_enc.shape[0])

    @property
    def num_latents(self) -> int:
        return int(self.W_enc.shape[1])

    def content_digest(self) -> str:
        if self.W_enc is None:
            assert self.digest is not None
            return self.digest
        b_dec = self.b_dec if self.apply_b_dec_to_input else None
        return _digest("sae", self.activation, self.k, self.W_enc, self.b_enc, b_dec, self.threshold)

    def nbytes(self) -> int:
        return sum(int(a.nbytes) for a in (self.W_enc, self.b_enc, self.b_dec, self.threshold) if a is not None)

    def to_wire(self) -> dict[str, Any]:
        if self.W_enc is None:
            return {"digest": self.content_digest()}
        enc = {
            name: None if (a := getattr(self, name)) is None else wire.encode_array(a) for name in ("W_enc", "b_enc", "b_dec", "threshold")
        }
        return enc | {
            "activation": self.activation,
            "k": self.k,
            "apply_b_dec_to_input": self.apply_b_dec_to_input,
            "digest": self.content_digest(),
        }


def _readout_name(value: str) -> str:
    if not value.strip():
        raise ValueError("readout name must not be empty")
    return value


class LensReadout(_WireModel):
    """The top ``top_k`` tokens and their log-probs per (layer, position):
    ``log_softmax(unembed(final_norm(T_i(h_i))))`` with the model's own final norm and
    unembedding (``lens`` None: the logit lens, ``T_i(h) = h``)."""

    wire_name: ClassVar[str] = "lens readout"

    kind: Literal["lens"] = "lens"
    name: str
    layers: list[int] | Literal["all"]
    top_k: int = Field(default=10, ge=1, le=MAX_LENS_TOP_K, strict=True)
    lens: AffineLens | None = None

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        return _readout_name(value)

    @field_validator("lens", mode="before")
    @classmethod
    def _lens(cls, value: Any) -> Any:
        return None if value is None else AffineLens.from_wire(value)

    @field_validator("layers")
    @classmethod
    def _layers(cls, value: list[int] | str) -> list[int] | str:
        if isinstance(value, str):
            return value
        if not value or len(value) > MAX_LAYERS_PER_REQUEST:
            raise ValueError(f"layers must name 1..{MAX_LAYERS_PER_REQUEST} layers or be 'all'")
        if min(value) < 0 or len(set(value)) != len(value):
            raise ValueError(f"layers must be distinct and >= 0, got {value}")
        return sorted(value)

    def layers_for(self, num_layers: int) -> list[int]:
        if self.layers == "all":
            return list(range(num_layers)) if self.lens is None or not self.lens.inline else list(self.lens.layers or [])
        return list(self.layers)

    def to_wire(self) -> dict[str, Any]:
        lens = None if self.lens is None else self.lens.to_wire()
        return {"kind": "lens", "name": self.name, "layers": self.layers, "top_k": self.top_k, "lens": lens}


class SaeReadout(_WireModel):
    """The top ``top_k`` latents (ids and activations) of an SAE encoder on layer ``layer``'s
    stream, per position; ids of latents that are 0 are reported as -1."""

    wire_name: ClassVar[str] = "sae readout"

    kind: Literal["sae"] = "sae"
    name: str
    layer: int = Field(ge=0, strict=True)
    top_k: int = Field(default=16, ge=1, le=MAX_SAE_TOP_K, strict=True)
    sae: SaeEncoder

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        return _readout_name(value)

    @field_validator("sae", mode="before")
    @classmethod
    def _sae(cls, value: Any) -> Any:
        return SaeEncoder.from_wire(value)

    def to_wire(self) -> dict[str, Any]:
        return {"kind": "sae", "name": self.name, "layer": self.layer, "top_k": self.top_k, "sae": self.sae.to_wire()}


Readout = LensReadout | SaeReadout


def readout_bounds(num_layers: int, hidden_size: int, budget: wire.Budget | None = None) -> tuple[wire.Bound, wire.Bound]:
    """(affine lens array, SAE array) bounds: the largest the model can use, sharing ``budget``."""
    return (
        wire.Bound(num_layers * hidden_size * hidden_size, f"an affine lens ({num_layers} layers x {hidden_size} x {hidden_size})", budget),
        wire.Bound(hidden_size * MAX_SAE_LATENTS, f"an SAE array (hidden size {hidden_size} x at most {MAX_SAE_LATENTS} latents)", budget),
    )


def parse_readout(payload: Any, bounds: tuple[wire.Bound, wire.Bound] = (wire.UNBOUNDED, wire.UNBOUNDED)) -> Readout:
    """One readout from its object, wire dict or JSON string (``kind`` picks lens or sae)."""
    if isinstance(payload, (LensReadout, SaeReadout)):
        return payload
    fields = wire.json_object(payload, "readout", {"kind", "name", "layers", "layer", "top_k", "lens", "sae"})
    kind = fields.get("kind")
    model: type[LensReadout] | type[SaeReadout]
    if kind == "lens":
        model, nested, bound = LensReadout, "lens", bounds[0]
    elif kind == "sae":
        model, nested, bound = SaeReadout, "sae", bounds[1]
    else:
        raise ValueError(f"readout kind must be 'lens' or 'sae', got {kind!r}")
    inner = fields.get(nested)
    if inner is not None:
        inner_model = AffineLens if kind == "lens" else SaeEncoder
        try:
            fields = {**fields, nested: inner_model.from_wire(inner, bound)}
        except ValidationError as exc:
            raise ValueError(f"{nested}: {_messages(exc)}") from None
    try:
        return model.model_validate(fields, context={BOUND_CONTEXT: bound})
    except ValidationError as exc:
        raise ValueError(_messages(exc)) from None


def _messages(exc: ValidationError) -> str:
    return "; ".join(f"{'.'.join(str(p) for p in err['loc'])}: {str(err['msg']).removeprefix('Value error, ')}" for err in exc.errors())


def check_readouts(readouts: list[Readout], num_layers: int, hidden_size: int, names_taken: set[str]) -> None:
    """Raise ValueError if a readout does not fit the model (layers, hidden size) or reuses a
    name (of another readout or of a probe: ``names_taken``)."""
    if len(readouts) > MAX_READOUTS_PER_REQUEST:
        raise ValueError(f"{READOUTS_KEY}: too many readouts ({len(readouts)}), at most {MAX_READOUTS_PER_REQUEST}")
    seen = set(names_taken)
    for readout in readouts:
        what = f"readout {readout.name!r}"
        if readout.name in seen:
            raise ValueError(f"{READOUTS_KEY}: {what}: names must be unique across probes and readouts")
        seen.add(readout.name)
        if isinstance(readout, LensReadout):
            layers = readout.layers_for(num_layers)
            lens = readout.lens
            if lens is not None and lens.inline:
                if lens.hidden_size != hidden_size:
                    raise ValueError(f"{what}: affine lens is {lens.hidden_size} wide, the model's hidden size is {hidden_size}")
                missing = sorted(set(layers) - set(lens.layers or []))
                if missing:
                    raise ValueError(f"{what}: the affine lens has no weights for layers {missing}")
        else:
            layers = [readout.layer]
            if readout.sae.inline and readout.sae.hidden_size != hidden_size:
                raise ValueError(f"{what}: W_enc has {readout.sae.hidden_size} rows, the model's hidden size is {hidden_size}")
            if readout.sae.inline and readout.top_k > readout.sae.num_latents:
                raise ValueError(f"{what}: top_k {readout.top_k} is larger than the SAE's {readout.sae.num_latents} latents")
        out_of_range = [layer for layer in layers if layer >= num_layers]
        if out_of_range:
            raise ValueError(f"{what}: layers {out_of_range} out of range: the model has {num_layers} layers (0..{num_layers - 1})")
