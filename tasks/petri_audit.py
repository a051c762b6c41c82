"""Petri alignment audit whose auditor can look inside the target (a vllm-lens model) with a
probe, an activation oracle, or both.

Run in the Python 3.12 venv (scripts/setup_petri.sh) against a lens server started from the main
venv with the oracle adapter and the target's tool-call parser (docs/integrations.md has the full
command):

    inspect eval tasks/petri_audit.py -T inspectors=probe,oracle -T oracle=ORACLE_DIR \
        --model-role auditor=PROVIDER/AUDITOR --model-role judge=PROVIDER/JUDGE \
        --model-role 'target={"model": "vllm-lens/smollm2-135m-instruct", "model_args": {"base_url": "http://127.0.0.1:8000/v1"}, "max_tokens": 128}'

``inspectors``: a comma list of ``probe`` and ``oracle`` (the first is the tool's default).
``probe`` defaults to probes/smollm2-135m-instruct__coup.joblib (``lens-evals probes train --dataset
coup`` in the main venv); ``oracle`` is a trained oracle's directory (``lens-evals oracle path NAME``),
served by the target's server under the name ``oracle_lora``. See tasks/README.md.
"""

from __future__ import annotations

import os
from pathlib import Path

from inspect_ai import Task, task

from lens_evals.integrations.petri import OracleInspector, ProbeInspector, TurnInspector, target_activations

PROBE_DIR = Path(os.environ.get("LENS_EVALS_PROBE_DIR", Path(__file__).resolve().parents[1] / "probes"))
INSPECTORS = ("probe", "oracle")


def build_inspectors(inspectors: str, probe: str | None, oracle: str | None, oracle_lora: str) -> list[TurnInspector]:
    names = [name.strip() for name in inspectors.split(",") if name.strip()]
    unknown = sorted(set(names) - set(INSPECTORS))
    if not names or unknown:
        raise ValueError(f"inspectors must be a comma list of {list(INSPECTORS)}, got {inspectors!r}")
    if "oracle" in names and not oracle:
        raise ValueError("the oracle inspector needs -T oracle=ORACLE_DIR (`.venv/bin/lens-evals oracle path NAME`)")
    built: list[TurnInspector] = []
    for name in names:
        if name == "probe":
            built.append(ProbeInspector(Path(probe) if probe else PROBE_DIR / "smollm2-135m-instruct__coup.joblib"))
        else:
            built.append(OracleInspector.from_card(str(oracle), lora=oracle_lora))
    return built


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
) -> Task:
    """Petri's ``audit`` with the ``target_activations`` auditor tool. ``compaction`` is off by
    default: it counts tokens with tiktoken, whose encoding is downloaded at run time."""
    from inspect_petri import audit

    tool = target_activations(inspector=build_inspectors(inspectors, probe, oracle, oracle_lora))
    return audit(seed_instructions=seed_instructions, max_turns=max_turns, compaction=compaction,
                 target_tools=target_tools, extra_tools=[tool])  # type: ignore[arg-type]
