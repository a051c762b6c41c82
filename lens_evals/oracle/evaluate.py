"""Held-out accuracy of an oracle against its zero-vector baseline (the same prompt and adapter
with nothing injected), offline through the engine."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from lens_evals.oracle.inference import OracleSettings, capture_conversations, oracle_answers
from lens_evals.oracle.qa_items import OracleItem, answer_matches


def family_accuracy(items: Sequence[OracleItem], answers: Sequence[str]) -> dict[str, float]:
    hits: dict[str, list[bool]] = {}
    for item, answer in zip(items, answers):
        hits.setdefault(item.family, []).append(answer_matches(answer, item.answer))
    table = {family: float(np.mean(values)) for family, values in sorted(hits.items())}
    table["all"] = float(np.mean([h for values in hits.values() for h in values])) if hits else float("nan")
    return table


def evaluate_offline(llm: Any, tokenizer: Any, lora_request: Any, settings: OracleSettings, items: Sequence[OracleItem]) -> dict[str, Any]:
    """Per-family accuracy with activations and with zero vectors, and the answers given."""
    conversations = [[{"role": "user", "content": item.context}] for item in items]
    activations = capture_conversations(llm, conversations, settings.target_layer, settings.num_tokens)
    questions = [item.question for item in items]
    with_acts = oracle_answers(llm, tokenizer, lora_request, settings, activations, questions, inject=True)
    zero = oracle_answers(llm, tokenizer, lora_request, settings, activations, questions, inject=False)
    return {
        "n": {family: sum(1 for item in items if item.family == family) for family in sorted({i.family for i in items})},
        "oracle": family_accuracy(items, with_acts),
        "zero_vector": family_accuracy(items, zero),
        "examples": [
            {"family": item.family, "context": item.context, "answer": item.answer, "oracle": a, "zero_vector": z}
            for item, a, z in list(zip(items, with_acts, zero))[:20]
        ],
    }
