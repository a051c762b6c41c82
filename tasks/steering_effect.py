"""Steering eval: a dose-response sweep of a contrastive steering vector over layers and scales.
The task is ``lens_evals/steering_effect`` (lens_evals/evals/steering_effect/).

    inspect eval tasks/steering_effect.py --model vllm-lens/smollm2-135m-instruct
    inspect eval tasks/steering_effect.py --model vllm-lens/MODEL -T concept=honesty -T layers=8,15 -T scales=0,4,8

See tasks/README.md. Scores per sample: logprob_diff, word_balance, perplexity; `lens-evals report LOG` draws the curves.
"""

from __future__ import annotations

from inspect_ai import Task, task

from lens_evals.evals.steering_effect import steering_effect as packaged_task


@task
def steering_effect(
    concept: str = "sentiment",
    layers: str = "6,12,18",
    scales: str = "0,2,4,6,8",
    prompts: int = 20,
    max_tokens: int = 24,
    vector: str | None = None,
    dataset: str | None = None,
) -> Task:
    """``lens_evals/steering_effect``: the same task (its options are listed in tasks/README.md)."""
    return packaged_task(
        concept=concept, layers=layers, scales=scales, prompts=prompts, max_tokens=max_tokens, vector=vector, dataset=dataset
    )
