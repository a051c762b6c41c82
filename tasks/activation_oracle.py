"""Activation-oracle evals (Karvonen et al., arXiv 2512.15674) on a trained oracle adapter.

    lens-evals oracle train                       # once: trains smollm2-135m-oracle (CPU, minutes)
    inspect eval tasks/activation_oracle.py@activation_oracle_heldout \\
        --model vllm-lens/smollm2-135m-instruct -M lora_modules=oracle=smollm2-135m-oracle
    inspect eval tasks/activation_oracle.py@activation_oracle_secret_word \\
        --model vllm-lens/smollm2-135m-instruct -M lora_modules=oracle=smollm2-135m-oracle

See tasks/README.md. Scores: the oracle's accuracy and its zero-vector baseline's, per family.
"""

from __future__ import annotations

from inspect_ai import Task, task
from lens_evals.evals.oracle_tasks import oracle_heldout_task, secret_word_task

from lens_evals.oracle.adapters import DEFAULT_ORACLE
from lens_evals.oracle.qa_items import FAMILIES, QUESTIONS


@task
def activation_oracle_heldout(oracle: str = DEFAULT_ORACLE, lora: str = "oracle", per_family: int = 40,
                              families: str = ",".join(FAMILIES)) -> Task:
    """Held-out accuracy per family vs the zero-vector baseline."""
    return oracle_heldout_task(oracle, lora=lora, per_family=per_family, families=families)


@task
def activation_oracle_secret_word(oracle: str = DEFAULT_ORACLE, lora: str = "oracle", prompts: str = "taboo_standard_test",
                                  per_word: int = 2, num_tokens: int | None = None, question: str = QUESTIONS["word"]) -> Task:
    """Which of the 20 Taboo words does the target hold in its system prompt?"""
    return secret_word_task(oracle, lora=lora, prompts=prompts, per_word=per_word, num_tokens=num_tokens, question=question)
