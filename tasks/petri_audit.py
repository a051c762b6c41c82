"""Petri alignment audit whose auditor can look inside the target (a vllm-lens model) with a
probe, an activation oracle, or both. The task is ``lens_evals/petri_audit``
(lens_evals/evals/petri_audit/); this file runs it with the default probe of this repository's
probes/ folder.

Run in the Python 3.12 venv (scripts/setup_petri.sh) against a lens server started from the main
venv with the oracle adapter and the target's tool-call parser (docs/integrations.md has the full
command):

    inspect eval tasks/petri_audit.py -T inspectors=probe,oracle -T oracle=ORACLE_DIR \
        --model-role auditor=PROVIDER/AUDITOR --model-role judge=PROVIDER/JUDGE \
        --model-role 'target={"model": "vllm-lens/smollm2-135m-instruct", "model_args": {"base_url": "http://127.0.0.1:8000/v1"}, "max_tokens": 128}'

``inspectors``: a comma list of ``probe`` and ``oracle`` (the first is the tool's default).
``probe`` defaults to probes/smollm2-135m-instruct__coup.safetensors (``lens-evals probes train --dataset
coup`` in the main venv); ``oracle`` is a trained oracle's directory (``lens-evals oracle path NAME``),
served by the target's server under the name ``oracle_lora``. See tasks/README.md.
"""

from __future__ import annotations

import os
from pathlib import Path

from inspect_ai import Task, task

from lens_evals.evals.petri_audit import petri_audit as packaged_task

PROBE_DIR = Path(os.environ.get("LENS_EVALS_PROBE_DIR", Path(__file__).resolve().parents[1] / "probes"))


@task
def petri_audit(
    inspectors: str = "probe",
    probe: str | None = None,
    oracle: str | None = None,
    oracle_lora: str = "oracle",
    seed_instructions: str | None = None,
    max_turns: int = 15,
    compaction: bool = False,
    target_tools: str = "synthetic",
    probe_dir: str | None = None,
) -> Task:
    """``lens_evals/petri_audit``; the default probe from ``probe_dir`` (default: LENS_EVALS_PROBE_DIR, else probes/)."""
    return packaged_task(
        inspectors=inspectors,
        probe=probe,
        oracle=oracle,
        oracle_lora=oracle_lora,
        seed_instructions=seed_instructions,
        max_turns=max_turns,
        compaction=compaction,
        target_tools=target_tools,
        probe_dir=probe_dir or str(PROBE_DIR),
    )
