"""Coup probe (Roger 2023): flag an agent's oversight-undermining actions with a linear probe.
The task is ``lens_evals/coup_probe`` (lens_evals/evals/coup/); this file runs it with the
default probe of this repository's probes/ folder.

    inspect eval tasks/coup_probe.py --model vllm-lens/smollm2-135m-instruct            # held-out coup intents
    inspect eval tasks/coup_probe.py --model vllm-lens/MODEL -T probe=probes/NAME.safetensors
    inspect eval tasks/coup_probe.py --model vllm-lens/MODEL -T trajectories=path/to/trajectories.jsonl

See tasks/README.md. Metrics: AUROC, recall at the probe's 1%-FPR threshold, mean score per class.
"""

from __future__ import annotations

from inspect_ai import Task, task

from lens_evals.evals.coup import coup_probe as packaged_coup_probe
from lens_evals.inspect_kit.task_files import same_as


@task
@same_as(packaged_coup_probe)
def coup_probe() -> Task: ...
