"""Capture equals HF transformers hidden states on SmolLM2-135M-Instruct in fp32."""

from __future__ import annotations

import pytest

from tests.conftest import capture, greedy, make_llm
from tests.hf_reference import HFReference
from tests.tolerance import assert_stream_close, stream_bound

PROMPTS = ["The capital of France is", "Write one sentence about the sea, and make it about the colour of the water at dawn.", "Hi"]
LAYERS = [0, 7, 14, 28, 29]
MAX_TOKENS = 5
# Held per token (tests/tolerance.py): ||vllm_t - hf_t|| / ||hf_t|| <= stream_bound(). Measured on
# CPU: at most 1.1e-5 over all 30 layers (two fp32 kernels summing in different orders; an
# elementwise bound fails at random on the massive-activation dimensions, |h| ~ 2.2e4). A capture
# bug (wrong row, layer or position) gives errors of order 1.


@pytest.fixture(scope="module")
def smollm2_outputs(smollm2_path):
    from lens_evals.engine.frontend import self_check_run

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("LENS_EVALS_SELF_CHECK", "1")  # checked on this engine (tests/conftest.py turns it off)
        with make_llm(smollm2_path, max_model_len=512) as llm:
            outputs = llm.generate(PROMPTS, greedy(MAX_TOKENS, output_residual_stream=LAYERS))
            chat = llm.chat([{"role": "user", "content": "Name a colour."}], greedy(3, output_residual_stream=[3]))
            checked = self_check_run.result_of(llm.llm_engine.input_processor)
    return outputs, chat, checked


def test_self_check_passes_on_smollm2(smollm2_outputs) -> None:
    """The engine's stream-contract self-check on the embedded model (30 layers, fp32): the
    captured stream written back moves no log-prob, the capture equals the next layer's input,
    doubling the last layer's stream leaves the log-probs as the final norm predicts."""
    checked = smollm2_outputs[2]
    assert checked is not None and checked.skipped is None and checked.passed, checked and checked.table()
    assert [c.layer for c in checked.layers] == [0, 15, 29]
    assert checked.layers[-1].control > 0.1 and checked.layers[-1].steer < 1e-3, checked.table()


def test_capture_matches_hf_hidden_states(smollm2_path, smollm2_outputs) -> None:
    outputs = smollm2_outputs[0]
    hf = HFReference(smollm2_path)
    worst = worst_hf = 0.0
    for n, out in enumerate(outputs):
        tokens = list(out.prompt_token_ids) + list(out.outputs[0].token_ids)
        got = capture(out)
        assert got.shape == (len(LAYERS), len(tokens) - 1, 576)  # prompt + generated - 1
        hidden_states = hf.hidden_states(tokens[:-1])
        reference = hf.residual_stream(tokens[:-1], LAYERS)
        for i, layer in enumerate(LAYERS):
            if layer < 29:  # HF's last hidden_states entry is after the final norm
                worst_hf = max(
                    worst_hf, assert_stream_close(reference[i], hidden_states[layer + 1], f"HF hook vs hidden_states, layer {layer}")
                )
            worst = max(worst, assert_stream_close(got[i], reference[i], f"prompt {n}, layer {layer}: capture vs HF"))
    print(
        f"max per-token relative error vs HF: {worst:.2e} (HF hook vs hidden_states {worst_hf:.2e}); bound {stream_bound():.0e}; "
        f"{len(outputs)} prompts, layers {LAYERS}"
    )


def test_chat_capture_matches_hf(smollm2_path, smollm2_outputs) -> None:
    chat = smollm2_outputs[1]
    out = chat[0]
    tokens = list(out.prompt_token_ids) + list(out.outputs[0].token_ids)
    reference = HFReference(smollm2_path).residual_stream(tokens[:-1], [3])
    got = capture(out)
    assert got.shape == reference.shape
    assert_stream_close(got, reference, "chat capture vs HF, layer 3")
