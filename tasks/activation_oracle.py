"""Activation-oracle evals (Karvonen et al., arXiv 2512.15674) on a trained oracle adapter. The
tasks are ``lens_evals/activation_oracle_heldout`` and ``lens_evals/activation_oracle_secret_word``
(lens_evals/evals/activation_oracle/); this file holds those tasks.

    lens-evals oracle train                       # once: trains smollm2-135m-oracle (CPU, minutes)
    inspect eval tasks/activation_oracle.py@activation_oracle_heldout \\
        --model vllm-lens/smollm2-135m-instruct -M lora_modules=oracle=smollm2-135m-oracle
    inspect eval tasks/activation_oracle.py@activation_oracle_secret_word \\
        --model vllm-lens/smollm2-135m-instruct -M lora_modules=oracle=smollm2-135m-oracle

See tasks/README.md. Scores: the oracle's accuracy and its zero-vector baseline's, per family.
"""

from __future__ import annotations

from inspect_ai import Task, task

from lens_evals.evals.activation_oracle import activation_oracle_heldout as packaged_activation_oracle_heldout
from lens_evals.evals.activation_oracle import activation_oracle_secret_word as packaged_activation_oracle_secret_word
from lens_evals.inspect_kit.task_files import same_as


@task
@same_as(packaged_activation_oracle_heldout)
def activation_oracle_heldout() -> Task: ...


@task
@same_as(packaged_activation_oracle_secret_word)
def activation_oracle_secret_word() -> Task: ...
