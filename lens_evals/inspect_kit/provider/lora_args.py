"""Server flags for LoRA adapters, set so base-model and adapter requests can share batches.

``-M lora_modules=NAME=PATH`` (several: a list, or separated by spaces or commas) turns on
``--enable-lora`` and, unless given, ``--max-loras`` = adapters + 1 (one slot always free, so
vLLM's CPU ops never read a base row's index -1 as a full slot; the engine also replaces those
ops, see ``compat.lora.use_grouped_lora_ops``) and ``--max-lora-rank`` = the largest adapter rank.
PATH may be a trained oracle's name (``lens-evals oracle path NAME``)."""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

logger = logging.getLogger("lens_evals")
# the ranks vLLM accepts for --max-lora-rank
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def parse_lora_modules(value: Any) -> dict[str, str]:
    """``"a=/p b=/q"``, ``"a=/p,b=/q"`` or ``["a=/p", "b=/q"]`` -> {"a": "/p", "b": "/q"}."""
    entries = value if isinstance(value, (list, tuple)) else str(value).replace(",", " ").split()
    modules: dict[str, str] = {}
    for entry in entries:
        name, sep, path = str(entry).partition("=")
        if not sep or not name or not path:
            raise ValueError(f"lora_modules entry {entry!r} must be NAME=PATH")
        if name in modules:
            raise ValueError(f"lora_modules names {name!r} twice")
        modules[name] = path
    return modules


def resolve_adapter(path_or_name: str) -> Path:
    """A directory with ``adapter_config.json``, or a trained oracle's name."""
    candidate = Path(path_or_name).expanduser()
    if (candidate / "adapter_config.json").is_file():
        return candidate.resolve()
    from lens_evals.oracle.adapters import oracle_path

    return oracle_path(path_or_name).resolve()


def adapter_rank(adapter_dir: Path) -> int:
    with open(adapter_dir / "adapter_config.json", encoding="utf-8") as f:
        return int(json.load(f)["r"])


def check_base_model(name: str, adapter_dir: Path, model: str) -> None:
    """An oracle trained here (its ``card.json`` names ``base_model``) served on another model is
    refused: a same-shaped model loads it, and its answers then read nothing it learned."""
    card_file = adapter_dir / "card.json"
    if not card_file.is_file():
        return  # an adapter from elsewhere: its base is not recorded in a form we can compare
    base = json.loads(card_file.read_text(encoding="utf-8")).get("base_model")
    if base and Path(str(base)).name != Path(model).name:
        raise ValueError(f"-M lora_modules: adapter {name} ({adapter_dir}) was trained on {base}, not {Path(model).name}")


def lora_server_args(model_args: Mapping[str, Any], model: str | None = None) -> dict[str, Any]:
    """``model_args`` with the LoRA flags completed; unchanged when no ``lora_modules``. With
    ``model`` (the served model's name or directory), each oracle's base model is checked."""
    args = dict(model_args)
    if not args.get("lora_modules"):
        return args
    modules = {name: resolve_adapter(path) for name, path in parse_lora_modules(args["lora_modules"]).items()}
    for name, adapter_dir in modules.items():
        if model is not None:
            check_base_model(name, adapter_dir, model)
    args["lora_modules"] = [f"{name}={path}" for name, path in modules.items()]
    args["enable_lora"] = True
    args.setdefault("max_loras", len(modules) + 1)
    if int(args["max_loras"]) < len(modules) + 1:
        logger.warning(
            "lens_evals: max_loras=%s leaves no free adapter slot for %d adapters; without the lens "
            "engine's LoRA ops (LENS_EVALS_DISABLE=1) vLLM's CPU build gives base rows an adapter",
            args["max_loras"],
            len(modules),
        )
    if "max_lora_rank" not in args:
        rank = max(adapter_rank(path) for path in modules.values())
        args["max_lora_rank"] = next((r for r in VLLM_LORA_RANKS if r >= rank), rank)
    return args
