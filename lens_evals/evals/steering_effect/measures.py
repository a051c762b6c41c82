"""The steering eval's measures, computed from what the engine returns: sums of teacher-forced
log-probabilities, a text's net fraction of positive words, and perplexity."""

from __future__ import annotations

import math
from collections.abc import Sequence

from lens_evals.evals.steering_effect.concepts import Concept, words


def shared_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading token ids ``a`` and ``b`` share."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def continuation_logprobs(prompt_logprobs: Sequence[float | None], prompt_ids: Sequence[int], prefix_ids: Sequence[int]) -> list[float]:
    """The log-probabilities of the tokens after ``prefix_ids`` (the conversation up to the answer
    prefix) in a prompt of ``prompt_ids`` that continues it. Where the two tokenisations part
    before the prefix's end (a token merged across the boundary), the parted tokens count too."""
    start = max(1, shared_prefix(prompt_ids, prefix_ids))
    values = prompt_logprobs[start:]
    if not values:
        raise ValueError("the reference completion added no token to the prompt")
    if any(v is None for v in values):
        raise ValueError("the server's prompt log-probs have a gap inside the completion")
    return [float(v) for v in values if v is not None]


def perplexity(logprobs: Sequence[float]) -> float:
    """exp of the mean negative log-probability (nan for no tokens)."""
    return math.exp(-sum(logprobs) / len(logprobs)) if logprobs else math.nan


def word_balance(text: str, concept: Concept) -> float:
    """(positive words - negative words) / words of ``text``: in [-1, 1], 0 for a text of neither
    (or of no word); nan for a concept without word lists."""
    if not concept.positive_words:
        return math.nan
    found = words(text)
    if not found:
        return 0.0
    positive = sum(word in concept.positive_words for word in found)
    negative = sum(word in concept.negative_words for word in found)
    return (positive - negative) / len(found)
