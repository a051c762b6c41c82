"""A request's lens features as the worker holds them: decoded once, tensors on the device."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np
import torch

from lens_evals.spec import INTERNAL_KEY, SteeringVector


@dataclass
class WorkerSteering:
    """One steering vector: per layer a (n_vectors, hidden) device tensor, where n_vectors is 1
    (every position) or one row per entry of ``positions`` (sorted)."""

    vectors: dict[int, torch.Tensor]
    positions: np.ndarray | None
    scale: float
    norm_match: bool


@dataclass
class WorkerRequest:
    key: str
    capture_layers: list[int]
    steering: list[WorkerSteering] = field(default_factory=list)


def decode_worker_request(extra_args: Mapping[str, Any] | None, device: torch.device, dtype: torch.dtype) -> WorkerRequest | None:
    """The frontend put a normalised, validated spec under INTERNAL_KEY; None for plain requests."""
    if not extra_args or INTERNAL_KEY not in extra_args:
        return None
    spec = extra_args[INTERNAL_KEY]
    steering = [_decode_steering(SteeringVector.from_wire(item), device, dtype) for item in spec.get("steer", [])]
    return WorkerRequest(key=str(spec["key"]), capture_layers=list(spec.get("capture", [])), steering=steering)


def _decode_steering(vec: SteeringVector, device: torch.device, dtype: torch.dtype) -> WorkerSteering:
    acts = vec.per_position()  # (n_layers, n_pos or 1, hidden)
    positions = None
    if vec.position_indices is not None:
        order = np.argsort(vec.position_indices)
        positions = np.asarray(vec.position_indices, dtype=np.int64)[order]
        acts = acts[:, order, :]
    tensor = torch.from_numpy(np.ascontiguousarray(acts)).to(device=device, dtype=torch.float32)
    if vec.norm_match:
        tensor = tensor / tensor.norm(dim=-1, keepdim=True)
    tensor = tensor.to(dtype)
    vectors = {layer: tensor[i] for i, layer in enumerate(vec.layer_indices)}
    return WorkerSteering(vectors=vectors, positions=positions, scale=float(vec.scale), norm_match=vec.norm_match)
