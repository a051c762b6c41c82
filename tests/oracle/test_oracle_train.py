"""Oracle training pieces against plain HF computations (tiny Llama, no engine)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lens_evals.oracle.inference import OracleSettings
from lens_evals.oracle.lora_training import InjectionHook, answer_loss, build_examples, collate, decoder_layers
from lens_evals.oracle.prompt import inject
from lens_evals.oracle.qa_items import OracleItem

SETTINGS = OracleSettings(target_layer=2, injection_layer=1, num_tokens=None, placeholder=" cat", coefficient=1.0)


@pytest.fixture(scope="module")
def tiny_peft(tiny_path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(str(tiny_path), dtype=torch.float32)
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False))
    return model, AutoTokenizer.from_pretrained(str(tiny_path))


def test_inject_formula_and_zero_vector() -> None:
    hidden = torch.randn(2, 5, 8)
    positions = torch.tensor([[1, 3], [4, -1]])
    vectors = torch.randn(2, 2, 8)
    vectors[1, 0] = 0.0  # a zero vector adds nothing
    out = inject(hidden, positions, vectors, 0.5)
    expected = hidden.clone()
    for b, k in [(0, 0), (0, 1)]:
        p = positions[b, k]
        expected[b, p] += 0.5 * hidden[b, p].norm() * vectors[b, k] / vectors[b, k].norm()
    torch.testing.assert_close(out, expected)


def test_shared_prefix_loss_equals_full_sequences(tiny_peft) -> None:
    """The batched loss (shared prefix KV, left padding, kept logits) equals the mean
    cross-entropy of each example's answer tokens computed on its full, unpadded sequence."""
    model, tokenizer = tiny_peft
    rng = np.random.default_rng(0)
    items = [
        OracleItem("word", "x", q, a, "g") for q, a in [("which word?", "book"), ("is this true or false?", "false"), ("say", "the answer")]
    ]
    acts = [rng.normal(size=(k, 128)).astype(np.float32) for k in (3, 5, 2)]
    examples = build_examples(tokenizer, items, acts, SETTINGS)
    hook = InjectionHook(SETTINGS.coefficient)
    handle = decoder_layers(model)[SETTINGS.injection_layer].register_forward_hook(hook)
    try:
        with torch.no_grad():
            batched = answer_loss(model, collate(examples, pad_id=2), hook)
            losses, counts = [], []
            for example in examples:
                ids = torch.tensor([example.input_ids])
                hook.positions = torch.tensor([example.positions])
                hook.vectors = torch.from_numpy(example.vectors)[None]
                logits = model(input_ids=ids).logits[0]
                hook.positions = hook.vectors = None
                n = example.num_answer
                losses.append(torch.nn.functional.cross_entropy(logits[-n - 1 : -1], ids[0, -n:], reduction="sum"))
                counts.append(n)
    finally:
        handle.remove()
    reference = torch.stack(losses).sum() / sum(counts)
    torch.testing.assert_close(batched, reference, atol=1e-5, rtol=1e-5)
