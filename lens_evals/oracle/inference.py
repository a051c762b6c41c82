"""The oracle with vLLM's offline ``LLM`` and this package's engine: capture a target's
residual stream, then generate with the oracle adapter while injecting it.

Training activations come from here too, so training and inference read the same numbers."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from lens_evals.oracle.prompt import oracle_messages, placeholder_positions, placeholder_token_id, select_positions
from lens_evals.request.spec import CAPTURE_KEY, STEERING_KEY, SteeringVector
from lens_evals.request.wire_model import float32_array


@dataclass(frozen=True)
class OracleSettings:
    target_layer: int
    injection_layer: int = 1
    num_tokens: int | None = None  # None: all positions
    placeholder: str = " ?"
    coefficient: float = 1.0


def capture_conversations(llm: Any, conversations: Sequence[list[dict[str, str]]], layer: int, num_tokens: int | None) -> list[np.ndarray]:
    """The residual stream after ``layer`` on each conversation's prompt (chat template and
    generation prompt included): (positions, hidden), all or the last ``num_tokens``."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0.0, extra_args={CAPTURE_KEY: [layer]})
    outputs = llm.chat(list(conversations), params, use_tqdm=False)
    captured = []
    for output in outputs:
        stream = float32_array(output.activations["residual_stream"][0])  # (n_prompt, hidden) with max_tokens=1
        captured.append(np.ascontiguousarray(stream[select_positions(stream.shape[0], num_tokens)]))
    return captured


def oracle_prompt_ids(tokenizer: Any, settings: OracleSettings, num_positions: int, question: str) -> tuple[list[int], list[int]]:
    """Token ids of the oracle prompt (chat template, generation prompt) and its placeholder positions."""
    ids = tokenizer.apply_chat_template(
        oracle_messages(settings.target_layer, num_positions, question, settings.placeholder),
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
    )
    ids = [int(i) for i in ids]
    positions = placeholder_positions(ids, placeholder_token_id(tokenizer, settings.placeholder), num_positions)
    return ids, positions


def injection_vector(activations: np.ndarray, positions: Sequence[int], settings: OracleSettings) -> SteeringVector | None:
    """The engine request that injects ``activations`` (K, hidden) at ``positions``; None
    when every vector is zero (nothing to inject). Zero rows are dropped: they add nothing."""
    keep = np.linalg.norm(activations, axis=-1) > 0
    if not keep.any():
        return None
    return SteeringVector(
        activations=activations[keep][None],
        layer_indices=[settings.injection_layer],
        scale=settings.coefficient,
        norm_match=True,
        position_indices=[int(p) for p, k in zip(positions, keep) if k],
    )


def oracle_answers(
    llm: Any,
    tokenizer: Any,
    lora_request: Any,
    settings: OracleSettings,
    activations: Sequence[np.ndarray],
    questions: Sequence[str],
    max_tokens: int = 4,
    inject: bool = True,
) -> list[str]:
    """Greedy oracle answers; ``inject=False`` is the zero-vector baseline (same prompt and adapter)."""
    from vllm import SamplingParams

    prompts, params = [], []
    for acts, question in zip(activations, questions):
        ids, positions = oracle_prompt_ids(tokenizer, settings, acts.shape[0], question)
        vector = injection_vector(acts, positions, settings) if inject else None
        extra = {STEERING_KEY: [vector]} if vector is not None else None
        prompts.append({"prompt_token_ids": ids})
        params.append(SamplingParams(max_tokens=max_tokens, temperature=0.0, extra_args=extra))
    outputs = llm.generate(prompts, params, lora_request=[lora_request] * len(prompts), use_tqdm=False)
    return [output.outputs[0].text for output in outputs]
