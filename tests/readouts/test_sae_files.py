"""SAE-Lens folders: ours written and read back; an SAE-Lens-style folder (hook_name,
activation_fn_kwargs, bfloat16 weights) read; malformed folders refused with clear errors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from lens_evals.readouts.sae_files import SaeFileError, SaeWeights, load_sae, save_sae


def sae(d_in: int = 6, d_sae: int = 10, architecture: str = "topk", seed: int = 0) -> SaeWeights:
    rng = np.random.default_rng(seed)
    f = lambda *shape: rng.normal(size=shape).astype(np.float32)  # noqa: E731
    threshold = np.abs(f(d_sae)) if architecture == "jumprelu" else None
    return SaeWeights(f(d_in, d_sae), f(d_sae), f(d_sae, d_in), f(d_in), architecture, layer=15, k=3, threshold=threshold)


@pytest.mark.parametrize("architecture", ["standard", "topk", "jumprelu"])
def test_round_trip(tmp_path: Path, architecture: str) -> None:
    original = sae(architecture=architecture)
    folder = save_sae(tmp_path / "sae", original, model="smollm2-135m-instruct")
    back = load_sae(folder)
    for name in ("W_enc", "b_enc", "W_dec", "b_dec", "threshold"):
        a, b = getattr(original, name), getattr(back, name)
        assert (a is None and b is None) or np.array_equal(a, b), name
    assert (back.architecture, back.layer, back.k, back.apply_b_dec_to_input) == (architecture, 15, 3, True)
    cfg = json.loads((folder / "cfg.json").read_text())
    assert cfg["hook_name"] == "blocks.15.hook_resid_post" and cfg["d_in"] == 6 and cfg["d_sae"] == 10


def write_folder(folder: Path, cfg: dict[str, Any], tensors: dict[str, torch.Tensor]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "cfg.json").write_text(json.dumps(cfg))
    save_file(tensors, str(folder / "sae_weights.safetensors"))
    return folder


def sae_lens_tensors(d_in: int = 4, d_sae: int = 8, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "W_enc": torch.randn(d_in, d_sae, generator=g).to(dtype),
        "b_enc": torch.randn(d_sae, generator=g).to(dtype),
        "W_dec": torch.randn(d_sae, d_in, generator=g).to(dtype),
        "b_dec": torch.randn(d_in, generator=g).to(dtype),
    }


def test_an_sae_lens_style_folder_is_read(tmp_path: Path) -> None:
    """As older SAE-Lens writes it: the layer in hook_name, k in activation_fn_kwargs, bf16 weights."""
    tensors = sae_lens_tensors()
    cfg = {
        "d_in": 4,
        "d_sae": 8,
        "architecture": "topk",
        "hook_name": "blocks.7.hook_resid_post",
        "activation_fn_kwargs": {"k": 2},
        "apply_b_dec_to_input": False,
    }
    back = load_sae(write_folder(tmp_path / "s", cfg, tensors))
    assert (back.layer, back.k, back.apply_b_dec_to_input, back.activation) == (7, 2, False, "topk")
    assert back.W_enc.dtype == np.float32
    np.testing.assert_array_equal(back.W_enc, tensors["W_enc"].float().numpy())


BASE = {"d_in": 4, "d_sae": 8, "architecture": "standard", "hook_layer": 3}


@pytest.mark.parametrize(
    ("cfg", "change", "message"),
    [
        ({**BASE, "d_sae": 9}, None, "W_enc has shape [4, 8], cfg.json says d_in=4, d_sae=9"),
        ({**BASE, "architecture": "gated"}, None, "architecture must be one of standard, topk, jumprelu"),
        ({**BASE, "architecture": "topk"}, None, "bad: k is required for (and only for) topk SAEs"),
        ({**BASE, "architecture": "topk", "k": 9}, None, "bad: k 9 is larger than the SAE's 8 latents"),
        ({**BASE, "architecture": "jumprelu"}, None, "bad: a jumprelu SAE needs threshold (8,)"),
        ({**{k: v for k, v in BASE.items() if k != "hook_layer"}, "hook_name": "resid"}, None, "needs hook_layer"),
        ({**BASE, "d_in": "4"}, None, "d_in must be a positive integer"),
        (BASE, lambda t: t.pop("b_dec"), "missing tensors ['b_dec']"),
        (BASE, lambda t: t.update(W_dec=t["W_dec"][:, :3].contiguous()), "W_dec has shape [8, 3], expected [8, 4]"),
        (BASE, lambda t: t.update(b_enc=torch.zeros(8, dtype=torch.int32)), "b_enc has dtype torch.int32"),
        ({**BASE, "architecture": "jumprelu"}, lambda t: t.update(threshold=torch.zeros(7)), "bad: a jumprelu SAE needs threshold (8,)"),
        (BASE, lambda t: t.update(threshold=torch.zeros(8)), "bad: threshold is for jumprelu SAEs only"),
        (BASE, lambda t: t.update(b_enc=t["b_enc"][:7].contiguous()), "bad: b_enc must be (8,), got [7]"),
        (BASE, lambda t: t.update(b_dec=torch.zeros(5)), "bad: b_dec must be (4,), got [5]"),
        (BASE, lambda t: t["b_enc"].__setitem__(2, float("nan")), "bad: b_enc: b_enc contains NaN or inf"),
        (BASE, lambda t: t["W_dec"].__setitem__((0, 1), float("inf")), "bad: W_dec holds NaN or infinite values"),
    ],
)
def test_bad_folders_are_refused(tmp_path: Path, cfg: dict[str, Any], change: Any, message: str) -> None:
    """The file's own rules (cfg, names, dtypes, the decoder) and the encoder's (shapes, values,
    k, threshold: the request object's validators, one set of rules) each name the folder."""
    tensors = sae_lens_tensors(dtype=torch.float32)
    if change is not None:
        change(tensors)
    folder = write_folder(tmp_path / "bad", cfg, tensors)
    with pytest.raises(SaeFileError) as caught:
        load_sae(folder)
    assert message in str(caught.value), str(caught.value)


def test_missing_and_unreadable_files(tmp_path: Path) -> None:
    with pytest.raises(SaeFileError, match="no cfg.json"):
        load_sae(tmp_path)
    folder = write_folder(tmp_path / "s", BASE, sae_lens_tensors(dtype=torch.float32))
    (folder / "cfg.json").write_text("{not json")
    with pytest.raises(SaeFileError, match="cfg.json: not valid JSON"):
        load_sae(folder)
    (folder / "cfg.json").write_text(json.dumps(BASE))
    (folder / "sae_weights.safetensors").write_bytes(b"\x80\x04not safetensors")
    with pytest.raises(SaeFileError, match="not a readable safetensors file"):
        load_sae(folder)


def test_saving_refuses_arrays_not_held_as_float32(tmp_path: Path) -> None:
    bad = sae()
    bad.W_enc = bad.W_enc.astype(np.float64)
    with pytest.raises(SaeFileError, match="W_enc must be held as float32, got float64"):
        save_sae(tmp_path / "sae", bad, model="tiny")
    assert not (tmp_path / "sae").exists()
