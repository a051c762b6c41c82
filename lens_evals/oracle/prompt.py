"""The activation-oracle prompt and where its activations go.

The oracle reads K activations of a target model through K placeholder tokens in one user
turn::

    "Layer: {L}\\n" + placeholder * K + " \\n" + question

At the injection layer each placeholder's residual stream h becomes
``h + c * ||h|| * v / ||v||`` (the engine's ``SteeringVector(norm_match=True)`` at absolute
positions; :func:`inject` is the same formula for HF training). No vllm import here."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

DEFAULT_PLACEHOLDER = " ?"


def oracle_prompt(layer: int, num_positions: int, question: str, placeholder: str = DEFAULT_PLACEHOLDER) -> str:
    if num_positions < 1:
        raise ValueError(f"the oracle needs at least one activation, got {num_positions}")
    return f"Layer: {layer}\n" + placeholder * num_positions + " \n" + question


def oracle_messages(layer: int, num_positions: int, question: str, placeholder: str = DEFAULT_PLACEHOLDER) -> list[dict[str, str]]:
    return [{"role": "user", "content": oracle_prompt(layer, num_positions, question, placeholder)}]


def check_single_token(placeholder: str, token_ids: Sequence[int]) -> int:
    """``token_ids``: the placeholder tokenised alone (no special tokens)."""
    if len(token_ids) != 1:
        raise ValueError(
            f"placeholder {placeholder!r} is {len(token_ids)} tokens for this tokenizer ({list(token_ids)}); "
            "the oracle needs a placeholder of exactly one token"
        )
    return int(token_ids[0])


def placeholder_token_id(tokenizer: Any, placeholder: str = DEFAULT_PLACEHOLDER) -> int:
    """The placeholder's token id with an HF tokenizer; ValueError unless it is one token."""
    return check_single_token(placeholder, tokenizer.encode(placeholder, add_special_tokens=False))


def placeholder_positions(token_ids: Sequence[int], placeholder_id: int, count: int) -> list[int]:
    """Absolute positions of the first run of ``count`` consecutive placeholder tokens."""
    ids = np.asarray(token_ids)
    hits = np.flatnonzero(ids == placeholder_id)
    for start in hits:
        if start + count <= len(ids) and (ids[start : start + count] == placeholder_id).all():
            return list(range(int(start), int(start) + count))
    raise ValueError(
        f"no run of {count} placeholder tokens (id {placeholder_id}) in the oracle prompt: the placeholder "
        "merges with its neighbours for this tokenizer; choose another placeholder"
    )


def select_positions(n_positions: int, num_tokens: int | None) -> slice:
    """The target positions the oracle reads: all (``None``) or the last ``num_tokens``."""
    if num_tokens is None:
        return slice(0, n_positions)
    if num_tokens < 1:
        raise ValueError(f"num_tokens must be >= 1 or None (all), got {num_tokens}")
    return slice(max(0, n_positions - num_tokens), n_positions)


def inject(hidden: Any, positions: Any, vectors: Any, coefficient: float) -> Any:
    """``h + c * ||h|| * v / ||v||`` on rows of ``hidden`` (torch, (B, T, H)).

    ``positions`` (B, K) long, -1 for padding; ``vectors`` (B, K, H). A zero vector adds
    nothing (it has no direction), like an oracle call without injection."""
    import torch

    valid = positions >= 0
    batch_index = torch.arange(hidden.shape[0], device=hidden.device).unsqueeze(1).expand_as(positions)[valid]
    pos_index = positions[valid]
    vec = vectors[valid].to(hidden.dtype)
    vec_norm = vec.norm(dim=-1, keepdim=True)
    direction = torch.where(vec_norm > 0, vec / vec_norm.clamp_min(torch.finfo(vec.dtype).tiny), torch.zeros_like(vec))
    h = hidden[batch_index, pos_index]
    delta = (coefficient * h.norm(dim=-1, keepdim=True) * direction).detach()  # as the engine: no gradient through ||h||
    return hidden.index_put((batch_index, pos_index), h + delta)
