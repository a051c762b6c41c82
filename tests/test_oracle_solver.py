"""The activation-oracle path on the tiny Llama: injection positions, the zero-vector baseline,
the solver over HTTP, and the Inspect task end to end with an oracle trained in the test."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from inspect_ai import eval as inspect_eval

from lens_evals.oracle.inference import OracleSettings, injection_vector, oracle_answers, oracle_prompt_ids
from lens_evals.oracle.lora_training import OracleTrainConfig
from lens_evals.oracle.prompt import placeholder_token_id
from lens_evals.request.spec import CAPTURE_KEY, STEERING_KEY
from tests.conftest import capture, gpu_share, greedy, make_llm
from tests.lora_helpers import assert_greedy_of, lora_dtype, random_adapter
from tests.tolerance import assert_stream_close, token_relative_error

SETTINGS = OracleSettings(target_layer=2, injection_layer=1, num_tokens=None, placeholder=" cat", coefficient=1.0)
QUESTION = "which word is the text about?"


@pytest.fixture(scope="module")
def tokenizer(tiny_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_path))


@pytest.fixture(scope="module")
def adapter(tiny_path, tmp_path_factory):
    return random_adapter(tiny_path, tmp_path_factory.mktemp("oracle_adapter") / "a", 3, ["q_proj", "v_proj", "down_proj"])


def hf_peft(tiny_path, adapter) -> torch.nn.Module:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    return PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(tiny_path), dtype=torch.float32), str(adapter)).eval()


def test_placeholder_must_be_one_token(tokenizer, smollm2_path) -> None:
    from transformers import AutoTokenizer

    with pytest.raises(ValueError, match="exactly one token"):
        placeholder_token_id(tokenizer, " ?")  # two tokens for the tiny tokenizer
    assert placeholder_token_id(AutoTokenizer.from_pretrained(str(smollm2_path)), " ?") == 9148


def test_injection_lands_on_exactly_the_placeholders(tiny_path, adapter, tokenizer) -> None:
    """The stream after the injection layer differs from an uninjected run at the placeholder
    positions only, by c * ||h|| * v / ||v|| with h the uninjected stream there: a relative change
    of c = 1 per token, against numeric noise held to stream_bound()."""
    from vllm.lora.request import LoRARequest

    acts = np.random.default_rng(0).normal(size=(4, 128)).astype(np.float32)
    acts[2] = 0.0  # a zero vector injects nothing
    ids, positions = oracle_prompt_ids(tokenizer, SETTINGS, acts.shape[0], QUESTION)
    vector = injection_vector(acts, positions, SETTINGS)
    layer = SETTINGS.injection_layer
    lora = LoRARequest("oracle", 1, str(adapter))
    with make_llm(tiny_path, enable_lora=True, max_loras=2, max_lora_rank=8, dtype=lora_dtype()) as llm:
        prompt = {"prompt_token_ids": ids}
        injected, plain = llm.generate(
            [prompt, prompt],
            [greedy(2, **{CAPTURE_KEY: [layer], STEERING_KEY: [vector]}), greedy(2, **{CAPTURE_KEY: [layer]})],
            lora_request=[lora, lora],
            use_tqdm=False,
        )
    after, before = capture(injected)[0, : len(ids)], capture(plain)[0, : len(ids)]
    changed = torch.nonzero(token_relative_error(after, before) > SETTINGS.coefficient / 2).flatten().tolist()
    assert changed == [p for k, p in enumerate(positions) if k != 2]
    expected = before.clone()
    for k, p in enumerate(positions):
        v = torch.from_numpy(acts[k])
        if k != 2:
            expected[p] += SETTINGS.coefficient * before[p].norm() * v / v.norm()
    assert_stream_close(after, expected, "injected stream vs uninjected + c * ||h|| * v / ||v|| at the placeholders")


def test_training_capture_reads_a_bfloat16_engine(tiny_path, tokenizer) -> None:
    """The oracle's training activations from a bfloat16 engine (on a GPU every LoRA engine is
    bfloat16): float32 rows, the last ``num_tokens`` of each chat prompt, equal to the engine's own
    capture widened. Reference: the prompt tokenized by the chat template and captured directly."""
    from lens_evals.oracle.inference import capture_conversations

    conversations = [[{"role": "user", "content": text}] for text in ("the cat reads a book.", "a model finds the truth, slowly.")]
    with make_llm(tiny_path, dtype="bfloat16") as llm:
        got = capture_conversations(llm, conversations, layer=2, num_tokens=3)
        ids = [tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=True, return_dict=False) for c in conversations]
        direct = llm.generate([{"prompt_token_ids": list(i)} for i in ids], greedy(1, **{CAPTURE_KEY: [2]}), use_tqdm=False)
    for rows, output, prompt in zip(got, direct, ids, strict=True):
        stream = capture(output)[0]
        assert stream.dtype == torch.bfloat16 and stream.shape[0] == len(prompt)
        assert rows.dtype == np.float32 and rows.shape == (3, stream.shape[1])
        np.testing.assert_array_equal(rows, stream[-3:].float().numpy())


def test_zero_vector_oracle_equals_plain_lora_generation(tiny_path, adapter, tokenizer) -> None:
    """Zero vectors inject nothing: the answer is the LoRA's own greedy answer, which HF + peft
    reproduces; real vectors change it."""
    from vllm.lora.request import LoRARequest

    rng = np.random.default_rng(1)
    real = [rng.normal(size=(k, 128)).astype(np.float32) * 50 for k in (3, 5)]
    zeros = [np.zeros_like(a) for a in real]
    lora = LoRARequest("oracle", 1, str(adapter))
    from vllm import SamplingParams

    prompts = [oracle_prompt_ids(tokenizer, SETTINGS, acts.shape[0], QUESTION)[0] for acts in real]
    # Without the prefix cache each call computes the same batch from its first token. With it, the
    # later calls computed only the uncached tail, in a smaller batch whose bf16 kernels (GPU)
    # round otherwise: enough to flip a near-tie greedy token of the random model. The likely cause
    # of this test's one failure on the H200 (2026-12-04, details cut with the call; it passes in
    # bf16 on CPU); what is equal here must be equal by what the engine computes, not by chance.
    with make_llm(tiny_path, enable_lora=True, max_loras=2, max_lora_rank=8, dtype=lora_dtype(), enable_prefix_caching=False) as llm:
        with_zeros = oracle_answers(llm, tokenizer, lora, SETTINGS, zeros, [QUESTION] * 2, max_tokens=6)
        baseline = oracle_answers(llm, tokenizer, lora, SETTINGS, real, [QUESTION] * 2, max_tokens=6, inject=False)
        injected = oracle_answers(llm, tokenizer, lora, SETTINGS, real, [QUESTION] * 2, max_tokens=6)
        plain = llm.generate(
            [{"prompt_token_ids": ids} for ids in prompts], SamplingParams(max_tokens=6, temperature=0.0), lora_request=lora, use_tqdm=False
        )
    assert with_zeros == baseline == [output.outputs[0].text for output in plain]
    reference = hf_peft(tiny_path, adapter)
    for ids, output in zip(prompts, plain):
        assert_greedy_of(reference, ids, list(output.outputs[0].token_ids), "LoRA answer vs HF + peft")
    assert injected != baseline


TINY_ORACLE = OracleTrainConfig(
    base_model="tiny-llama",
    target_layer=2,
    injection_layer=1,
    num_tokens=6,
    placeholder=" cat",
    train_per_family=2,
    eval_per_family=1,
    batch_size=5,
    lora_rank=8,
    lora_alpha=16,
)


def test_task_end_to_end_with_a_trained_tiny_oracle(tiny_path, tokenizer, tmp_path) -> None:
    """Train a tiny oracle (2 steps), run the held-out task through the provider (base and LoRA
    requests on one server), and check the solver's answers equal the offline engine's."""
    from vllm.lora.request import LoRARequest

    from lens_evals.evals.activation_oracle.activation_oracle import oracle_heldout_task
    from lens_evals.oracle.build import build_oracle
    from lens_evals.oracle.inference import capture_conversations
    from lens_evals.oracle.qa_items import all_items, sample_mix

    oracle_dir, card = build_oracle("tiny-oracle", TINY_ORACLE, tmp_path / "tiny-oracle")
    assert card["train"]["steps"] == 2 and set(card["heldout"]["oracle"]) >= {"truth", "word", "all"}
    task = oracle_heldout_task(str(oracle_dir), per_family=2)
    logs = inspect_eval(
        task,
        model="vllm-lens/tiny-llama",
        model_args={"lora_modules": f"oracle={oracle_dir}", "dtype": lora_dtype(), **gpu_share(), "max_model_len": 512, "seed": 0},
        log_dir=str(tmp_path / "logs"),
        display="none",
    )
    log = logs[0]
    assert log.status == "success", log.error
    assert {s.name for s in log.results.scores} == {"oracle_answer_match", "zero_vector_match"}
    samples = log.samples
    records = [s.store["lens_evals:oracle"] for s in samples]
    assert all(r["num_positions"] == 6 and len(r["positions"]) == 6 for r in records)
    assert samples[0].messages[-1].metadata["activation_oracle"]["answer"] == records[0]["answer"]
    items = sample_mix(all_items(), "heldout", 2, seed=TINY_ORACLE.seed + 1)
    by_context = {s.input if isinstance(s.input, str) else s.input[0].content: r for s, r in zip(samples, records)}
    settings = TINY_ORACLE.settings()
    with make_llm(tiny_path, enable_lora=True, max_loras=2, max_lora_rank=8, dtype=lora_dtype()) as llm:
        acts = capture_conversations(
            llm, [[{"role": "user", "content": i.context}] for i in items], settings.target_layer, settings.num_tokens
        )
        lora = LoRARequest("oracle", 1, str(oracle_dir))
        offline = oracle_answers(llm, tokenizer, lora, settings, acts, [i.question for i in items])
        offline_zero = oracle_answers(llm, tokenizer, lora, settings, acts, [i.question for i in items], inject=False)
    for item, answer, zero in zip(items, offline, offline_zero):
        record = by_context[item.context]
        assert record["positions"] == oracle_prompt_ids(tokenizer, settings, 6, item.question)[1]
        assert (record["answer"], record["zero_vector_answer"]) == (answer, zero), item
