"""Scorers for oracle answers: the first word of the answer is the target (case and
punctuation aside), for the oracle and for its zero-vector baseline, overall and per
``metadata["family"]``."""

from __future__ import annotations

from typing import Any

from inspect_ai.scorer import CORRECT, INCORRECT, Score, Scorer, Target, accuracy, grouped, scorer, stderr
from inspect_ai.solver import TaskState

from lens_evals.inspect_kit.oracle_solver import ORACLE_STORE_KEY
from lens_evals.oracle.qa_items import answer_matches


def _stored(state: TaskState, key: str) -> Any:
    """``key`` of the record the oracle solver stored (None when missing)."""
    record: dict[str, Any] = state.store.get(ORACLE_STORE_KEY, {})
    return record.get(key)


def _score(answer: str | None, target: Target) -> Score:
    if answer is None:
        return Score(value=INCORRECT, explanation="no answer")
    hit = any(answer_matches(answer, t) for t in target.target)
    return Score(value=CORRECT if hit else INCORRECT, answer=answer)


@scorer(metrics=[accuracy(), stderr(), grouped(accuracy(), "family", all=False)])
def oracle_answer_match() -> Scorer:
    async def score(state: TaskState, target: Target) -> Score:
        return _score(_stored(state, "answer"), target)

    return score


@scorer(metrics=[accuracy(), stderr(), grouped(accuracy(), "family", all=False)])
def zero_vector_match() -> Scorer:
    """The same question with nothing injected (``activation_oracle(zero_vector_baseline=True)``)."""

    async def score(state: TaskState, target: Target) -> Score:
        return _score(_stored(state, "zero_vector_answer"), target)

    return score
