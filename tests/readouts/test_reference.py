"""The client-side reference math: the logit lens at the last layer is the model's own next-token
distribution (HF transformers' logits); an affine lens applies ``h @ W.T + b`` first; SAE encoders
against hand-computed latents."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lens_evals.readouts.hf_parts import capture_streams, model_parts
from lens_evals.readouts.lens_files import AffineLensWeights
from lens_evals.readouts.reference import lens_topk, sae_topk
from lens_evals.readouts.sae_files import SaeWeights
from tests.arch_zoo import build

IDS = [1, 40, 41, 42, 43, 44, 45, 46]


@pytest.fixture(scope="module")
def llama():
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(build("LlamaForCausalLM")), dtype=torch.float32).eval()
    return model_parts(model)


def test_logit_lens_at_the_last_layer_is_the_models_output(llama) -> None:
    last = llama.num_layers - 1
    streams = capture_streams(llama, [IDS], [0, last])
    out = lens_topk(streams, llama.final_norm, llama.model.lm_head.weight.detach(), None, top_k=5)
    with torch.no_grad():
        expected = torch.log_softmax(llama.model(torch.tensor([IDS])).logits[0].float(), -1).topk(5, dim=-1)
    assert out["layers"] == [0, last]
    assert out["token_ids"].dtype == np.int32 and out["logprobs"].dtype == np.float32
    assert out["token_ids"].shape == (2, len(IDS), 5)
    np.testing.assert_array_equal(out["token_ids"][1], expected.indices.numpy())
    np.testing.assert_allclose(out["logprobs"][1], expected.values.numpy(), atol=1e-5)
    assert not np.array_equal(out["token_ids"][0], out["token_ids"][1])  # layer 0 reads differently


def test_affine_lens_translates_first(llama) -> None:
    d = llama.hidden_size
    rng = np.random.default_rng(0)
    w, b = (np.eye(d) + 0.1 * rng.normal(size=(d, d))).astype(np.float32), rng.normal(size=d).astype(np.float32)
    lens = AffineLensWeights("tuned", {0: w}, {0: b})
    stream = capture_streams(llama, [IDS], [0])[0]
    out = lens_topk({0: stream}, llama.final_norm, llama.unembed, lens, top_k=3)
    with torch.no_grad():
        moved = stream @ torch.from_numpy(w).T + torch.from_numpy(b)
        expected = torch.log_softmax(llama.model.lm_head(llama.final_norm(moved)), -1).topk(3, dim=-1)
    np.testing.assert_array_equal(out["token_ids"][0], expected.indices.numpy())
    np.testing.assert_allclose(out["logprobs"][0], expected.values.numpy(), atol=1e-5)
    with pytest.raises(KeyError, match="no translator for layer 1"):
        lens_topk({1: stream}, llama.final_norm, llama.unembed, lens, top_k=3)


def toy_sae(architecture: str) -> SaeWeights:
    # d_in 2, d_sae 3: latents pre = (h - b_dec) @ W_enc + b_enc
    w_enc = np.array([[1.0, 0.0, 2.0], [0.0, 1.0, -1.0]], dtype=np.float32)
    threshold = np.array([0.5, 3.0, 0.5], dtype=np.float32)
    return SaeWeights(
        w_enc,
        np.array([0.0, -1.0, 0.5], np.float32),
        np.zeros((3, 2), np.float32),
        np.array([1.0, 0.0], np.float32),
        architecture,
        layer=4,
        k=2,
        threshold=threshold if architecture == "jumprelu" else None,
    )


@pytest.mark.parametrize(
    ("architecture", "ids", "values"),
    [
        # h = (3, 2): h - b_dec = (2, 2); pre = (2, 2 - 1, 4 - 2 + 0.5) = (2, 1, 2.5)
        ("standard", [[2, 0, 1], [-1, -1, -1]], [[2.5, 2.0, 1.0], [0, 0, 0]]),
        ("jumprelu", [[2, 0, -1], [-1, -1, -1]], [[2.5, 2.0, 0.0], [0, 0, 0]]),  # latent 1 under its threshold 3
        ("topk", [[2, 0, -1], [-1, -1, -1]], [[2.5, 2.0, 0.0], [0, 0, 0]]),  # k=2 keeps the two largest
    ],
)
def test_sae_topk_by_hand(architecture: str, ids: list[list[int]], values: list[list[float]]) -> None:
    # second row h = (1, 0): h - b_dec = (0, 0): pre = (0, -1, 0.5) ... then made negative below
    stream = np.array([[3.0, 2.0], [1.0, 5.0]], dtype=np.float32)
    sae = toy_sae(architecture)
    sae.b_enc[:] = [0.0, -1.0, 0.5]
    stream[1] = [-9.0, -9.0]  # (h - b_dec) = (-10, -9): pre = (-10, -10, -10.5): nothing active
    out = sae_topk(stream, sae, top_k=3)
    assert out["layer"] == 4 and out["latent_ids"].dtype == np.int32 and out["values"].dtype == np.float32
    np.testing.assert_array_equal(out["latent_ids"], ids)
    np.testing.assert_allclose(out["values"], values)
    padded = sae_topk(stream, sae, top_k=5)
    assert padded["latent_ids"].shape == (2, 5) and (padded["latent_ids"][:, 3:] == -1).all()
