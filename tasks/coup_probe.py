"""Coup probe (Roger 2023): flag an agent's oversight-undermining actions with a linear probe.

    inspect eval tasks/coup_probe.py --model vllm-lens/smollm2-135m-instruct            # held-out coup intents
    inspect eval tasks/coup_probe.py --model vllm-lens/MODEL -T probe=probes/NAME.joblib
    inspect eval tasks/coup_probe.py --model vllm-lens/MODEL -T trajectories=path/to/trajectories.jsonl

See tasks/README.md. Metrics: AUROC, recall at the probe's 1%-FPR threshold, mean score per class.
"""

from __future__ import annotations

import os
from pathlib import Path

from inspect_ai import Task, task

from lens_evals.evals.coup import coup_task

PROBE_DIR = Path(os.environ.get("LENS_EVALS_PROBE_DIR", Path(__file__).resolve().parents[1] / "probes"))


@task
def coup_probe(
    probe: str | None = None,
    split: str = "held_out",
    trajectories: str | None = None,
    tokenizer: str | None = None,
) -> Task:
    """``probe`` defaults to the default model's coup probe (trained if missing)."""
    if probe is None:
        from lens_evals.probing.train import ensure_default_probe

        os.environ.setdefault("LENS_EVALS_PROBE_DIR", str(PROBE_DIR))
        probe = str(ensure_default_probe(training_set="coup"))
    return coup_task(probe, split=split, trajectories=trajectories, tokenizer=tokenizer)  # type: ignore[arg-type]
