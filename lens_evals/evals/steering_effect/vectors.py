"""The steering vectors: a concept's mean difference of last-prompt-token activations (positive
minus negative contrast prompts), captured through the evaluated model's own engine, once per
model, concept and layers; or a vector given as a safetensors file (tensor ``vector``)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from inspect_ai.model import ChatMessage, ChatMessageAssistant, ChatMessageSystem, ChatMessageUser, GenerateConfig, Model

from lens_evals.evals.steering_effect.concepts import Concept, Message
from lens_evals.inspect_kit.provider.outputs import output_activations, output_token_ids
from lens_evals.request.spec import CAPTURE_KEY

VECTOR_TENSOR = "vector"
_CACHE: dict[tuple[str, str, tuple[int, ...]], np.ndarray] = {}
_LOCKS: dict[int, asyncio.Lock] = {}  # one per event loop (an asyncio lock binds to the loop it first waits in)


def chat(messages: Sequence[Message]) -> list[ChatMessage]:
    kinds = {"system": ChatMessageSystem, "user": ChatMessageUser, "assistant": ChatMessageAssistant}
    return [kinds[m["role"]](content=m["content"]) for m in messages]


def vector_array(vector: Any, layers: Sequence[int]) -> np.ndarray:
    """``vector`` as float32 ``(len(layers), hidden)``: a ``(hidden,)`` vector serves every layer."""
    array = np.asarray(vector, dtype=np.float32)
    if array.ndim == 1:
        array = np.repeat(array[None, :], len(layers), axis=0)
    if array.ndim != 2 or array.shape[0] != len(layers) or not np.isfinite(array).all():
        raise ValueError(f"a steering vector must be finite, (hidden,) or (n_layers={len(layers)}, hidden); got shape {array.shape}")
    return array


def load_vector(path: str | Path, layers: Sequence[int]) -> np.ndarray:
    """A safetensors file's tensor ``vector`` (no pickle: nothing in it is executed)."""
    from safetensors.numpy import load_file

    tensors = load_file(str(path))
    if VECTOR_TENSOR not in tensors:
        raise ValueError(f"{path}: no tensor named {VECTOR_TENSOR!r} (found {sorted(tensors)})")
    return vector_array(tensors[VECTOR_TENSOR], layers)


async def _last_token_rows(model: Model, messages: Sequence[Message], layers: list[int]) -> np.ndarray:
    config = GenerateConfig(max_tokens=1, temperature=0.0, extra_body={"extra_args": {CAPTURE_KEY: layers}})
    output = await model.generate(chat(messages), config=config)
    stream = output_activations(output, "residual_stream")["residual_stream"]  # (n_layers, n_positions, hidden)
    last = len(output_token_ids(output)["prompt"]) - 1
    return np.asarray(stream[:, last].float() if hasattr(stream, "float") else stream[:, last], dtype=np.float32)


async def mean_difference(model: Model, concept: Concept, layers: Sequence[int]) -> np.ndarray:
    """``(len(layers), hidden)``: mean last-token activation of the positive contrast prompts minus
    that of the negative ones, after each layer (cached per model, concept and layers)."""
    key = (model.name, concept.name, tuple(int(layer) for layer in layers))
    lock = _LOCKS.setdefault(id(asyncio.get_running_loop()), asyncio.Lock())
    async with lock:
        if key not in _CACHE:
            chosen = list(key[2])
            rows = await asyncio.gather(*(_last_token_rows(model, p, chosen) for p in concept.positive_prompts + concept.negative_prompts))
            n = len(concept.positive_prompts)
            _CACHE[key] = np.mean(rows[:n], axis=0) - np.mean(rows[n:], axis=0)
        return _CACHE[key]
