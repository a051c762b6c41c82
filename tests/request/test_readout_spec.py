"""Readout request objects (lens_evals.request.readouts): every validator's refusal, as the
client and the server's 400 word it, and the digest forms (inline weights, or a digest alone
naming weights sent before). No engine."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from lens_evals.request.readouts import AffineLens, SaeEncoder, parse_readout

W = np.ones((2, 3, 3), np.float32).tolist()
E = np.ones((3, 4), np.float32).tolist()
B = [0.0] * 4


def lens(**fields: Any) -> dict[str, Any]:
    return {"kind": "lens", "name": "a", "layers": [0], "lens": fields}


def sae(**fields: Any) -> dict[str, Any]:
    return {"kind": "sae", "name": "s", "layer": 0, "sae": fields}


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        (lens(), "lens: an affine lens needs weights (with layers) or the digest of weights sent before"),
        (lens(digest="x", biases=[[1.0]]), "lens: an affine lens given by digest takes no layers or biases"),
        (lens(digest="x", layers=[0]), "lens: an affine lens given by digest takes no layers or biases"),
        (lens(weights=W), "lens: an affine lens with weights needs its layers"),
        (lens(weights=W, layers=[1, 1]), "lens: affine lens layers must be distinct and >= 0, got [1, 1]"),
        (lens(weights=W, layers=[1]), "lens: affine lens weights must be (n_layers=1, d, d), got shape [2, 3, 3]"),
        (lens(weights=W, layers=[0, 1], biases=[[0.0] * 2] * 2), "lens: affine lens biases must be (n_layers, d) = [2, 3], got [2, 2]"),
        (lens(weights=W, layers=[0, 1], digest="0"), "lens: affine lens digest does not match its weights"),
        (lens(weights=[[[float("nan")]]], layers=[0]), "lens: weights: weights contains NaN or inf"),
        ({"kind": "lens", "name": " ", "layers": [0]}, "name: readout name must not be empty"),
        ({"kind": "sae", "name": "", "layer": 0, "sae": {"W_enc": E, "b_enc": B}}, "name: readout name must not be empty"),
        (sae(), "sae: an SAE encoder needs W_enc and b_enc, or the digest of an encoder sent before"),
        (sae(digest="x", b_enc=[0.0]), "sae: an SAE encoder given by digest takes no arrays"),
        (sae(digest="x", threshold=[0.0]), "sae: an SAE encoder given by digest takes no arrays"),
        (sae(W_enc=[1.0], b_enc=[0.0]), "sae: W_enc must be (d_in, d_sae), got shape [1]"),
        (sae(W_enc=E), "sae: b_enc must be (4,), got None"),
        (sae(W_enc=E, b_enc=B, b_dec=[0.0]), "sae: b_dec must be (3,), got [1]"),
        (sae(W_enc=E, b_enc=B, apply_b_dec_to_input=True), "sae: apply_b_dec_to_input needs b_dec"),
        (sae(W_enc=E, b_enc=B, activation="jumprelu"), "sae: a jumprelu SAE needs threshold (4,)"),
        (sae(W_enc=E, b_enc=B, threshold=B), "sae: threshold is for jumprelu SAEs only"),
        (sae(W_enc=E, b_enc=B, activation="topk"), "sae: k is required for (and only for) topk SAEs"),
        (sae(W_enc=E, b_enc=B, activation="topk", k=5), "sae: k 5 is larger than the SAE's 4 latents"),
        (sae(W_enc=E, b_enc=B, digest="0"), "sae: SAE digest does not match its weights"),
        (sae(W_enc=E, b_enc=[float("inf")] * 4), "sae: b_enc: b_enc contains NaN or inf"),
    ],
)
def test_bad_readouts_are_refused_with_their_reason(payload: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError) as caught:
        parse_readout(payload)
    assert str(caught.value) == message


def test_weights_travel_inline_or_by_their_digest() -> None:
    rng = np.random.default_rng(0)
    affine = AffineLens(layers=[0, 2], weights=rng.normal(size=(2, 3, 3)), biases=rng.normal(size=(2, 3)))
    encoder = SaeEncoder(W_enc=rng.normal(size=(3, 5)), b_enc=np.zeros(5), b_dec=np.ones(3), activation="topk", k=2)
    for weights, arrays in ((affine, ("weights", "biases")), (encoder, ("W_enc", "b_enc", "b_dec"))):
        assert weights.to_wire()["digest"] == weights.content_digest()  # the engine caches inline weights by it
        inline = type(weights).from_wire(weights.to_json())
        assert inline.inline and inline.content_digest() == weights.content_digest()
        for name in arrays:
            np.testing.assert_array_equal(getattr(inline, name), getattr(weights, name))
        assert weights.nbytes() == sum(getattr(weights, name).nbytes for name in arrays)
        by_digest = type(weights).from_wire({"digest": weights.content_digest()})
        assert not by_digest.inline and by_digest.nbytes() == 0 and by_digest.to_wire() == {"digest": weights.content_digest()}
    # the digest names the content: another bias is another lens
    other = AffineLens(layers=[0, 2], weights=affine.weights, biases=affine.biases + 1)
    assert other.content_digest() != affine.content_digest()
    # no biases hashes as zero biases (the same translator)
    zero = AffineLens(layers=[0, 2], weights=affine.weights, biases=np.zeros((2, 3)))
    assert AffineLens(layers=[0, 2], weights=affine.weights).content_digest() == zero.content_digest()
