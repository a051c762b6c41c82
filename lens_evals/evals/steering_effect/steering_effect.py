"""The steering eval: ``inspect eval lens_evals/steering_effect`` (``tasks/steering_effect.py`` is
the same task as a file). A dose-response sweep: every item at every (layer, scale), steered by
the concept's contrastive mean-difference vector (or a given one); see the README beside it."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from inspect_ai import Task, task
from inspect_ai.dataset import MemoryDataset, Sample

from lens_evals.evals.steering_effect.concepts import Concept, concept_named
from lens_evals.evals.steering_effect.steered_runs import steering_scorer, steering_sweep
from lens_evals.evals.steering_effect.vectors import chat, load_vector, vector_array

TASK_NAME = "steering_effect"


def number_list(value: Any, kind: type, name: str) -> list[Any]:
    """``-T`` gives "1,2,3" (or a YAML list); Python callers a sequence or one number."""
    if isinstance(value, (int, float)):
        value = [value]
    items = [part for part in value.split(",") if part.strip()] if isinstance(value, str) else list(value)
    try:
        parsed = [kind(item) for item in items]
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a comma list of numbers, got {value!r}") from None
    if not parsed or len(set(parsed)) != len(parsed):
        raise ValueError(f"{name} must list at least one value, none twice; got {value!r}")
    return parsed


def sweep_samples(concept: Concept, n_items: int, layers: Sequence[int], scales: Sequence[float]) -> list[Sample]:
    return [
        Sample(
            id=f"{index}-L{layer}-s{scale:g}",
            input=chat(item.messages),
            target=concept.classes[1],
            metadata={"concept": concept.name, "item": index, "layer": layer, "scale": scale, "answer_prefix": item.answer_prefix},
        )
        for index, item in enumerate(concept.items[:n_items])
        for layer in layers
        for scale in scales
    ]


def steering_effect_task(
    concept: Concept,
    layers: Sequence[int],
    scales: Sequence[float],
    prompts: int = 20,
    max_tokens: int = 24,
    vector: np.ndarray | str | Path | None = None,
) -> Task:
    """``vector``: ``(hidden,)`` or ``(len(layers), hidden)``, or a safetensors file holding it as
    ``vector``; None steers with the concept's mean difference, computed on the evaluated model."""
    layer_list = [int(layer) for layer in layers]
    if prompts < 1 or max_tokens < 1:
        raise ValueError(f"prompts and max_tokens must be at least 1, got {prompts} and {max_tokens}")
    if any(layer < 0 for layer in layer_list):
        raise ValueError(f"layers must be non-negative, got {layer_list}")
    given = (
        None
        if vector is None
        else (load_vector(vector, layer_list) if isinstance(vector, (str, Path)) else vector_array(vector, layer_list))
    )
    return Task(
        name=TASK_NAME,
        dataset=MemoryDataset(sweep_samples(concept, prompts, layer_list, [float(s) for s in scales]), name=f"{TASK_NAME}_{concept.name}"),
        solver=steering_sweep(concept, layer_list, given, max_tokens=max_tokens),
        scorer=steering_scorer(concept_has_words=bool(concept.positive_words)),
        metadata={
            "steering_effect": {
                "concept": concept.name,
                "classes": list(concept.classes),
                "layers": layer_list,
                "scales": [float(s) for s in scales],
                "vector": "given" if vector is not None else "mean difference of the contrast prompts' last token",
                "n_contrast_pairs": len(concept.positive_prompts),
            }
        },
    )


@task
def steering_effect(
    concept: str = "sentiment",
    layers: str = "6,12,18",
    scales: str = "0,2,4,6,8",
    prompts: int = 20,
    max_tokens: int = 24,
    vector: str | None = None,
    dataset: str | None = None,
) -> Task:
    """``concept``: ``sentiment`` or ``honesty`` (Roleplaying scenarios; ``dataset`` another file in
    their schema). ``layers`` / ``scales``: comma lists swept (scale 0 is the unsteered baseline).
    ``prompts``: items per (layer, scale). ``vector``: a safetensors file (tensor ``vector``) instead
    of the concept's mean difference."""
    return steering_effect_task(
        concept_named(concept, dataset),
        number_list(layers, int, "layers"),
        number_list(scales, float, "scales"),
        prompts=prompts,
        max_tokens=max_tokens,
        vector=vector,
    )
