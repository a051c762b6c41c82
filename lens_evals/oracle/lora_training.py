"""Train an activation oracle: a peft LoRA on the target model itself that answers questions
about activations injected at placeholder tokens.

Activations come from this package's vLLM engine (so training reads what inference reads);
the LoRA trains in HF transformers, with a forward hook at the injection layer applying the
engine's formula ``h + c * ||h|| * v / ||v||`` (:func:`lens_evals.oracle.prompt.inject`).
Sequences are left-padded so the answer tokens sit at the end and only those logits are
computed; positions are passed explicitly so RoPE and the placeholder positions match the
engine's."""

from __future__ import annotations

import logging
import math
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from pydantic import BaseModel, Field

from lens_evals.oracle.inference import OracleSettings, oracle_prompt_ids
from lens_evals.oracle.prompt import inject
from lens_evals.oracle.qa_items import FAMILIES, OracleItem

logger = logging.getLogger("lens_evals")
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


class OracleTrainConfig(BaseModel):
    """Everything that defines a trained oracle; stored in its card."""

    base_model: str = "smollm2-135m-instruct"
    target_layer: int = 15
    injection_layer: int = 1
    num_tokens: int | None = 12
    placeholder: str = " ?"
    coefficient: float = 1.0
    families: list[str] = Field(default_factory=lambda: list(FAMILIES))
    train_per_family: int = 100
    eval_per_family: int = 40
    epochs: int = 1
    batch_size: int = 8
    learning_rate: float = 1e-3
    warmup_steps: int = 5
    lora_rank: int = 16
    lora_alpha: int = 32
    lora_targets: list[str] = Field(default_factory=lambda: list(LORA_TARGETS))
    seed: int = 0

    def settings(self) -> OracleSettings:
        return OracleSettings(self.target_layer, self.injection_layer, self.num_tokens, self.placeholder, self.coefficient)


@dataclass
class TrainExample:
    input_ids: list[int]
    num_answer: int  # the last num_answer tokens are the answer (and end of turn)
    positions: list[int]  # placeholder positions in input_ids
    vectors: np.ndarray  # (K, hidden)


def build_examples(
    tokenizer: Any, items: Sequence[OracleItem], activations: Sequence[np.ndarray], settings: OracleSettings
) -> list[TrainExample]:
    end_of_turn = int(tokenizer.eos_token_id)  # where vLLM stops (SmolLM2: <|im_end|>)
    examples = []
    for item, acts in zip(items, activations):
        prompt, positions = oracle_prompt_ids(tokenizer, settings, acts.shape[0], item.question)
        answer = tokenizer.encode(item.answer, add_special_tokens=False) + [end_of_turn]
        examples.append(TrainExample(prompt + answer, len(answer), positions, acts))
    return examples


def collate(examples: Sequence[TrainExample], pad_id: int) -> dict[str, torch.Tensor]:
    """Split off the prompt prefix every example shares (chat template up to the first
    placeholder: it is computed once per batch) and left-pad the rest. Positions count from
    each sequence's first token, as in the engine."""
    prefix_len = min(e.positions[0] for e in examples)
    prefix = examples[0].input_ids[:prefix_len]
    if any(e.input_ids[:prefix_len] != prefix for e in examples):
        raise ValueError("oracle prompts in one batch must share the text before the placeholders (same layer)")
    suffixes = [e.input_ids[prefix_len:] for e in examples]
    length = max(len(s) for s in suffixes)
    max_k = max(len(e.positions) for e in examples)
    batch = len(examples)
    input_ids = torch.full((batch, length), pad_id, dtype=torch.long)
    attention = torch.zeros((batch, length), dtype=torch.long)
    positions = torch.full((batch, max_k), -1, dtype=torch.long)
    vectors = torch.zeros((batch, max_k, examples[0].vectors.shape[-1]))
    answer_mask = torch.zeros((batch, length), dtype=torch.bool)
    for row, (example, suffix) in enumerate(zip(examples, suffixes)):
        pad = length - len(suffix)
        input_ids[row, pad:] = torch.tensor(suffix)
        attention[row, pad:] = 1
        positions[row, : len(example.positions)] = torch.tensor(example.positions) - prefix_len + pad
        vectors[row, : len(example.positions)] = torch.from_numpy(example.vectors)
        answer_mask[row, length - example.num_answer :] = True
    position_ids = prefix_len + (attention.cumsum(-1) - 1).clamp_min(0)
    return {
        "prefix_ids": torch.tensor([prefix]),
        "input_ids": input_ids,
        "attention_mask": attention,
        "position_ids": position_ids,
        "inject_positions": positions,
        "inject_vectors": vectors,
        "answer_mask": answer_mask,
    }


