"""Trained oracles on disk: ``~/.cache/lens-evals/oracles/<name>/`` holds the peft adapter
(``adapter_config.json``, ``adapter_model.safetensors``) and ``card.json`` (what it was trained
on, how, and its held-out accuracy). ``LENS_EVALS_ORACLE_DIR`` moves the cache.

Adapters are not committed: ``lens-evals oracle train`` makes one in minutes on a CPU."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from lens_evals import settings
from lens_evals.oracle.lora_training import OracleTrainConfig

CARD_NAME = "card.json"
ADAPTER_CONFIG = "adapter_config.json"
DEFAULT_ORACLE = "smollm2-135m-oracle"
# Named recipes: `lens-evals oracle train --name NAME` trains one of these.
SMALL_ORACLE = "smollm2-135m-oracle-small"
RECIPES: dict[str, OracleTrainConfig] = {
    DEFAULT_ORACLE: OracleTrainConfig(),
    # the least that still reads the activations (the Petri audit test trains it): the three families
    # this oracle learns best, 192 items, 24 steps, rank 8; docs/oracles.md has its numbers
    SMALL_ORACLE: OracleTrainConfig(
        families=["sentiment", "topic", "word"],
        train_per_family=64,
        eval_per_family=10,
        learning_rate=2e-3,
        warmup_steps=3,
        lora_rank=8,
        lora_alpha=16,
    ),
}


def oracle_root() -> Path:
    return settings.ORACLE_DIR.get()


def is_oracle_dir(path: Path) -> bool:
    return (path / ADAPTER_CONFIG).is_file() and (path / CARD_NAME).is_file()


def oracle_path(name_or_path: str) -> Path:
    """The directory of a trained oracle: a cache name or a directory with adapter and card."""
    candidate = Path(name_or_path).expanduser()
    if candidate.is_dir() and is_oracle_dir(candidate):
        return candidate
    cached = oracle_root() / name_or_path
    if is_oracle_dir(cached):
        return cached
    hint = f"`lens-evals oracle train --name {name_or_path}`" if name_or_path in RECIPES else f"one of {sorted(RECIPES)}"
    raise FileNotFoundError(f"no trained oracle {name_or_path!r} (looked in {cached}); train it with {hint}")


def read_card(name_or_path: str) -> dict[str, Any]:
    path = oracle_path(name_or_path) / CARD_NAME
    try:
        card: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError
        raise ValueError(f"{path}: not a JSON oracle card ({exc})") from None
    return card


def write_card(directory: Path, card: dict[str, Any]) -> Path:
    path = directory / CARD_NAME
    path.write_text(json.dumps(card, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return path


def adapter_rank(directory: Path) -> int:
    with open(directory / ADAPTER_CONFIG, encoding="utf-8") as f:
        return int(json.load(f)["r"])
