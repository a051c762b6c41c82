"""Petri alignment audit whose auditor can look inside the target (a vllm-lens model) with a probe,
an activation oracle, or both: ``inspect eval lens_evals/petri_audit`` (``tasks/petri_audit.py``
is the same task as a file). Runs in Petri's Python 3.12 venv (scripts/setup_petri.sh) against a
lens server started from the main venv; see this folder's README.md."""

from __future__ import annotations

from pathlib import Path

from inspect_ai import Task, task

from lens_evals import settings
from lens_evals.integrations.petri import OracleInspector, ProbeInspector, TurnInspector, target_activations
from lens_evals.probing.probe import PROBE_SUFFIX

INSPECTORS = ("probe", "oracle")
# The default model's coup probe (``lens-evals probes train --dataset coup``); named here, not through
# lens_evals.probing.train, which needs the engine's packages that Petri's client-only venv lacks.
DEFAULT_PROBE_FILE = f"smollm2-135m-instruct__coup{PROBE_SUFFIX}"


def build_inspectors(
    inspectors: str, probe: str | None, oracle: str | None, oracle_lora: str, probe_dir: str | Path | None = None
) -> list[TurnInspector]:
    names = [name.strip() for name in inspectors.split(",") if name.strip()]
    unknown = sorted(set(names) - set(INSPECTORS))
    if not names or unknown:
        raise ValueError(f"inspectors must be a comma list of {list(INSPECTORS)}, got {inspectors!r}")
    if "oracle" in names and not oracle:
        raise ValueError("the oracle inspector needs -T oracle=ORACLE_DIR (`.venv/bin/lens-evals oracle path NAME`)")
    directory = Path(probe_dir) if probe_dir else settings.PROBE_DIR.get()
    built: list[TurnInspector] = []
    for name in names:
        if name == "probe":
            built.append(ProbeInspector(Path(probe) if probe else directory / DEFAULT_PROBE_FILE))
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
    probe_dir: str | None = None,
) -> Task:
    """Petri's ``audit`` with the ``target_activations`` auditor tool. ``inspectors``: a comma list of
    ``probe`` and ``oracle`` (the first is the tool's default). ``probe`` defaults to the default
    model's coup probe in ``probe_dir`` (default: ``LENS_EVALS_PROBE_DIR``, else the repository's ``probes/``);
    ``oracle`` is a trained oracle's directory, served by the target's server as ``oracle_lora``.
    ``compaction`` is off by default: it counts tokens with tiktoken, whose encoding is downloaded
    at run time."""
    from inspect_petri import audit

    tool = target_activations(inspector=build_inspectors(inspectors, probe, oracle, oracle_lora, probe_dir))
    audit_task: Task = audit(  # inspect_petri is only in Petri's venv: Any to mypy here
        seed_instructions=seed_instructions, max_turns=max_turns, compaction=compaction, target_tools=target_tools, extra_tools=[tool]
    )
    return audit_task
