"""Capture equals HF transformers hidden states on SmolLM2-135M-Instruct in fp32."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import capture, greedy, make_llm
from tests.hf_reference import HFReference

PROMPTS = [
    "The capital of France is",
    "Write one sentence about the sea, and make it about the colour of the water at dawn.",
    "Hi",
]
LAYERS = [0, 7, 14, 28, 29]
MAX_TOKENS = 5
# Elementwise bound: |vllm - hf| <= ATOL + RTOL * |hf|. Measured here (see README): ordinary
# dimensions differ by at most ~1.2e-3 after 30 fp32 layers (different kernel summation order);
# SmolLM2's "massive activation" dimensions reach |h| ~ 2.2e4, where one fp32 ULP is ~2e-3,
# and differ by up to ~3e-2 (relative ~1e-6). A capture bug (wrong row, layer or position)
# gives errors of order |h| and fails both bounds and the per-token relative bound.
ATOL = 2e-3
RTOL = 1e-5
MAX_TOKEN_RELATIVE_ERROR = 1e-5


@pytest.fixture(scope="module")
def smollm2_outputs(smollm2_path):
    with make_llm(smollm2_path, max_model_len=512) as llm:
        outputs = llm.generate(PROMPTS, greedy(MAX_TOKENS, output_residual_stream=LAYERS))
        chat = llm.chat(
            [{"role": "user", "content": "Name a colour."}],
            greedy(3, output_residual_stream=[3]),
        )
    return outputs, chat


def test_capture_matches_hf_hidden_states(smollm2_path, smollm2_outputs) -> None:
    outputs, _ = smollm2_outputs
    hf = HFReference(smollm2_path)
    worst = worst_ordinary = 0.0
    for out in outputs:
        tokens = list(out.prompt_token_ids) + list(out.outputs[0].token_ids)
        got = capture(out)
        assert got.shape == (len(LAYERS), len(tokens) - 1, 576)  # prompt + generated - 1
        hidden_states = hf.hidden_states(tokens[:-1])
        reference = hf.residual_stream(tokens[:-1], LAYERS)
        for i, layer in enumerate(LAYERS):
            if layer < 29:  # HF's last hidden_states entry is after the final norm
                torch.testing.assert_close(reference[i], hidden_states[layer + 1], atol=1e-5, rtol=0)
            diff = (got[i] - reference[i]).abs().max().item()
            worst = max(worst, diff)
            torch.testing.assert_close(got[i], reference[i], atol=ATOL, rtol=RTOL)
            token_error = ((got[i] - reference[i]).norm(dim=-1) / reference[i].norm(dim=-1)).max().item()
            assert token_error <= MAX_TOKEN_RELATIVE_ERROR, f"layer {layer}: relative error {token_error}"
        ordinary = reference.abs() < 100
        worst_ordinary = max(worst_ordinary, (got - reference).abs()[ordinary].max().item())
    print(f"max abs diff vs HF: {worst_ordinary:.2e} on |h|<100, {worst:.2e} overall; {len(outputs)} prompts, layers {LAYERS}")


def test_chat_capture_matches_hf(smollm2_path, smollm2_outputs) -> None:
    _, chat = smollm2_outputs
    out = chat[0]
    tokens = list(out.prompt_token_ids) + list(out.outputs[0].token_ids)
    reference = HFReference(smollm2_path).residual_stream(tokens[:-1], [3])
    got = capture(out)
    assert got.shape == reference.shape
    torch.testing.assert_close(got, reference, atol=ATOL, rtol=RTOL)
