"""``lens-evals oracle train``: capture, train, save, evaluate, write the card.

One in-process engine (LoRA enabled) captures the training activations, and after training
serves the new adapter for the held-out evaluation."""

from __future__ import annotations

import datetime
import logging
import shutil
import time
from pathlib import Path
from typing import Any

from lens_evals.engine.frontend.offline import engine_for, open_offline_engine
from lens_evals.oracle.adapters import oracle_root, write_card
from lens_evals.oracle.lora_training import OracleTrainConfig, build_examples, train_lora
from lens_evals.oracle.qa_items import HELDOUT_EVERY, all_items, sample_mix

logger = logging.getLogger("lens_evals")


def oracle_engine_args(lora_rank: int, max_model_len: int = 1024, engine_args: dict[str, Any] | None = None) -> dict[str, Any]:
    """:func:`open_offline_engine`'s arguments for an in-process engine that serves one adapter
    beside the base model (``engine_args`` win)."""
    options = {
        "kv_cache_gib": 1,
        "in_process": True,
        "dtype": "float32",
        "max_model_len": max_model_len,
        "enable_lora": True,
        "max_loras": 2,
        "max_lora_rank": max(lora_rank, 8),
    }
    return {**options, **(engine_args or {})}


def start_engine(model_dir: str, lora_rank: int, max_model_len: int = 1024) -> Any:
    """An in-process engine that serves one adapter beside the base model."""
    return open_offline_engine(model_dir, **oracle_engine_args(lora_rank, max_model_len))


def build_oracle(
    name: str, config: OracleTrainConfig, out_dir: Path | None = None, engine_args: dict[str, Any] | None = None
) -> tuple[Path, dict[str, Any]]:
    """Train the oracle ``name`` into ``out_dir`` (default: the oracle cache); return it and its
    card. ``engine_args``: extra vLLM arguments for its engine."""
    import torch
    from transformers import AutoTokenizer
    from vllm.lora.request import LoRARequest

    from lens_evals.models.registry import resolve_model
    from lens_evals.oracle.evaluate import evaluate_offline
    from lens_evals.oracle.inference import capture_conversations

    target = out_dir or oracle_root() / name
    model_dir = resolve_model(config.base_model)
    items = all_items()
    train_items = sample_mix(items, "train", config.train_per_family, config.seed, config.families)
    eval_items = sample_mix(items, "heldout", config.eval_per_family, config.seed + 1, config.families)
    settings = config.settings()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    timings: dict[str, float] = {}
    threads = torch.get_num_threads()
    with engine_for(model_dir, engine_args=oracle_engine_args(config.lora_rank, engine_args=engine_args)) as llm:
        started = time.monotonic()
        activations = capture_conversations(
            llm, [[{"role": "user", "content": i.context}] for i in train_items], config.target_layer, config.num_tokens
        )
        timings["capture_s"] = time.monotonic() - started
        torch.set_num_threads(threads)  # the CPU engine may rebind threads; training uses them all
        examples = build_examples(tokenizer, train_items, activations, settings)
        started = time.monotonic()
        model, losses = train_lora(model_dir, examples, config, pad_id=int(tokenizer.pad_token_id or tokenizer.eos_token_id))
        timings["train_s"] = time.monotonic() - started
        partial = target.with_name(target.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        model.save_pretrained(str(partial))
        started = time.monotonic()
        result = evaluate_offline(llm, tokenizer, LoRARequest(name, 1, str(partial)), settings, eval_items)
        timings["eval_s"] = time.monotonic() - started
    card = {
        "name": name,
        "base_model": config.base_model,
        "config": config.model_dump(),
        "oracle": {
            "target_layer": config.target_layer,
            "injection_layer": config.injection_layer,
            "num_tokens": config.num_tokens,
            "placeholder": config.placeholder,
            "coefficient": config.coefficient,
        },
        "data": {
            "train_items": len(train_items),
            "heldout_items": len(eval_items),
            "split": f"every {HELDOUT_EVERY}th group (hash order) of each family and answer is held out; never trained on",
        },
        "train": {
            "steps": len(losses),
            "first_loss": losses[0],
            "last_losses_mean": sum(losses[-10:]) / min(10, len(losses)),
            "threads": threads,
        },
        "heldout": result,
        "timings_s": {k: round(v, 1) for k, v in timings.items()},
        "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }
    write_card(partial, card)
    shutil.rmtree(target, ignore_errors=True)
    partial.rename(target)
    return target, card
