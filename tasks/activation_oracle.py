"""Activation-oracle evals (Karvonen et al., arXiv 2512.15674) on a trained oracle adapter. The
tasks are ``lens_evals/activation_oracle_heldout`` and ``lens_evals/activation_oracle_secret_word``
(lens_evals/evals/activation_oracle/); this file holds the same tasks.

    lens-evals oracle train                       # once: trains smollm2-135m-oracle (CPU, minutes)
    inspect eval tasks/activation_oracle.py@activation_oracle_heldout \\
        --model vllm-lens/smollm2-135m-instruct -M lora_modules=oracle=smollm2-135m-oracle
    inspect eval tasks/activation_oracle.py@activation_oracle_secret_word \\
        --model vllm-lens/smollm2-135m-instruct -M lora_modules=oracle=smollm2-135m-oracle

See tasks/README.md. Scores: the oracle's accuracy and its zero-vector baseline's, per family.
"""

from __future__ import annotations

from inspect_ai import Task, task

from lens_evals.evals.activation_oracle import activation_oracle_heldout as packaged_heldout
from lens_evals.evals.activation_oracle import activation_oracle_secret_word as packaged_secret_word
from lens_evals.oracle.qa_items import FAMILIES, QUESTIONS


@task
def activation_oracle_heldout(
    oracle: str | None = None, lora: str = "oracle", per_family: int = 40, families: str = ",".join(FAMILIES)
) -> Task:
    """``lens_evals/activation_oracle_heldout``: held-out accuracy per family vs the zero-vector baseline."""
    return packaged_heldout(oracle=oracle, lora=lora, per_family=per_family, families=families)


@task
def activation_oracle_secret_word(
    oracle: str | None = None,
    lora: str = "oracle",
    prompts: str = "taboo_standard_test",
    per_word: int = 2,
    num_tokens: int | None = None,
    question: str = QUESTIONS["word"],
) -> Task:
    """``lens_evals/activation_oracle_secret_word``: which of the 20 Taboo words does the target hold?"""
    return packaged_secret_word(oracle=oracle, lora=lora, prompts=prompts, per_word=per_word, num_tokens=num_tokens, question=question)
