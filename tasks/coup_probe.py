"""Coup probe (Roger 2023): flag an agent's oversight-undermining actions with a linear probe.
The task is ``lens_evals/coup_probe`` (lens_evals/evals/coup/); this file runs it with the
default probe of this repository's probes/ folder.

    inspect eval tasks/coup_probe.py --model vllm-lens/smollm2-135m-instruct            # held-out coup intents
    inspect eval tasks/coup_probe.py --model vllm-lens/MODEL -T probe=probes/NAME.safetensors
    inspect eval tasks/coup_probe.py --model vllm-lens/MODEL -T trajectories=path/to/trajectories.jsonl

See tasks/README.md. Metrics: AUROC, recall at the probe's 1%-FPR threshold, mean score per class.
"""

from __future__ import annotations

import os
from pathlib import Path

from inspect_ai import Task, task

from lens_evals.evals.coup import coup_probe as packaged_task

PROBE_DIR = Path(os.environ.get("LENS_EVALS_PROBE_DIR", Path(__file__).resolve().parents[1] / "probes"))


@task
def coup_probe(
    probe: str | None = None,
    split: str = "held_out",
    trajectories: str | None = None,
    tokenizer: str | None = None,
    probe_dir: str | None = None,
) -> Task:
    """``lens_evals/coup_probe``; the default probe from ``probe_dir`` (default: LENS_EVALS_PROBE_DIR, else probes/)."""
    return packaged_task(probe=probe, split=split, trajectories=trajectories, tokenizer=tokenizer, probe_dir=probe_dir or str(PROBE_DIR))
