"""Sparse-autoencoder folders in SAE-Lens's layout (docs/readouts.md, "Files"): ``cfg.json``
(``d_in``, ``d_sae``, ``architecture`` standard | topk | jumprelu, ``k`` for topk — at the top or
in ``activation_fn_kwargs`` as older SAE-Lens writes it —, ``hook_layer`` or a ``hook_name`` such
as ``blocks.15.hook_resid_post``, ``apply_b_dec_to_input``) and ``sae_weights.safetensors``
(``W_enc [d_in, d_sae]``, ``b_enc [d_sae]``, ``W_dec [d_sae, d_in]``, ``b_dec [d_in]``, optional
``threshold [d_sae]``; float32, float16 or bfloat16, held as float32). Read with the safetensors
library only (nothing unpickled); a bad folder is refused with a :class:`SaeFileError`."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from pydantic import ValidationError
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from lens_evals.request.readouts import SaeEncoder, validation_messages

CFG_NAME = "cfg.json"
WEIGHTS_NAME = "sae_weights.safetensors"
# SAE-Lens's architecture names -> the readout contract's encoder activation
ACTIVATIONS: dict[str, Literal["relu", "topk", "jumprelu"]] = {"standard": "relu", "topk": "topk", "jumprelu": "jumprelu"}
ARCHITECTURES = tuple(ACTIVATIONS)
_HOOK_LAYER = re.compile(r"(?:^|\.)(?:blocks|layers)\.(\d+)\.")
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class SaeFileError(ValueError):
    """An SAE folder that cannot be used; the message names the file and the problem."""


@dataclass
class SaeWeights:
    """An SAE's encoder (and decoder) as float32 arrays; ``architecture`` in :data:`ARCHITECTURES`."""

    W_enc: np.ndarray  # [d_in, d_sae]
    b_enc: np.ndarray  # [d_sae]
    W_dec: np.ndarray  # [d_sae, d_in]
    b_dec: np.ndarray  # [d_in]
    architecture: str
    layer: int
    apply_b_dec_to_input: bool = True
    k: int | None = None
    threshold: np.ndarray | None = None
    cfg: dict[str, Any] = field(default_factory=dict)

    @property
    def d_in(self) -> int:
        return int(self.W_enc.shape[0])

    @property
    def d_sae(self) -> int:
        return int(self.W_enc.shape[1])

    @property
    def activation(self) -> Literal["relu", "topk", "jumprelu"]:
        """The readout contract's name for the encoder's activation: relu | topk | jumprelu."""
        return ACTIVATIONS[self.architecture]

    def encoder(self) -> SaeEncoder:
        """The encoder as the worker's request object, which checks its shapes, values, k and
        threshold (pydantic's ``ValidationError`` when malformed; :func:`check_sae` names the
        file). ``k`` is kept for topk SAEs only, as SAE-Lens files may carry it for others."""
        return SaeEncoder(
            W_enc=self.W_enc,
            b_enc=self.b_enc,
            b_dec=self.b_dec,
            threshold=self.threshold,
            activation=self.activation,
            k=self.k if self.architecture == "topk" else None,
            apply_b_dec_to_input=self.apply_b_dec_to_input,
        )


def check_sae(sae: SaeWeights, where: str = "SAE") -> None:
    """Raise :class:`SaeFileError` unless ``sae`` is well formed: the file's own rules here
    (architecture name, arrays held as float32, the decoder, the layer), the encoder's through
    :class:`SaeEncoder` (shapes, finite values, k, threshold)."""
    if sae.architecture not in ARCHITECTURES:
        raise SaeFileError(f"{where}: architecture must be one of {', '.join(ARCHITECTURES)}, got {sae.architecture!r}")
    named = {"W_enc": sae.W_enc, "b_enc": sae.b_enc, "W_dec": sae.W_dec, "b_dec": sae.b_dec, "threshold": sae.threshold}
    for name, array in named.items():
        if array is not None and array.dtype != np.float32:
            raise SaeFileError(f"{where}: {name} must be held as float32, got {array.dtype}")
    try:
        sae.encoder()
    except ValidationError as exc:
        raise SaeFileError(f"{where}: {validation_messages(exc)}") from None
    d_in, d_sae = sae.W_enc.shape
    if sae.W_dec.shape != (d_sae, d_in):
        raise SaeFileError(f"{where}: W_dec has shape {list(sae.W_dec.shape)}, expected {[d_sae, d_in]} (W_enc is [{d_in}, {d_sae}])")
    if not np.isfinite(sae.W_dec).all():
        raise SaeFileError(f"{where}: W_dec holds NaN or infinite values")
    if sae.layer < 0:
        raise SaeFileError(f"{where}: layer {sae.layer} is negative")


