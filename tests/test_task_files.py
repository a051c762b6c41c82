"""The repository's ``tasks/*.py``: each file's tasks are the registered ``lens_evals/<task>``
ones (same signature, same task built from the same arguments), and Inspect finds and runs them
as files (``inspect eval tasks/x.py@task``). No engine."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest
from inspect_ai._eval.loader import code_has_task, load_tasks
from inspect_ai._util.registry import registry_lookup
from inspect_ai.model import ChatMessage

import lens_evals.evals._registry  # noqa: F401  (registers lens_evals/<task>, as the entry point does)

TASKS_DIR = Path(__file__).resolve().parents[1] / "tasks"


def file_tasks() -> list[tuple[Path, str]]:
    found = []
    for path in sorted(TASKS_DIR.glob("*.py")):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.FunctionDef) and any(ast.unparse(d) == "task" for d in node.decorator_list):
                found.append((path, node.name))
    return found


def test_every_registered_task_has_its_file() -> None:
    names = {name for _, name in file_tasks()}
    assert names == {
        "activation_oracle_heldout",
        "activation_oracle_secret_word",
        "coup_probe",
        "petri_audit",
        "roleplaying_probe",
        "steering_effect",
    }
    assert all(code_has_task(path.read_text()) for path, _ in file_tasks())


@pytest.mark.parametrize(("path", "name"), file_tasks(), ids=lambda v: v.name if isinstance(v, Path) else v)
def test_a_file_task_has_the_registered_signature(path: Path, name: str) -> None:
    namespace: dict[str, object] = {}
    exec(compile(path.read_text(), str(path), "exec"), namespace)
    assert inspect.signature(namespace[name]) == inspect.signature(registry_lookup("task", f"lens_evals/{name}"))


def test_a_file_task_builds_the_registered_task() -> None:
    args = {"layers": "1,2", "scales": "0,4", "prompts": 3}
    (from_file,) = load_tasks([f"{TASKS_DIR / 'steering_effect.py'}@steering_effect"], args)
    registered = registry_lookup("task", "lens_evals/steering_effect")(**args)
    assert len(from_file.dataset) == len(registered.dataset) == 12  # 3 items x 2 layers x 2 scales
    assert from_file.name == registered.name == "steering_effect"
    assert [(text(s.input), s.metadata) for s in from_file.dataset] == [(text(s.input), s.metadata) for s in registered.dataset]


def text(sample_input: str | list[ChatMessage]) -> list[str]:
    return [sample_input] if isinstance(sample_input, str) else [message.text for message in sample_input]
