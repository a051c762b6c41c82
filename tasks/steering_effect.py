"""Steering eval: a dose-response sweep of a contrastive steering vector over layers and scales.
The task is ``lens_evals/steering_effect`` (lens_evals/evals/steering_effect/).

    inspect eval tasks/steering_effect.py --model vllm-lens/smollm2-135m-instruct
    inspect eval tasks/steering_effect.py --model vllm-lens/MODEL -T concept=honesty -T layers=8,15 -T scales=0,4,8

See tasks/README.md. Scores per sample: logprob_diff, word_balance, perplexity; `lens-evals report LOG` draws the curves.
"""

from __future__ import annotations

from inspect_ai import Task, task

from lens_evals.evals.steering_effect import steering_effect as packaged_steering_effect
from lens_evals.inspect_kit.task_files import same_as


@task
@same_as(packaged_steering_effect)
def steering_effect() -> Task: ...