class InjectionHook:
    """Forward hook on the injection layer; the batch's vectors are set before each forward."""

    def __init__(self, coefficient: float) -> None:
        self.coefficient = coefficient
        self.positions: torch.Tensor | None = None
        self.vectors: torch.Tensor | None = None

    def __call__(self, module: Any, args: Any, output: Any) -> Any:
        if self.positions is None:
            return None
        hidden = output[0] if isinstance(output, tuple) else output
        steered = inject(hidden, self.positions, self.vectors, self.coefficient)
        return (steered, *output[1:]) if isinstance(output, tuple) else steered


def decoder_layers(model: Any) -> Any:
    """The HF decoder layers of a (peft-wrapped) causal LM."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return base.model.layers


def answer_loss(model: Any, batch: dict[str, torch.Tensor], hook: InjectionHook) -> torch.Tensor:
    """Cross-entropy on the answer tokens. The shared prefix runs once (its KV cache, with
    gradients, is repeated over the batch); logits only for the positions that predict answers."""
    answer_mask = batch["answer_mask"]
    rows, prefix_len = answer_mask.shape[0], batch["prefix_ids"].shape[1]
    prefix = model(input_ids=batch["prefix_ids"], use_cache=True, logits_to_keep=1)
    cache = prefix.past_key_values
    cache.batch_repeat_interleave(rows)
    keep = int(answer_mask.sum(-1).max()) + 1
    attention = torch.cat([torch.ones((rows, prefix_len), dtype=torch.long, device=answer_mask.device), batch["attention_mask"]], dim=1)
    hook.positions, hook.vectors = batch["inject_positions"], batch["inject_vectors"]
    try:
        logits = model(
            input_ids=batch["input_ids"],
            attention_mask=attention,
            position_ids=batch["position_ids"],
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=keep,
        ).logits
    finally:
        hook.positions = hook.vectors = None
    targets = batch["input_ids"][:, -keep + 1 :]
    mask = answer_mask[:, -keep + 1 :]
    return torch.nn.functional.cross_entropy(logits[:, :-1][mask], targets[mask])


def train_lora(
    model_dir: str, examples: list[TrainExample], config: OracleTrainConfig, pad_id: int, device: str = "cpu"
) -> tuple[Any, list[float]]:
    """Train the adapter; returns the peft model (on the CPU) and the per-step losses."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, get_linear_schedule_with_warmup

    torch.manual_seed(config.seed)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    lora = LoraConfig(
        r=config.lora_rank,
        lora_alpha=config.lora_alpha,
        target_modules=list(config.lora_targets),
        lora_dropout=0.0,
        bias="none",
        task_type="CAUSAL_LM",
    )
    model = get_peft_model(base, lora).to(device)
    model.train()
    hook = InjectionHook(config.coefficient)
    handle = decoder_layers(model)[config.injection_layer].register_forward_hook(hook)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=config.learning_rate, weight_decay=0.0)
    steps_per_epoch = math.ceil(len(examples) / config.batch_size)
    total = steps_per_epoch * config.epochs
    schedule = get_linear_schedule_with_warmup(optimizer, min(config.warmup_steps, total), total)
    rng = random.Random(config.seed)
    losses: list[float] = []
    started = time.monotonic()
    try:
        for epoch in range(config.epochs):
            order = rng.sample(range(len(examples)), len(examples))
            for step in range(steps_per_epoch):
                chunk = [examples[i] for i in order[step * config.batch_size : (step + 1) * config.batch_size]]
                batch = {key: value.to(device) for key, value in collate(chunk, pad_id).items()}
                loss = answer_loss(model, batch, hook)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(params, 1.0)
                optimizer.step()
                schedule.step()
                optimizer.zero_grad(set_to_none=True)
                losses.append(float(loss.detach()))
                if step % 10 == 0 or step == steps_per_epoch - 1:
                    logger.warning(
                        "oracle train: epoch %d step %d/%d loss %.3f (%.0f s)",
                        epoch,
                        step + 1,
                        steps_per_epoch,
                        float(np.mean(losses[-10:])),
                        time.monotonic() - started,
                    )
    finally:
        handle.remove()
    model.eval()
    return model.to("cpu"), losses
