"""The chat page's host-side SAE encoder against a torch computation of the contract's formula
(relu / jumprelu / topk, b_dec subtracted when asked), and its refusals of bad folders."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.numpy import save_file

from lens_evals.chat.host_sae import load_host_sae

D, N = 16, 32


def sae_folder(directory: Path, cfg: dict[str, object], drop: str | None = None) -> Path:
    rng = np.random.default_rng(0)
    tensors = {
        "W_enc": rng.normal(size=(D, N)).astype(np.float32),
        "b_enc": rng.normal(size=N).astype(np.float32),
        "W_dec": rng.normal(size=(N, D)).astype(np.float32),
        "b_dec": rng.normal(size=D).astype(np.float32),
        "threshold": np.abs(rng.normal(size=N)).astype(np.float32),
    }
    tensors.pop(drop or "", None)
    directory.mkdir()
    save_file(tensors, str(directory / "sae_weights.safetensors"))
    (directory / "cfg.json").write_text(json.dumps({"d_in": D, "d_sae": N, "hook_layer": 2, **cfg}))
    return directory


def reference(folder: Path, x: np.ndarray, architecture: str, b_dec: bool, k: int = 0) -> np.ndarray:
    from safetensors.torch import load_file

    t = {name: value.double() for name, value in load_file(str(folder / "sae_weights.safetensors")).items()}
    h = torch.from_numpy(x).double()
    pre = (h - t["b_dec"] if b_dec else h) @ t["W_enc"] + t["b_enc"]
    if architecture == "jumprelu":
        return (pre * (pre > t["threshold"])).numpy()
    if architecture == "topk":
        top = pre.topk(k, dim=-1)
        pre = torch.zeros_like(pre).scatter(-1, top.indices, top.values)
    return pre.clamp(min=0).numpy()


@pytest.mark.parametrize(("architecture", "b_dec"), [("standard", False), ("jumprelu", True), ("topk", True)])
def test_encode_equals_the_formula(tmp_path, architecture, b_dec) -> None:
    folder = sae_folder(tmp_path / "sae", {"architecture": architecture, "apply_b_dec_to_input": b_dec, "k": 5})
    x = np.random.default_rng(1).normal(size=(7, D)).astype(np.float32)
    got = load_host_sae(folder).encode(x)
    want = reference(folder, x, architecture, b_dec, k=5)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert (got > 0).sum() > 0 and (architecture != "topk" or ((got > 0).sum(-1) <= 5).all())


def test_the_layer_comes_from_the_hook_name(tmp_path) -> None:
    folder = sae_folder(tmp_path / "sae", {"hook_layer": None, "hook_name": "blocks.6.hook_resid_post"})
    assert load_host_sae(folder).layer == 6


@pytest.mark.parametrize(
    ("cfg", "drop", "complaint"),
    [
        ({"architecture": "gated"}, None, "architecture 'gated'"),
        ({"architecture": "jumprelu"}, "threshold", "needs a 'threshold'"),
        ({"architecture": "topk", "k": 0}, None, "needs k in 1..32"),
        ({"d_in": D + 1}, None, "do not fit d_in 17"),
        ({"hook_layer": None, "hook_name": "resid"}, None, "says the layer"),
    ],
)
def test_bad_folders_are_refused_with_the_reason(tmp_path, cfg, drop, complaint) -> None:
    with pytest.raises(ValueError, match=complaint):
        load_host_sae(sae_folder(tmp_path / "sae", cfg, drop))
    with pytest.raises(ValueError, match="cfg.json is missing"):
        load_host_sae(tmp_path)
