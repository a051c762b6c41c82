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
from typing import Annotated, Any, ClassVar, Literal

import numpy as np
from pydantic import AfterValidator, BeforeValidator, Field, ValidationError, ValidationInfo, field_validator, model_validator

from lens_evals.request.spec import MAX_LAYERS_PER_REQUEST, READOUTS_KEY
from lens_evals.request.wire_model import BOUND_CONTEXT, WireModel, owned_float32_array
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


FiniteArray = Annotated[Any, BeforeValidator(_array)]  # an owned float32 array without NaN or inf, or None


class _Weights(WireModel):
    """Weights sent inline or named by ``digest`` alone (sent by an earlier request): the checks
    both kinds share. A subclass names its arrays (the weights are inline when the first is
    given) and its messages, and checks inline shapes (``_check_inline``), hashes
    (``_compute_digest``) and encodes (``_inline_wire``) its own fields."""

    arrays: ClassVar[tuple[str, ...]]
    label: ClassVar[str]  # "affine lens" | "SAE": the digest mismatch message
    needs: ClassVar[str]  # the message when neither weights nor a digest are given
    refused_by_digest: ClassVar[tuple[str, ...]]  # fields refused beside a digest alone ...
    refused_message: ClassVar[str]  # ... and the message

    digest: str | None = None

    @property
    def inline(self) -> bool:
        return getattr(self, self.arrays[0]) is not None

    @model_validator(mode="after")
    def _check(self) -> _Weights:
        if not self.inline:
            if self.digest is None:
                raise ValueError(self.needs)
            if any(getattr(self, name) is not None for name in self.refused_by_digest):
                raise ValueError(self.refused_message)
            return self
        self._check_inline()
        if self.digest is not None and self.digest != self.content_digest():
            raise ValueError(f"{self.label} digest does not match its weights")
        return self

    def _check_inline(self) -> None:
        raise NotImplementedError

    def _compute_digest(self) -> str:
        raise NotImplementedError

    def content_digest(self) -> str:
        """What names these weights (the digest given when they are not inline)."""
        if not self.inline:
            assert self.digest is not None
            return self.digest
        return self._compute_digest()

    def nbytes(self) -> int:
        return sum(int(a.nbytes) for name in self.arrays if (a := getattr(self, name)) is not None)

    def _inline_wire(self) -> dict[str, Any]:
        raise NotImplementedError

    def to_wire(self) -> dict[str, Any]:
        if not self.inline:
            return {"digest": self.content_digest()}
        return self._inline_wire() | {"digest": self.content_digest()}


class AffineLens(_Weights):
    """Per layer ``T_i(h) = h @ weights[i].T + biases[i]`` before the final norm and unembedding
    (a tuned lens stores ``I + A_i``, a Jacobian lens ``J_i``). ``weights`` (n, d, d) and
    ``biases`` (n, d) are given for ``layers`` (n entries), or the lens is named by ``digest``
    alone (weights sent by an earlier request)."""

    wire_name: ClassVar[str] = "affine lens"
    arrays: ClassVar[tuple[str, ...]] = ("weights", "biases")
    label: ClassVar[str] = "affine lens"
    needs: ClassVar[str] = "an affine lens needs weights (with layers) or the digest of weights sent before"
    refused_by_digest: ClassVar[tuple[str, ...]] = ("biases", "layers")
    refused_message: ClassVar[str] = "an affine lens given by digest takes no layers or biases"

    layers: list[int] | None = None
    weights: FiniteArray = None
    biases: FiniteArray = None

    def _check_inline(self) -> None:
        w = self.weights
        if self.layers is None or not self.layers:
            raise ValueError("an affine lens with weights needs its layers")
        if len(set(self.layers)) != len(self.layers) or min(self.layers) < 0:
            raise ValueError(f"affine lens layers must be distinct and >= 0, got {self.layers}")
        if w.ndim != 3 or w.shape[0] != len(self.layers) or w.shape[1] != w.shape[2] or w.shape[1] == 0:
            raise ValueError(f"affine lens weights must be (n_layers={len(self.layers)}, d, d), got shape {list(w.shape)}")
        if self.biases is not None and self.biases.shape != w.shape[:2]:
            raise ValueError(f"affine lens biases must be (n_layers, d) = {list(w.shape[:2])}, got {list(self.biases.shape)}")

    @property
    def hidden_size(self) -> int:
        return int(self.weights.shape[1])

    def _compute_digest(self) -> str:
        biases = self.biases if self.biases is not None else np.zeros(self.weights.shape[:2], dtype=np.float32)
        return _digest("affine", self.layers, self.weights, biases)

    def _inline_wire(self) -> dict[str, Any]:
        biases = None if self.biases is None else wire.encode_array(self.biases)
        return {"layers": self.layers, "weights": wire.encode_array(self.weights), "biases": biases}


