"""Offline references for the Petri inspectors: a conversation's final turn found by character
offsets in the HF tokenizer's rendering (not by the server's /tokenize), its activations from an
offline engine, and the oracle's answer through ``lens_evals.oracle.inference``."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from lens_evals.oracle.inference import OracleSettings, oracle_answers
from lens_evals.probing.probe import Probe, ProbeCard
from lens_evals.request.spec import CAPTURE_KEY

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
