"""Affine-lens files (docs/readouts.md, "Files"): one safetensors file holding, per layer i, a
translator ``T_i(h) = h @ weight.<i>.T + bias.<i>`` (float32 ``[d, d]`` and ``[d]``) and string
metadata ``format=lens-evals-affine-lens``, ``kind`` (``tuned`` | ``jacobian``), ``model``,
``hidden_size``, ``num_layers``. Read with the safetensors library only (nothing unpickled);
every shape, dtype and metadata field is checked, a bad file refused with a :class:`LensFileError`
that names the file and the problem."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

FORMAT = "lens-evals-affine-lens"
KINDS = ("tuned", "jacobian")
_NAME = re.compile(r"^(weight|bias)\.(0|[1-9][0-9]*)$")


class LensFileError(ValueError):
    """An affine-lens file that cannot be used; the message names the file and the problem."""


@dataclass
class AffineLensWeights:
    """Per-layer translators: ``weights[i]`` float32 ``[d, d]``, ``biases[i]`` float32 ``[d]``."""

    kind: str
    weights: dict[int, np.ndarray]
    biases: dict[int, np.ndarray]
    meta: dict[str, str] = field(default_factory=dict)

    @property
    def layers(self) -> list[int]:
        return sorted(self.weights)

    @property
    def hidden_size(self) -> int:
        return int(next(iter(self.weights.values())).shape[0])

    def apply(self, layer: int, stream: np.ndarray) -> np.ndarray:
        """``T_layer(stream)`` for ``stream`` ``[..., d]`` (float32)."""
        moved = np.asarray(stream, dtype=np.float32) @ self.weights[layer].T + self.biases[layer]
        return np.asarray(moved, dtype=np.float32)


def check_lens(lens: AffineLensWeights, where: str = "affine lens") -> None:
    """Raise :class:`LensFileError` unless ``lens`` is well formed (what the loader and the writer
    both hold a lens to)."""
    if lens.kind not in KINDS:
        raise LensFileError(f"{where}: kind must be one of {', '.join(KINDS)}, got {lens.kind!r}")
    if not lens.weights:
        raise LensFileError(f"{where}: holds no layer")
    if set(lens.weights) != set(lens.biases):
        raise LensFileError(f"{where}: layers with a weight {sorted(lens.weights)} differ from layers with a bias {sorted(lens.biases)}")
    d = None
    for layer in sorted(lens.weights):
        weight, bias = lens.weights[layer], lens.biases[layer]
        if layer < 0:
            raise LensFileError(f"{where}: layer {layer} is negative")
        for name, array in ((f"weight.{layer}", weight), (f"bias.{layer}", bias)):
            if not isinstance(array, np.ndarray) or array.dtype != np.float32:
                raise LensFileError(f"{where}: {name} must be float32, got {getattr(array, 'dtype', type(array).__name__)}")
            if not np.isfinite(array).all():
                raise LensFileError(f"{where}: {name} holds NaN or infinite values")
        d = weight.shape[0] if d is None else d
        if weight.shape != (d, d):
            raise LensFileError(f"{where}: weight.{layer} has shape {list(weight.shape)}, expected [{d}, {d}]")
        if bias.shape != (d,):
            raise LensFileError(f"{where}: bias.{layer} has shape {list(bias.shape)}, expected [{d}]")
    _check_meta(lens, where)


def _check_meta(lens: AffineLensWeights, where: str) -> None:
    meta = lens.meta
    for key in ("hidden_size", "num_layers"):
        if key in meta and not str(meta[key]).isdigit():
            raise LensFileError(f"{where}: metadata {key}={meta[key]!r} is not a non-negative integer")
    if "hidden_size" in meta and int(meta["hidden_size"]) != lens.hidden_size:
        raise LensFileError(
            f"{where}: metadata hidden_size={meta['hidden_size']} but the weights are [{lens.hidden_size}, {lens.hidden_size}]"
        )
    if "num_layers" in meta and max(lens.layers) >= int(meta["num_layers"]):
        raise LensFileError(f"{where}: layer {max(lens.layers)} is not below metadata num_layers={meta['num_layers']}")


def save_affine_lens(path: str | Path, lens: AffineLensWeights, model: str, num_layers: int) -> Path:
    """Write ``lens`` to ``path`` (a ``.safetensors`` file) with the contract's metadata."""
    path = Path(path)
    meta = {
        **lens.meta,
        "format": FORMAT,
        "kind": lens.kind,
        "model": model,
        "hidden_size": str(lens.hidden_size),
        "num_layers": str(num_layers),
    }
    lens = AffineLensWeights(lens.kind, lens.weights, lens.biases, meta)
    check_lens(lens, str(path))
    tensors: dict[str, np.ndarray] = {}
    for layer in lens.layers:
        tensors[f"weight.{layer}"] = np.ascontiguousarray(lens.weights[layer])
        tensors[f"bias.{layer}"] = np.ascontiguousarray(lens.biases[layer])
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path), metadata=meta)
    return path


def load_affine_lens(path: str | Path) -> AffineLensWeights:
    """The lens in ``path``, checked (:func:`check_lens`, the metadata's format and kind)."""
    path = Path(path)
    if not path.is_file():
        raise LensFileError(f"affine lens file {path} does not exist")
    try:
        with safe_open(str(path), framework="numpy") as handle:
            meta = dict(handle.metadata() or {})
            names = list(handle.keys())
            arrays = {name: handle.get_tensor(name) for name in names}
    except (SafetensorError, OSError) as exc:
        raise LensFileError(f"{path}: not a readable safetensors file ({exc})") from None
    if meta.get("format") != FORMAT:
        raise LensFileError(f"{path}: metadata format is {meta.get('format')!r}, expected {FORMAT!r}")
    weights: dict[int, np.ndarray] = {}
    biases: dict[int, np.ndarray] = {}
    for name, array in arrays.items():
        match = _NAME.match(name)
        if match is None:
            raise LensFileError(f"{path}: unexpected tensor {name!r} (expected weight.<layer> and bias.<layer>)")
        (weights if match.group(1) == "weight" else biases)[int(match.group(2))] = array
    lens = AffineLensWeights(meta.get("kind", ""), weights, biases, meta)
    check_lens(lens, str(path))
    return lens


def identity_lens(kind: str, layers: list[int], hidden_size: int) -> AffineLensWeights:
    """``T_i(h) = h`` on every layer (the logit lens written as an affine lens)."""
    eye = np.eye(hidden_size, dtype=np.float32)
    zero = np.zeros(hidden_size, dtype=np.float32)
    return AffineLensWeights(kind, {i: eye.copy() for i in layers}, {i: zero.copy() for i in layers})
