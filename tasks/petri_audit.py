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

from inspect_ai import Task, task

from lens_evals.evals.petri_audit import petri_audit as packaged_petri_audit
from lens_evals.inspect_kit.task_files import same_as


@task
@same_as(packaged_petri_audit)
def petri_audit() -> Task: ...
