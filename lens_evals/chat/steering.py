"""The page's steering control: a vector from a file (``--vector``) or the mean difference of a
contrastive pair of prompts captured at the chosen layer, added at that layer with a scale."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from lens_evals.chat.upstream import Upstream
from lens_evals.request.spec import SteeringVector


class SteeringChoice(BaseModel):
    """What the page asks for: ``source`` "vector" (one of the loaded files, by name) or "pair"
    (``positive`` minus ``negative``, each prompt's stream averaged over its positions)."""

    model_config = ConfigDict(extra="forbid")
    source: Literal["vector", "pair"]
    layer: int = Field(ge=0)
    scale: float = Field(allow_inf_nan=False)
    vector: str | None = None
    positive: str | None = Field(default=None, max_length=4000)
    negative: str | None = Field(default=None, max_length=4000)


def load_vector(path: str | Path) -> np.ndarray:
    """A steering direction from ``.npy`` or ``.safetensors`` (one tensor): (hidden,) or (1, hidden)."""
    path = Path(path)
    if path.suffix == ".npy":
        array = np.load(path, allow_pickle=False)
    elif path.suffix == ".safetensors":
        from safetensors.numpy import load_file

        tensors = load_file(str(path))
        if len(tensors) != 1:
            raise ValueError(f"{path}: a steering file holds one tensor, found {sorted(tensors)}")
        array = next(iter(tensors.values()))
    else:
        raise ValueError(f"{path}: a steering vector is a .npy or .safetensors file")
    array = np.asarray(array, dtype=np.float32)
    if array.ndim == 2 and array.shape[0] == 1:
        array = array[0]
    if array.ndim != 1 or not np.isfinite(array).all():
        raise ValueError(f"{path}: a steering vector is one finite row (hidden,), got shape {array.shape}")
    vector: np.ndarray = array
    return vector


class Steering:
    def __init__(self, upstream: Upstream, model: str, vectors: dict[str, np.ndarray]) -> None:
        self.upstream, self.model, self.vectors = upstream, model, vectors
        self._pairs: dict[tuple[str, str, int], np.ndarray] = {}

    def direction(self, choice: SteeringChoice) -> np.ndarray:
        if choice.source == "vector":
            if choice.vector not in self.vectors:
                raise ValueError(f"no steering vector {choice.vector!r}; loaded: {sorted(self.vectors) or 'none (pass --vector FILE)'}")
            return self.vectors[choice.vector]
        if not choice.positive or not choice.negative:
            raise ValueError("a contrastive pair needs both prompts")
        key = (choice.positive, choice.negative, choice.layer)
        if key not in self._pairs:
            plus = self.upstream.capture(self.model, choice.layer, prompt=choice.positive).mean(axis=0)
            minus = self.upstream.capture(self.model, choice.layer, prompt=choice.negative).mean(axis=0)
            self._pairs[key] = (plus - minus).astype(np.float32)
        return self._pairs[key]

    def vector(self, choice: SteeringChoice) -> SteeringVector:
        return SteeringVector(activations=self.direction(choice)[None], layer_indices=[choice.layer], scale=choice.scale)
