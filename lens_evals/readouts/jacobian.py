"""Fitting a Jacobian lens. Our definition: for source layer i and the last layer L (its stream
before the final norm),

    J_i = E_t [ d h_L[t] / d h_i[t] ]

the same-position Jacobian of the last layer's stream with respect to layer i's stream (other
positions held fixed), averaged over the tokens t of a prompt set (each prompt's first
``skip_first`` positions left out: attention-sink tokens are atypical). The lens is the affine
translator ``T_i(h) = h @ J_i.T`` (bias 0): a first-order transport of layer i's stream to the last
layer's basis, read through the model's own final norm and unembedding.

Estimated with HF transformers backward passes, never forming per-token Jacobians: per prompt, one
forward of ``probes`` copies, then one vector-Jacobian product with a random cotangent ``v`` (one
vector per copy and position) on the last layer's stream gives ``g_i[s] = sum_t J_i[t, s].T v[t]``
at every source layer. Since ``E[v[s] v[t].T] = 0`` for ``s != t``, the cross-position terms are
zero-mean noise, and ``J_i`` is the least-squares solution of ``g_i[s] = J_i.T v[s]`` over every
(copy, position): ``J_i = (V.T V)^-1 V.T G_i``. Cotangents: ``rademacher`` (random signs, every
dimension at once) or ``basis`` (copy c holds one output dimension with a random sign per position;
``hidden_size`` copies per prompt, exact rows, for small models and tests). For a model whose
layers act on each position alone (no attention) and linearly, both give the exact product of the
layers' matrices."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from lens_evals.readouts.hf_parts import ModelParts, _output_tensor
from lens_evals.readouts.lens_files import AffineLensWeights

PROBES = ("rademacher", "basis")


@dataclass(frozen=True)
class JacobianSettings:
    probes: str = "rademacher"
    copies: int = 8  # cotangent copies per backward (a batch of the same prompt)
    skip_first: int = 4
    seed: int = 0


def _cotangents(kind: str, copies: int, n_pos: int, d: int, dims: Sequence[int], generator: torch.Generator) -> torch.Tensor:
    signs = torch.randint(0, 2, (copies, n_pos, 1 if kind == "basis" else d), generator=generator).float() * 2 - 1
    if kind == "rademacher":
        return signs
    v = torch.zeros(copies, n_pos, d)
    v[torch.arange(copies), :, torch.as_tensor(list(dims))] = signs[..., 0]
    return v


def _source_grads(parts: ModelParts, ids: Sequence[int], layers: Sequence[int], cot: torch.Tensor) -> dict[int, torch.Tensor]:
    """``layer -> [copies, n_pos, d]``: the vector-Jacobian product of the last layer's stream with
    cotangent ``cot`` at each source layer's stream (one forward of ``copies`` rows, one backward)."""
    first, last = min(layers), parts.num_layers - 1
    caught: dict[int, torch.Tensor] = {}

    def hook(index: int) -> Any:
        def record(_module: Any, _args: Any, output: Any) -> Any:
            hidden = _output_tensor(output)
            if index == first:  # the graph starts here: the earlier layers are constants
                hidden = hidden.detach().requires_grad_(True)
                output = hidden if isinstance(output, torch.Tensor) else (hidden, *output[1:])
            caught[index] = hidden
            return output if index == first else None

        return record

    handles = [parts.layers[i].register_forward_hook(hook(i)) for i in sorted({*layers, last})]
    try:
        with torch.enable_grad():
            parts.decoder(input_ids=torch.tensor([list(ids)]).expand(cot.shape[0], -1))
            grads = torch.autograd.grad(caught[last], [caught[i] for i in layers], grad_outputs=cot, allow_unused=True)
    finally:
        for handle in handles:
            handle.remove()
    return {layer: (g if g is not None else torch.zeros_like(cot)) for layer, g in zip(layers, grads)}


def fit_jacobian_lens(
    parts: ModelParts,
    prompts: Sequence[Sequence[int]],
    layers: Sequence[int],
    settings: JacobianSettings = JacobianSettings(),
    progress: bool = True,
) -> AffineLensWeights:
    """The Jacobian lens of ``layers`` (each below the last layer; the last gets the identity)."""
    from tqdm.auto import tqdm

    if settings.probes not in PROBES:
        raise ValueError(f"probes must be one of {', '.join(PROBES)}, got {settings.probes!r}")
    last, d = parts.num_layers - 1, parts.hidden_size
    sources = sorted({layer for layer in layers if layer != last})
    if any(not 0 <= layer < last for layer in sources):
        raise ValueError(f"source layers must lie in 0..{last - 1}, got {sources}")
    generator = torch.Generator().manual_seed(settings.seed)
    vtv = torch.zeros(d, d, dtype=torch.float64)
    vtg = {layer: torch.zeros(d, d, dtype=torch.float64) for layer in sources}
    n_used = 0
    for ids in tqdm(prompts, desc="jacobian lens", disable=not progress):
        if len(ids) <= settings.skip_first or not sources:
            continue
        chunks = [list(range(d))[i : i + settings.copies] for i in range(0, d, settings.copies)] if settings.probes == "basis" else [[]]
        for dims in chunks:
            copies = len(dims) if settings.probes == "basis" else settings.copies
            cot = _cotangents(settings.probes, copies, len(ids), d, dims, generator)
            cot[:, : settings.skip_first] = 0
            grads = _source_grads(parts, ids, sources, cot)
            v = cot[:, settings.skip_first :].reshape(-1, d).double()
            vtv += v.T @ v
            for layer in sources:
                vtg[layer] += v.T @ grads[layer][:, settings.skip_first :].reshape(-1, d).double()
        n_used += 1
    if n_used == 0 and sources:
        raise ValueError(f"no prompt is longer than skip_first={settings.skip_first} tokens")
    weights = {layer: torch.linalg.solve(vtv, vtg[layer]).float().numpy() for layer in sources}
    weights[last] = np.eye(d, dtype=np.float32)
    biases = {layer: np.zeros(d, dtype=np.float32) for layer in weights}
    meta = {"probes": settings.probes, "copies": str(settings.copies), "skip_first": str(settings.skip_first), "n_prompts": str(n_used)}
    return AffineLensWeights("jacobian", weights, biases, meta)
