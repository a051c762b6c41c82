"""Models: the embedded ones (``registry``: names, preparation, ``model_path``), their GGUF parts
(``gguf``) and pins (``pins``), and what this machine has (``lookup``).

``from lens_evals.models import model_path`` (the path the docs gave before #44) still works,
loaded on first use."""

from __future__ import annotations

from typing import Any


def __getattr__(name: str) -> Any:
    if name == "model_path":
        from lens_evals.models.registry import model_path

        return model_path
    raise AttributeError(f"module 'lens_evals.models' has no attribute {name!r}")
