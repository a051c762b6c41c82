"""The tuned lens: trained from the identity it lowers KL(final || lens) below the logit lens's on
its training tokens (a random Llama); on a model whose layers are linear, where an affine
translator can be exact, it drives the KL close to zero."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lens_evals.readouts.hf_parts import capture_streams, model_parts
from lens_evals.readouts.kl import kl_per_layer
from lens_evals.readouts.tuned import TunedLensSettings, fit_tuned_lens, top_mass_tokens
from tests.arch_zoo import build
from tests.readouts.linear_lm import LinearLM


def random_prompts(vocab: int, n: int, length: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n, length), generator=g).tolist()


def fit_and_score(parts, prompts, layers, settings):
    last = parts.num_layers - 1
    streams = capture_streams(parts, prompts, [*layers, last], skip_first=1)
    final = streams.pop(last)
    lens, history = fit_tuned_lens(streams, final, parts.final_norm, parts.unembed, settings, progress=False, last_layer=last)
    curves = kl_per_layer(parts, streams, final, {"logit": None, "tuned": lens})
    return lens, history, curves


def test_tuned_lens_beats_the_logit_lens_on_a_random_llama() -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(build("LlamaForCausalLM")), dtype=torch.float32).eval()
    parts = model_parts(model)
    lens, history, curves = fit_and_score(parts, random_prompts(512, 16, 16), [0], TunedLensSettings(steps=60, batch_tokens=128, lr=3e-3))
    assert curves["tuned"][0] < 0.7 * curves["logit"][0], curves
    assert history[-1] < history[0]
    assert lens.layers == [0, 1] and np.array_equal(lens.weights[1], np.eye(128, dtype=np.float32))


def test_tuned_lens_nearly_exact_on_linear_layers() -> None:
    parts = model_parts(LinearLM(vocab=64, d=16, n_layers=4))
    _, _, curves = fit_and_score(parts, random_prompts(64, 24, 16), [0, 2], TunedLensSettings(steps=300, batch_tokens=256, lr=1e-2))
    for layer in (0, 2):
        assert curves["logit"][layer] > 0.01, curves  # the logit lens is measurably off (0.04, 0.013)
        assert curves["tuned"][layer] < 0.1 * curves["logit"][layer], curves


def test_the_identity_start_is_the_logit_lens() -> None:
    """No steps: the lens is the identity and reads exactly as the logit lens."""
    parts = model_parts(LinearLM(vocab=64, d=16, n_layers=3))
    lens, _, curves = fit_and_score(parts, random_prompts(64, 4, 8), [0, 1], TunedLensSettings(steps=0))
    assert curves["tuned"] == pytest.approx(curves["logit"], abs=1e-6)
    assert np.array_equal(lens.weights[0], np.eye(16, dtype=np.float32))


def test_top_mass_tokens_keeps_the_likely_ones() -> None:
    parts = model_parts(LinearLM(vocab=64, d=16, n_layers=2))
    final = capture_streams(parts, random_prompts(64, 4, 8), [1])[1]
    kept = top_mass_tokens(final, parts.head, 8)
    mass = torch.softmax(parts.head(final), -1).sum(0)
    assert kept.tolist() == sorted(mass.topk(8).indices.tolist())
