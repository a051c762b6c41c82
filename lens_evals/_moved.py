"""Import paths the docs gave before the restructuring (#44), kept as aliases of their new homes.

``import lens_evals.hooks`` (or ``lens_evals.provider.outputs``, ...) returns the very module now
at ``lens_evals.request.hooks`` (``lens_evals.inspect_kit.provider.outputs``): one module object,
so ``isinstance`` checks, registries and patches see one thing. Each use warns
(``DeprecationWarning``). Only paths the README, docs/ or examples/ named are here; the rest of
the old layout was never public. Installed by ``lens_evals/__init__.py``; stdlib only.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import warnings
from collections.abc import Sequence
from types import ModuleType

# old module (and everything under it) -> new module
MOVED = {
    "lens_evals.hooks": "lens_evals.request.hooks",
    "lens_evals.wire_frame": "lens_evals.wire.frame",
    "lens_evals.provider": "lens_evals.inspect_kit.provider",
    "lens_evals.evals.shared": "lens_evals.inspect_kit",
}


def new_name(old: str) -> str | None:
    """Where the module ``old`` lives now, or None if it did not move (or was never public)."""
    for before, after in MOVED.items():
        if old == before or old.startswith(before + "."):
            return after + old[len(before) :]
    return None


class MovedModuleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds an old name and loads it as the module at its new name (imported once, shared)."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        new = new_name(fullname)
        return None if new is None else importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        new = new_name(spec.name)
        assert new is not None  # find_spec answered for this name only
        warnings.warn(f"{spec.name} moved to {new} (lens-evals #44); import it from there", DeprecationWarning, stacklevel=2)
        module = importlib.import_module(new)
        self._specs[spec.name] = module.__spec__  # the import system overwrites it with the alias's spec
        return module

    def exec_module(self, module: ModuleType) -> None:
        module.__spec__ = self._specs.pop(module.__spec__.name if module.__spec__ else "", module.__spec__)

    def __init__(self) -> None:
        self._specs: dict[str, importlib.machinery.ModuleSpec | None] = {}


def install() -> None:
    """Put the finder on ``sys.meta_path`` once (before the path finders, which no longer find these)."""
    if not any(isinstance(finder, MovedModuleFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, MovedModuleFinder())
