"""Roleplaying deception probe: score every sample with a linear probe on the residual stream.
The task is ``lens_evals/roleplaying_probe`` (lens_evals/evals/roleplaying/); this file runs it
with the default probes of this repository's probes/ folder.

    inspect eval tasks/roleplaying_probe.py --model vllm-lens/smollm2-135m-instruct
    inspect eval tasks/roleplaying_probe.py --model vllm-lens/MODEL -T probe=probes/NAME.safetensors
    inspect eval tasks/roleplaying_probe.py --model vllm-lens/MODEL -T dataset=path/to/apollo/dataset.yaml
    inspect eval tasks/roleplaying_probe.py --model vllm-lens/MODEL -T mode=on_policy -T grader=openai/gpt-4o-mini
    inspect eval tasks/roleplaying_probe.py --model vllm-lens/MODEL -T probes=ip-lr,ip-dom,rp-lr -T probe_set=probes/MODEL__probe-set.json

See tasks/README.md. Metrics: AUROC, recall at the probe's 1%-FPR threshold, mean score per class.
"""

from __future__ import annotations

import os
from pathlib import Path

from inspect_ai import Task, task

from lens_evals.evals.roleplaying import roleplaying_probe as packaged_task

PROBE_DIR = Path(os.environ.get("LENS_EVALS_PROBE_DIR", Path(__file__).resolve().parents[1] / "probes"))


@task
def roleplaying_probe(
    probe: str | None = None,
    mode: str = "off_policy",
    dataset: str | None = None,
    grader: str | None = None,
    tokenizer: str | None = None,
    max_tokens: int = 48,
    on_worker: bool = True,
    probes: str | None = None,
    probe_set: str | None = None,
    probe_dir: str | None = None,
) -> Task:
    """``lens_evals/roleplaying_probe``; default probes from ``probe_dir`` (default: LENS_EVALS_PROBE_DIR, else probes/)."""
    return packaged_task(
        probe=probe,
        mode=mode,
        dataset=dataset,
        grader=grader,
        tokenizer=tokenizer,
        max_tokens=max_tokens,
        on_worker=on_worker,
        probes=probes,
        probe_set=probe_set,
        probe_dir=probe_dir or str(PROBE_DIR),
    )
