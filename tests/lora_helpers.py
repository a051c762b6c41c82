"""Random peft adapters for tests: strong enough to change greedy tokens."""

from __future__ import annotations

from pathlib import Path

import torch


def random_adapter(base: Path, out: Path, seed: int, targets: list[str]) -> Path:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32),
                           LoraConfig(r=8, lora_alpha=16, target_modules=targets, init_lora_weights=False))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.normal_(0.0, 0.3)  # large enough to change greedy tokens
    model.save_pretrained(str(out))
    return out
