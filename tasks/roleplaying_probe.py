"""Roleplaying deception probe: score every sample with a linear probe on the residual stream.

    inspect eval tasks/roleplaying_probe.py --model vllm-lens/smollm2-135m-instruct
    inspect eval tasks/roleplaying_probe.py --model vllm-lens/MODEL -T probe=probes/NAME.joblib
    inspect eval tasks/roleplaying_probe.py --model vllm-lens/MODEL -T dataset=path/to/apollo/dataset.yaml
    inspect eval tasks/roleplaying_probe.py --model vllm-lens/MODEL -T mode=on_policy -T grader=openai/gpt-4o-mini

See tasks/README.md. Metrics: AUROC, recall at the probe's 1%-FPR threshold, mean score per class.
"""

from __future__ import annotations

import os
from pathlib import Path

from inspect_ai import Task, task

from lens_evals.evals.roleplaying import roleplaying_task

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
) -> Task:
    """``probe`` defaults to the default model's Instructed-Pairs probe (trained if missing)."""
    if probe is None:
        from lens_evals.probing.train import ensure_default_probe

        os.environ.setdefault("LENS_EVALS_PROBE_DIR", str(PROBE_DIR))
        probe = str(ensure_default_probe())
    return roleplaying_task(probe, mode=mode, dataset=dataset, grader=grader, tokenizer=tokenizer,  # type: ignore[arg-type]
                            max_tokens=max_tokens, on_worker=on_worker)
