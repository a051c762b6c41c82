"""Petri alignment audit whose auditor can look inside the target (a vllm-lens model) with a probe.

Run in the Python 3.12 venv (scripts/setup_petri.sh) against a lens server started from the main venv:

    inspect eval tasks/petri_audit.py \
        --model-role auditor=PROVIDER/AUDITOR --model-role judge=PROVIDER/JUDGE \
        --model-role 'target={"model": "vllm-lens/smollm2-135m-instruct", "model_args": {"base_url": "http://127.0.0.1:8000/v1"}, "max_tokens": 128}'

See tasks/README.md. ``probe`` defaults to probes/smollm2-135m-instruct__coup.joblib (train it in the
main venv with ``lens-evals probes train --dataset coup``).
"""

from __future__ import annotations

import os
from pathlib import Path

from inspect_ai import Task, task

from lens_evals.integrations.petri import target_activations

PROBE_DIR = Path(os.environ.get("LENS_EVALS_PROBE_DIR", Path(__file__).resolve().parents[1] / "probes"))


@task
def petri_audit(
    probe: str | None = None,
    seed_instructions: str | None = None,
    max_turns: int = 15,
    compaction: bool = False,
    target_tools: str = "synthetic",
) -> Task:
    """Petri's ``audit`` with the ``target_activations`` auditor tool. ``compaction`` is off by
    default: it counts tokens with tiktoken, whose encoding is downloaded at run time."""
    from inspect_petri import audit

    probe_path = Path(probe) if probe else PROBE_DIR / "smollm2-135m-instruct__coup.joblib"
    return audit(seed_instructions=seed_instructions, max_turns=max_turns, compaction=compaction,
                 target_tools=target_tools, extra_tools=[target_activations(probe=probe_path)])  # type: ignore[arg-type]
