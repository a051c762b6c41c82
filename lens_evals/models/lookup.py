"""Which models this machine has, asked before an engine starts: an embedded name, a directory or
file, or a hub id already in the local HF cache (nothing is downloaded); and a model's HF config.
Used by the command line's argument checks, the Inspect provider and the capture runner. No vllm,
no torch at import."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def known_models() -> list[str]:
    """The embedded model names (what :func:`lens_evals.models.registry.model_path` prepares)."""
    from lens_evals.models.registry import PREPARERS

    return sorted(PREPARERS)


def in_hub_cache(repo_id: str) -> bool:
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:  # a client-only install (the provider alone) has no hub cache to look in
        return False
    return isinstance(try_to_load_from_cache(repo_id, "config.json"), str)


def unknown_model(text: str) -> str | None:
    """Why ``text`` names no model here, or None: an embedded model name, a model directory (or
    file) that exists, or a hub id already in the local HF cache (nothing is downloaded)."""
    known = known_models()
    if text in known or Path(text).exists() or (text.count("/") == 1 and in_hub_cache(text)):
        return None
    return f"unknown model {text!r}; expected one of {', '.join(known)}, a model directory or a hub id in the local cache"


def model_config(model: str) -> dict[str, Any] | None:
    """The model's HF config (its text model's, for a model with one), or None where there is no
    ``config.json`` to read (a GGUF file, a hub id): the engine then checks alone."""
    from lens_evals.models.registry import resolve_model

    config_file = Path(resolve_model(model)) / "config.json"
    if not config_file.is_file():
        return None
    config: dict[str, Any] = json.loads(config_file.read_text(encoding="utf-8"))
    text_config = config.get("text_config")
    return text_config if isinstance(text_config, dict) and "num_hidden_layers" in text_config else config
