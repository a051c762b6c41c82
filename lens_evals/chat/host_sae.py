"""An SAE-Lens-layout sparse autoencoder (``cfg.json`` + ``sae_weights.safetensors``) encoded on
the host from a captured layer: the chat page's SAE view until the worker computes SAE readouts
(#42; then ``token_details`` asks the worker instead and this module goes)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ACTIVATIONS = {"standard": "relu", "relu": "relu", "topk": "topk", "jumprelu": "jumprelu"}


@dataclass(frozen=True)
class HostSae:
    name: str
    layer: int
    activation: str
    w_enc: np.ndarray  # (d_in, d_sae)
    b_enc: np.ndarray  # (d_sae,)
    b_dec: np.ndarray | None  # subtracted from the input first, when the SAE says so
    threshold: np.ndarray | None
    k: int | None

    def encode(self, stream: np.ndarray) -> np.ndarray:
        """Latent activations of ``stream`` (n, d_in): (n, d_sae), float32."""
        x = np.asarray(stream, dtype=np.float32)
        pre = (x - self.b_dec if self.b_dec is not None else x) @ self.w_enc + self.b_enc
        if self.activation == "jumprelu":
            assert self.threshold is not None
            jumped: np.ndarray = np.where(pre > self.threshold, pre, 0.0).astype(np.float32)
            return jumped
        if self.activation == "topk":
            assert self.k is not None
            kept = np.zeros_like(pre)
            top = np.argpartition(-pre, self.k - 1, axis=-1)[:, : self.k]
            np.put_along_axis(kept, top, np.take_along_axis(pre, top, axis=-1), axis=-1)
            pre = kept
        latents: np.ndarray = np.maximum(pre, 0.0).astype(np.float32)
        return latents


def load_host_sae(folder: str | Path) -> HostSae:
    """Read an SAE-Lens folder; a ValueError says what is missing or inconsistent."""
    from safetensors.numpy import load_file

    folder = Path(folder)
    cfg_path, weights_path = folder / "cfg.json", folder / "sae_weights.safetensors"
    for needed in (cfg_path, weights_path):
        if not needed.is_file():
            raise ValueError(f"{folder} is not an SAE-Lens folder: {needed.name} is missing")
    cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    tensors = load_file(str(weights_path))
    architecture = str(cfg.get("architecture", "standard"))
    if architecture not in ACTIVATIONS:
        raise ValueError(f"{cfg_path}: architecture {architecture!r} is not one of {sorted(ACTIVATIONS)}")
    layer = cfg.get("hook_layer")
    if layer is None:  # SAE-Lens names the hook "blocks.L.hook_resid_post"
        parts = str(cfg.get("hook_name", "")).split(".")
        layer = int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else None
    if layer is None:
        raise ValueError(f"{cfg_path}: neither hook_layer nor a hook_name 'blocks.L.<...>' says the layer")
    w_enc = tensors["W_enc"].astype(np.float32)
    d_in, d_sae = int(cfg.get("d_in", w_enc.shape[0])), int(cfg.get("d_sae", w_enc.shape[1]))
    if w_enc.shape != (d_in, d_sae) or tensors["b_enc"].shape != (d_sae,):
        raise ValueError(f"{weights_path}: W_enc {w_enc.shape} / b_enc {tensors['b_enc'].shape} do not fit d_in {d_in}, d_sae {d_sae}")
    activation = ACTIVATIONS[architecture]
    if activation == "jumprelu" and "threshold" not in tensors:
        raise ValueError(f"{weights_path}: a jumprelu SAE needs a 'threshold' tensor")
    if activation == "topk" and not 0 < int(cfg.get("k", 0)) <= d_sae:
        raise ValueError(f"{cfg_path}: a topk SAE needs k in 1..{d_sae}")
    b_dec = tensors["b_dec"].astype(np.float32) if cfg.get("apply_b_dec_to_input") and "b_dec" in tensors else None
    threshold = tensors["threshold"].astype(np.float32) if activation == "jumprelu" else None
    return HostSae(
        name=folder.name,
        layer=int(layer),
        activation=activation,
        w_enc=w_enc,
        b_enc=tensors["b_enc"].astype(np.float32),
        b_dec=b_dec,
        threshold=threshold,
        k=int(cfg["k"]) if activation == "topk" else None,
    )