class SaeEncoder(_Weights):
    """A sparse autoencoder's encoder (SAE-Lens layout): ``latents = act((h - b_dec) @ W_enc +
    b_enc)`` (``b_dec`` subtracted only with ``apply_b_dec_to_input``); relu: max(0, .);
    jumprelu: pre * (pre > threshold); topk: the ``k`` largest kept (others 0), then relu."""

    wire_name: ClassVar[str] = "sae encoder"
    arrays: ClassVar[tuple[str, ...]] = ("W_enc", "b_enc", "b_dec", "threshold")
    label: ClassVar[str] = "SAE"
    needs: ClassVar[str] = "an SAE encoder needs W_enc and b_enc, or the digest of an encoder sent before"
    refused_by_digest: ClassVar[tuple[str, ...]] = ("b_enc", "b_dec", "threshold")
    refused_message: ClassVar[str] = "an SAE encoder given by digest takes no arrays"

    W_enc: FiniteArray = None
    b_enc: FiniteArray = None
    b_dec: FiniteArray = None
    threshold: FiniteArray = None
    activation: Literal["relu", "topk", "jumprelu"] = "relu"
    k: int | None = Field(default=None, ge=1, le=MAX_SAE_LATENTS, strict=True)
    apply_b_dec_to_input: bool = False

    def _check_inline(self) -> None:
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

    @property
    def hidden_size(self) -> int:
        return int(self.W_enc.shape[0])

    @property
    def num_latents(self) -> int:
        return int(self.W_enc.shape[1])

    def _compute_digest(self) -> str:
        b_dec = self.b_dec if self.apply_b_dec_to_input else None
        return _digest("sae", self.activation, self.k, self.W_enc, self.b_enc, b_dec, self.threshold)

    def _inline_wire(self) -> dict[str, Any]:
        enc = {name: None if (a := getattr(self, name)) is None else wire.encode_array(a) for name in self.arrays}
        return enc | {"activation": self.activation, "k": self.k, "apply_b_dec_to_input": self.apply_b_dec_to_input}


def _readout_name(value: str) -> str:
    if not value.strip():
        raise ValueError("readout name must not be empty")
    return value


ReadoutName = Annotated[str, AfterValidator(_readout_name)]


class LensReadout(WireModel):
    """The top ``top_k`` tokens and their log-probs per (layer, position):
    ``log_softmax(unembed(final_norm(T_i(h_i))))`` with the model's own final norm and
    unembedding (``lens`` None: the logit lens, ``T_i(h) = h``)."""

    wire_name: ClassVar[str] = "lens readout"

    kind: Literal["lens"] = "lens"
    name: ReadoutName
    layers: list[int] | Literal["all"]
    top_k: int = Field(default=10, ge=1, le=MAX_LENS_TOP_K, strict=True)
    lens: AffineLens | None = None

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


class SaeReadout(WireModel):
    """The top ``top_k`` latents (ids and activations) of an SAE encoder on layer ``layer``'s
    stream, per position; ids of latents that are 0 are reported as -1."""

    wire_name: ClassVar[str] = "sae readout"

    kind: Literal["sae"] = "sae"
    name: ReadoutName
    layer: int = Field(ge=0, strict=True)
    top_k: int = Field(default=16, ge=1, le=MAX_SAE_TOP_K, strict=True)
    sae: SaeEncoder

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
            raise ValueError(f"{nested}: {validation_messages(exc)}") from None
    try:
        return model.model_validate(fields, context={BOUND_CONTEXT: bound})
    except ValidationError as exc:
        raise ValueError(validation_messages(exc)) from None


def validation_messages(exc: ValidationError) -> str:
    """Pydantic's errors as ``field: reason; ...`` (a whole-object check's reason alone)."""
    parts = []
    for err in exc.errors():
        where, reason = ".".join(str(p) for p in err["loc"]), str(err["msg"]).removeprefix("Value error, ")
        parts.append(f"{where}: {reason}" if where else reason)
    return "; ".join(parts)


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
