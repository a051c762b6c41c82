"""The public API, name by name: what ``from lens_evals import ...`` offers, the client module, the
command line's subcommands, the Inspect tasks and model API, and every name the docs, the README
and the examples tell users to import (read from those files, so a doc naming a name that is gone
fails here). The import paths the docs named before the restructuring (#44) still resolve, to the
same objects as their new homes."""

from __future__ import annotations

import importlib
import re
from pathlib import Path
from typing import Any

import pytest

import lens_evals

ROOT = Path(__file__).resolve().parent.parent
# Written out, not read from the package: removing a name from __all__ must fail here.
PACKAGE_NAMES = [
    "CAPTURE_KEY",
    "PROBE_KEY",
    "STEERING_KEY",
    "Hook",
    "HookContext",
    "HookSet",
    "LensClient",
    "LensRequest",
    "LensRequestError",
    "LinearProbe",
    "SteeringVector",
    "activations_from_response",
    "decode_activations",
    "deserialize_hook_results",
    "deserialize_tensor",
    "lens_xargs",
    "parse_lens_args",
    "register_hook_set",
    "serialize_activations",
    "serialize_hook_results",
    "serialize_tensor",
]
CLIENT_NAMES = ["LensClient", "VLLMLensClient", "activations_from_response", "lens_xargs", "decode_activations", "deserialize_tensor"]
SUBCOMMANDS = ["models", "demo", "probes", "roleplaying", "verify", "report", "bench", "capture", "oracle", "chat", "readouts"]
TASKS = ["activation_oracle_heldout", "activation_oracle_secret_word", "coup_probe", "petri_audit", "roleplaying_probe", "steering_effect"]
# Paths the docs gave before #44 -> where the name lives now.
OLD_PATHS = {
    "lens_evals.hooks.Hook": "lens_evals.request.hooks.Hook",
    "lens_evals.hooks.HookBounds": "lens_evals.request.hooks.HookBounds",
    "lens_evals.wire_frame.response_body": "lens_evals.wire.frame.response_body",
    "lens_evals.models.model_path": "lens_evals.models.registry.model_path",
    "lens_evals.provider.outputs.output_activations": "lens_evals.inspect_kit.provider.outputs.output_activations",
    "lens_evals.provider.outputs.output_prompt_logprobs": "lens_evals.inspect_kit.provider.outputs.output_prompt_logprobs",
    "lens_evals.evals.shared.lens_solvers.capture_activations": "lens_evals.inspect_kit.lens_solvers.capture_activations",
}
DOC_FILES = [
    ROOT / "README.md",
    ROOT / "tasks" / "README.md",
    *sorted((ROOT / "docs").glob("*.md")),
    *sorted((ROOT / "examples").glob("*.py")),
]
FROM_IMPORT = re.compile(r"^\s*from (lens_evals(?:\.\w+)*) import \(?([\w, ]+)", re.MULTILINE)
DOTTED = re.compile(r"`(lens_evals(?:\.\w+)+)`")


def resolve(dotted: str) -> Any:
    """The object a dotted name names: its longest importable module prefix, then attributes."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            value: Any = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError as exc:
            if exc.name is not None and not ".".join(parts[:cut]).startswith(exc.name):
                raise  # the module exists but one of its imports does not
            continue
        for attribute in parts[cut:]:
            value = getattr(value, attribute)
        return value
    raise ModuleNotFoundError(dotted)


def documented_names() -> list[str]:
    names: set[str] = set()
    for path in DOC_FILES:
        text = path.read_text(encoding="utf-8")
        for module, imported in FROM_IMPORT.findall(text):
            names.update(f"{module}.{name.strip()}" for name in imported.split(",") if name.strip())
        names.update(DOTTED.findall(text))
    return sorted(names)


def test_the_package_exports_every_documented_name() -> None:
    assert sorted(lens_evals.__all__) == sorted(PACKAGE_NAMES)
    namespace: dict[str, Any] = {}
    exec(f"from lens_evals import {', '.join(PACKAGE_NAMES)}", namespace)
    assert all(namespace[name] is not None for name in PACKAGE_NAMES)
    assert isinstance(lens_evals.__version__, str)


def test_the_client_module_keeps_its_names() -> None:
    client = importlib.import_module("lens_evals.client")
    assert [name for name in CLIENT_NAMES if not hasattr(client, name)] == []


def test_every_subcommand_is_listed() -> None:
    from lens_evals.cli import main
    from lens_evals.cli.app import build_parser

    assert callable(main)
    (subparsers,) = [a for a in build_parser()._actions if a.dest == "command"]
    assert list(subparsers.choices) == SUBCOMMANDS


def test_every_task_and_the_model_api_are_registered() -> None:
    from inspect_ai._util.registry import registry_lookup

    registry = importlib.import_module("lens_evals.evals._registry")  # what the inspect_ai entry point loads
    assert [name for name in TASKS if not callable(getattr(registry, name, None))] == []
    assert [name for name in TASKS if registry_lookup("task", f"lens_evals/{name}") is None] == []
    assert registry_lookup("modelapi", "lens_evals/vllm-lens") is not None


@pytest.mark.parametrize("dotted", documented_names())
def test_a_name_the_docs_give_resolves(dotted: str) -> None:
    resolve(dotted)


def test_the_docs_were_read() -> None:
    names = documented_names()
    assert "lens_evals.client.lens_xargs" in names and len(names) > 20, names


@pytest.mark.parametrize("old", sorted(OLD_PATHS))
def test_a_path_the_docs_gave_before_the_move_still_resolves(old: str) -> None:
    assert resolve(old) is resolve(OLD_PATHS[old])


def test_resolve_fails_on_a_missing_name() -> None:
    with pytest.raises(AttributeError):
        resolve("lens_evals.client.no_such_name")
    with pytest.raises(AttributeError):  # no module of that name: an attribute of lens_evals, missing too
        resolve("lens_evals.no_such_module.name")
    with pytest.raises(ModuleNotFoundError):
        resolve("no_such_package.name")
