"""The package root and names: ``import lens_evals`` imports nothing heavy, every name it exports
resolves to where it is defined, and the client side of it needs neither vllm nor torch; one
``data_file``; no module of oracle/ or probing/ shares its name with a module elsewhere."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import lens_evals

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "lens_evals"
CLIENT_NAMES = [
    "SteeringVector",
    "LinearProbe",
    "Hook",
    "LensRequest",
    "parse_lens_args",
    "lens_xargs",
    "LensClient",
    "activations_from_response",
    "CAPTURE_KEY",
    "PROBE_KEY",
    "STEERING_KEY",
    "serialize_tensor",
    "deserialize_tensor",
    "serialize_activations",
    "decode_activations",
    "serialize_hook_results",
    "deserialize_hook_results",
]


def loaded_after(code: str) -> set[str]:
    """Top-level modules loaded by ``code`` in a fresh interpreter."""
    script = f"import sys\n{code}\nimport json; print(json.dumps(sorted({{m.split('.')[0] for m in sys.modules}})))"
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, check=True)
    return set(json.loads(out.stdout.splitlines()[-1]))


def test_import_lens_evals_is_light() -> None:
    loaded = loaded_after("import lens_evals")
    assert not loaded & {"vllm", "torch", "numpy", "pydantic", "safetensors"}, sorted(loaded)


def test_the_client_names_need_neither_vllm_nor_torch() -> None:
    loaded = loaded_after(f"from lens_evals import {', '.join(CLIENT_NAMES)}")
    assert "lens_evals" in loaded and not loaded & {"vllm", "torch"}


def test_every_export_resolves_to_its_definition() -> None:
    assert sorted(lens_evals.__all__) == sorted(lens_evals._EXPORTS)
    for name in lens_evals.__all__:
        value = getattr(lens_evals, name)
        if hasattr(value, "__module__") and not isinstance(value, str):
            assert value.__module__ == lens_evals._EXPORTS[name], name
        assert name in dir(lens_evals)
    assert lens_evals.HookContext.__name__ == "HookContext" and issubclass(lens_evals.LensRequestError, Exception)


def test_unknown_names_and_submodules() -> None:
    try:
        lens_evals.no_such_name  # noqa: B018
    except AttributeError as exc:
        assert "no_such_name" in str(exc)
    else:
        raise AssertionError("an unknown name must raise AttributeError")
    from lens_evals import settings
    from lens_evals.wire import formats as wire

    assert wire.__name__ == "lens_evals.wire.formats" and settings.__name__ == "lens_evals.settings"


def test_one_data_file() -> None:
    defined = [
        f"{path.relative_to(PACKAGE)}"
        for path in PACKAGE.rglob("*.py")
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
        if isinstance(node, ast.FunctionDef) and node.name == "data_file"
    ]
    assert defined == ["data/__init__.py"]


def test_oracle_and_probing_module_names_are_their_own() -> None:
    where: dict[str, set[str]] = defaultdict(set)
    for path in PACKAGE.rglob("*.py"):
        if path.name != "__init__.py":
            where[path.stem].add(path.parent.relative_to(PACKAGE).as_posix())
    shared = {stem: sorted(dirs) for stem, dirs in where.items() if len(dirs) > 1 and dirs & {"oracle", "probing"}}
    assert not shared, shared