def _cfg_int(cfg: dict[str, Any], key: str, where: str) -> int:
    value = cfg.get(key)
    if type(value) is not int or value < 1:
        raise SaeFileError(f"{where}: {key} must be a positive integer, got {value!r}")
    return value


def _layer(cfg: dict[str, Any], where: str) -> int:
    if type(cfg.get("hook_layer")) is int:
        return int(cfg["hook_layer"])
    match = _HOOK_LAYER.search(str(cfg.get("hook_name", "")))
    if match is None:
        raise SaeFileError(
            f"{where}: needs hook_layer (an integer) or a hook_name naming the layer (blocks.<i>.…), got {cfg.get('hook_name')!r}"
        )
    return int(match.group(1))


def _k(cfg: dict[str, Any]) -> int | None:
    k = cfg.get("k", (cfg.get("activation_fn_kwargs") or {}).get("k"))
    return k if type(k) is int else None


def load_sae(path: str | Path) -> SaeWeights:
    """The SAE in folder ``path`` (SAE-Lens layout), checked (:func:`check_sae`, cfg against weights)."""
    folder = Path(path)
    cfg_path, weights_path = folder / CFG_NAME, folder / WEIGHTS_NAME
    for file in (cfg_path, weights_path):
        if not file.is_file():
            raise SaeFileError(f"{folder}: no {file.name} (an SAE folder holds {CFG_NAME} and {WEIGHTS_NAME})")
    try:
        cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise SaeFileError(f"{cfg_path}: not valid JSON ({exc})") from None
    if not isinstance(cfg, dict):
        raise SaeFileError(f"{cfg_path}: expected a JSON object")
    d_in, d_sae = _cfg_int(cfg, "d_in", str(cfg_path)), _cfg_int(cfg, "d_sae", str(cfg_path))
    try:
        with safe_open(str(weights_path), framework="pt") as handle:
            tensors = {name: handle.get_tensor(name) for name in handle.keys()}
    except (SafetensorError, OSError) as exc:
        raise SaeFileError(f"{weights_path}: not a readable safetensors file ({exc})") from None
    missing = [name for name in ("W_enc", "b_enc", "W_dec", "b_dec") if name not in tensors]
    if missing:
        raise SaeFileError(f"{weights_path}: missing tensors {missing}")
    arrays: dict[str, np.ndarray] = {}
    for name, tensor in tensors.items():
        if name not in ("W_enc", "b_enc", "W_dec", "b_dec", "threshold"):
            continue
        if tensor.dtype not in _DTYPES:
            raise SaeFileError(f"{weights_path}: {name} has dtype {tensor.dtype}, expected float32, float16 or bfloat16")
        arrays[name] = tensor.float().numpy()
    if arrays["W_enc"].shape != (d_in, d_sae):
        raise SaeFileError(f"{weights_path}: W_enc has shape {list(arrays['W_enc'].shape)}, cfg.json says d_in={d_in}, d_sae={d_sae}")
    sae = SaeWeights(
        arrays["W_enc"],
        arrays["b_enc"],
        arrays["W_dec"],
        arrays["b_dec"],
        architecture=str(cfg.get("architecture", "standard")),
        layer=_layer(cfg, str(cfg_path)),
        apply_b_dec_to_input=bool(cfg.get("apply_b_dec_to_input", True)),
        k=_k(cfg),
        threshold=arrays.get("threshold"),
        cfg=cfg,
    )
    check_sae(sae, str(folder))
    return sae


def save_sae(path: str | Path, sae: SaeWeights, model: str, extra_cfg: dict[str, Any] | None = None) -> Path:
    """Write ``sae`` as an SAE-Lens folder at ``path`` (created); returns the folder."""
    folder = Path(path)
    check_sae(sae, str(folder))
    cfg: dict[str, Any] = {
        **(extra_cfg or {}),
        "d_in": sae.d_in,
        "d_sae": sae.d_sae,
        "architecture": sae.architecture,
        "hook_layer": sae.layer,
        "hook_name": f"blocks.{sae.layer}.hook_resid_post",
        "apply_b_dec_to_input": sae.apply_b_dec_to_input,
        "model_name": model,
        "dtype": "float32",
    }
    if sae.k is not None:
        cfg["k"] = sae.k
    tensors = {name: torch.from_numpy(np.ascontiguousarray(getattr(sae, name))) for name in ("W_enc", "b_enc", "W_dec", "b_dec")}
    if sae.threshold is not None:
        tensors["threshold"] = torch.from_numpy(np.ascontiguousarray(sae.threshold))
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / WEIGHTS_NAME))
    (folder / CFG_NAME).write_text(json.dumps(cfg, indent=2) + "\n", encoding="utf-8")
    return folder
