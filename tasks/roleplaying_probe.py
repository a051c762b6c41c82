"""Roleplaying deception probe: score every sample with a linear probe on the residual stream.
The task is ``lens_evals/roleplaying_probe`` (lens_evals/evals/roleplaying/); this file is that task
(default probes: ``LENS_EVALS_PROBE_DIR``, else this repository's probes/).

    inspect eval tasks/roleplaying_probe.py --model vllm-lens/smollm2-135m-instruct
    inspect eval tasks/roleplaying_probe.py --model vllm-lens/MODEL -T probe=probes/NAME.safetensors
    inspect eval tasks/roleplaying_probe.py --model vllm-lens/MODEL -T dataset=path/to/apollo/dataset.yaml
    inspect eval tasks/roleplaying_probe.py --model vllm-lens/MODEL -T mode=on_policy -T grader=openai/gpt-4o-mini
    inspect eval tasks/roleplaying_probe.py --model vllm-lens/MODEL -T probes=ip-lr,ip-dom,rp-lr -T probe_set=probes/MODEL__probe-set.json

See tasks/README.md. Metrics: AUROC, recall at the probe's 1%-FPR threshold, mean score per class.
"""

from __future__ import annotations

from inspect_ai import Task, task

from lens_evals.evals.roleplaying import roleplaying_probe as packaged_roleplaying_probe
from lens_evals.inspect_kit.task_files import same_as


@task
@same_as(packaged_roleplaying_probe)
def roleplaying_probe() -> Task: ...
