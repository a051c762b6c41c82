"""Activation oracles: ``lens_evals/activation_oracle_heldout``, ``lens_evals/activation_oracle_secret_word``,
and the ``activation_oracle`` solver with its scorers."""

from lens_evals.evals.activation_oracle.activation_oracle import (
    activation_oracle_heldout,
    activation_oracle_secret_word,
    oracle_heldout_task,
    secret_word_task,
)
from lens_evals.evals.activation_oracle.oracle_scorers import oracle_answer_match, zero_vector_match
from lens_evals.inspect_kit.oracle_solver import activation_oracle

__all__ = [
    "activation_oracle",
    "activation_oracle_heldout",
    "activation_oracle_secret_word",
    "oracle_answer_match",
    "oracle_heldout_task",
    "secret_word_task",
    "zero_vector_match",
]
