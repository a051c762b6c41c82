"""The evals as an installed package: every task resolves as ``lens_evals/<task>`` through the
``inspect_ai`` entry point from a directory with no files of this repository, loading the
registry needs neither torch nor vllm, and building a task changes no environment variable and
trains nothing (a missing default probe is an error that names the training command)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.report.test_report import random_probe

TASKS = {
    "lens_evals/activation_oracle_heldout",
    "lens_evals/activation_oracle_secret_word",
    "lens_evals/coup_probe",
    "lens_evals/petri_audit",
    "lens_evals/roleplaying_probe",
    "lens_evals/steering_effect",
}

RESOLVE = """
import importlib.metadata, json, os, sys
before = dict(os.environ)
(entry,) = [e for e in importlib.metadata.entry_points(group="inspect_ai") if e.name == "lens_evals"]
entry.load()
heavy = sorted(name for name in ("torch", "vllm") if name in sys.modules)
from inspect_ai._util.registry import registry_find, registry_info, registry_lookup
names = sorted(registry_info(t).name for t in registry_find(lambda info: info.type == "task"))
built, errors = {}, {}
for name, args in json.loads(sys.argv[1]):
    try:
        task = registry_lookup("task", name)(**args)
        built[name] = [task.name, len(task.dataset)]
    except Exception as exc:
        errors[name] = f"{type(exc).__name__}: {exc}"
print(json.dumps({"names": names, "heavy": heavy, "built": built, "errors": errors, "same_env": dict(os.environ) == before,
                  "provider": registry_lookup("modelapi", "lens_evals/vllm-lens") is not None}))
"""


def resolve(cwd: Path, calls: list[tuple[str, dict]], env: dict[str, str]) -> dict:
    result = subprocess.run(
        [sys.executable, "-c", RESOLVE, json.dumps(calls)], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_tasks_resolve_by_registry_name_and_build_without_side_effects(tmp_path, tiny_path) -> None:
    empty, probes = tmp_path / "elsewhere", tmp_path / "probes"
    empty.mkdir()
    probes.mkdir()
    probe = random_probe(tmp_path / "given")
    # the installed package's entry points, not the checkout's modules: the repository root off the
    # path (on the GPU machine the rest of PYTHONPATH is where the packages are installed)
    root = Path(__file__).resolve().parents[2]
    kept = [entry for entry in os.environ.get("PYTHONPATH", "").split(os.pathsep) if entry and Path(entry).resolve() != root]
    env = {**os.environ, "LENS_EVALS_PROBE_DIR": str(probes), "PYTHONPATH": os.pathsep.join(kept)}
    calls = [
        ("lens_evals/roleplaying_probe", {}),
        ("lens_evals/coup_probe", {}),
        ("lens_evals/roleplaying_probe", {"probe": str(probe), "tokenizer": str(tiny_path)}),
        ("lens_evals/steering_effect", {"layers": "1,2", "scales": "0,4", "prompts": 3}),
    ]
    out = resolve(empty, calls, env)
    assert set(out["names"]) == TASKS and out["provider"]
    assert out["heavy"] == [], "loading the registry imported torch / vllm (Petri's client-only venv has neither)"
    assert out["built"]["lens_evals/roleplaying_probe"] == ["roleplaying_off_policy", 288]  # 144 scenarios x 2
    assert out["built"]["lens_evals/steering_effect"] == ["steering_effect", 12]  # 3 items x 2 layers x 2 scales
    assert "lens-evals probes train --dataset coup" in out["errors"]["lens_evals/coup_probe"]
    assert out["errors"]["lens_evals/coup_probe"].startswith("FileNotFoundError") and str(probes) in out["errors"]["lens_evals/coup_probe"]
    assert out["same_env"], "building a task changed the environment"
    assert list(probes.iterdir()) == [] and list(empty.iterdir()) == [], "building a task wrote files (trained?)"
