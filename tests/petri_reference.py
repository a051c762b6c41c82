"""Offline references for the Petri inspectors: a conversation's final turn found by character
offsets in the HF tokenizer's rendering (not by the server's /tokenize), its activations from an
offline engine, and the oracle's answer through ``lens_evals.oracle.inference``."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from lens_evals.oracle.inference import OracleSettings, injection_vector, oracle_answers, oracle_prompt_ids
from lens_evals.probing.probe import Probe, ProbeCard
from lens_evals.request.spec import CAPTURE_KEY, STEERING_KEY

TOOL_TEMPLATE = Path(__file__).resolve().parents[1] / "lens_evals" / "data" / "chat_templates" / "chatml_tools.jinja"
END_OF_TURN = "<|im_end|>"


def as_template_input(chat: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI-format messages as vLLM hands them to a chat template: tool-call arguments parsed."""
    out = []
    for message in chat:
        message = dict(message)
        if message.get("tool_calls"):
            message["tool_calls"] = [
                {**call, "function": {**call["function"], "arguments": json.loads(call["function"]["arguments"])}}
                for call in message["tool_calls"]
            ]
        out.append(message)
    return out


def turn_by_characters(
    tokenizer: Any, chat: Sequence[dict[str, Any]], tools: list[dict[str, Any]] | None, quote: str | None = None
) -> tuple[list[int], list[int]]:
    """(token ids of the closed conversation, positions of the tokens that overlap the final
    turn's characters, or the quote's within it)."""
    template = TOOL_TEMPLATE.read_text(encoding="utf-8")
    messages = as_template_input(chat)
    text = tokenizer.apply_chat_template(messages, tools=tools, chat_template=template, tokenize=False)
    before = tokenizer.apply_chat_template(messages[:-1], tools=tools, chat_template=template, tokenize=False, add_generation_prompt=True)
    assert text.startswith(before)
    first, last = len(before), text.rindex(END_OF_TURN)
    if quote is not None:
        first = text.index(quote, first)
        last = first + len(quote)
    encoded = tokenizer(text, return_offsets_mapping=True, add_special_tokens=False)
    ids = list(encoded["input_ids"])
    assert ids == list(tokenizer.apply_chat_template(messages, tools=tools, chat_template=template, tokenize=True, return_dict=False))
    return ids, [n for n, (a, b) in enumerate(encoded["offset_mapping"]) if b > first and a < last]


def capture_ids(llm: Any, ids: list[int], layer: int) -> np.ndarray:
    from vllm import SamplingParams

    [output] = llm.generate(
        [{"prompt_token_ids": ids}], SamplingParams(max_tokens=1, temperature=0.0, extra_args={CAPTURE_KEY: [layer]}), use_tqdm=False
    )
    return output.activations["residual_stream"][0].float().numpy()


def offline_oracle(
    llm: Any, tokenizer: Any, lora: Any, settings: OracleSettings, acts: np.ndarray, question: str, max_tokens: int, inject: bool = True
) -> str:
    """The oracle's answer offline, its prompt rendered with the server's template (tools-free ChatML);
    ``inject=False``: the same prompt and adapter without the activations (the zero-vector baseline)."""
    tokenizer.chat_template = TOOL_TEMPLATE.read_text(encoding="utf-8")
    [answer] = oracle_answers(llm, tokenizer, lora, settings, [acts], [question], max_tokens=max_tokens, inject=inject)
    return answer


def oracle_prompt(
    tokenizer: Any, settings: OracleSettings, acts: np.ndarray, question: str, inject: bool
) -> tuple[list[int], dict[str, Any] | None]:
    """The oracle prompt's token ids (the server's template) and the steering that injects ``acts``."""
    tokenizer.chat_template = TOOL_TEMPLATE.read_text(encoding="utf-8")
    ids, positions = oracle_prompt_ids(tokenizer, settings, acts.shape[0], question)
    vector = injection_vector(acts, positions, settings) if inject else None
    return ids, ({STEERING_KEY: [vector]} if vector is not None else None)


def oracle_answer_ids(
    llm: Any, tokenizer: Any, lora: Any, settings: OracleSettings, acts: np.ndarray, question: str, max_tokens: int
) -> list[int]:
    """The token ids of the oracle's greedy answer about ``acts`` (injected)."""
    from vllm import SamplingParams

    ids, extra = oracle_prompt(tokenizer, settings, acts, question, inject=True)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, extra_args=extra)
    [output] = llm.generate([{"prompt_token_ids": ids}], params, lora_request=lora, use_tqdm=False)
    return list(output.outputs[0].token_ids)


def teacher_forced_logprobs(
    llm: Any, tokenizer: Any, lora: Any, settings: OracleSettings, acts: np.ndarray, question: str, answer: list[int], inject: bool = True
) -> np.ndarray:
    """log p(answer token k | oracle prompt about ``acts``, answer tokens < k), each answer token
    (teacher-forced: one request per prefix, the next token's log-probs over the whole vocabulary;
    not prompt log-probs, which the CPU LoRA logits path cannot take, see the report);
    ``inject=False``: the same prompt and adapter without the activations."""
    from vllm import SamplingParams

    ids, extra = oracle_prompt(tokenizer, settings, acts, question, inject)
    params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=len(tokenizer), extra_args=extra)
    prompts = [{"prompt_token_ids": ids + answer[:k]} for k in range(len(answer))]
    outputs = llm.generate(prompts, [params] * len(prompts), lora_request=[lora] * len(prompts), use_tqdm=False)
    return np.array([out.outputs[0].logprobs[0][token].logprob for out, token in zip(outputs, answer)], dtype=np.float64)


def random_probe(name: str, model: str, layer: int, hidden_size: int) -> Probe:
    """A probe fitted to random features (seed 0, 64 rows): only where its scores land is checked."""
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    rng = np.random.default_rng(0)
    features, labels = rng.normal(size=(64, hidden_size)), np.arange(64) % 2
    pipeline = make_pipeline(StandardScaler(), LogisticRegression(C=0.1)).fit(features, labels)
    card = ProbeCard(
        name=name,
        model=model,
        layer=layer,
        hidden_size=hidden_size,
        token_selection="all",
        training_set="random",
        n_train_dialogues=64,
        n_val_dialogues=0,
        n_train_tokens=64,
        regularization_C=0.1,
        validation_auroc=0.5,
        threshold=0.0,
        control_set="none",
        n_control=0,
        versions={},
        created="2026-12-03",
    )
    return Probe(pipeline=pipeline, card=card)
