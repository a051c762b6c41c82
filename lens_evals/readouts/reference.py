"""The client-side reference math of the readouts (docs/readouts.md): what the worker's lens and
SAE readouts must equal, computed on the host from a capture of the residual stream, in float32.

Lens at layer i: ``log_softmax(unembed(final_norm(T_i(h_i))))``, ``T_i(h) = h`` (logit lens) or
``h @ W_i.T + b_i`` (an :class:`AffineLensWeights`); the top ``top_k`` token ids and log-probs per
position. SAE: ``pre = ((h - b_dec) if apply_b_dec_to_input else h) @ W_enc + b_enc``; relu:
``max(0, pre)``; jumprelu: ``pre * (pre > threshold)``; topk: the ``k`` largest of ``pre`` kept,
the rest 0, then relu. The top ``top_k`` latents per position; slots beyond the positive latents
hold id -1 and value 0."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

from lens_evals.readouts.lens_files import AffineLensWeights
from lens_evals.readouts.sae_files import SaeWeights

Fn = Callable[[torch.Tensor], torch.Tensor]


def _tensor(array: Any) -> torch.Tensor:
    return torch.as_tensor(np.asarray(array, dtype=np.float32) if not isinstance(array, torch.Tensor) else array).float()


def as_unembed(unembed: Fn | np.ndarray | torch.Tensor) -> Fn:
    """A callable ``[n, d] -> [n, vocab]`` from a callable or an unembedding matrix ``[vocab, d]``."""
    if callable(unembed):
        return unembed
    matrix = _tensor(unembed)
    return lambda h: h @ matrix.T


def translate(stream: torch.Tensor, lens: AffineLensWeights | None, layer: int) -> torch.Tensor:
    """``T_layer(stream)`` in float32 (the identity without a lens)."""
    stream = _tensor(stream)
    if lens is None:
        return stream
    if layer not in lens.weights:
        raise KeyError(f"the {lens.kind} lens has no translator for layer {layer} (it has {lens.layers})")
    return stream @ torch.from_numpy(lens.weights[layer]).T + torch.from_numpy(lens.biases[layer])


@torch.no_grad()
def lens_logprobs(
    stream: Any, layer: int, final_norm: Fn, unembed: Fn | np.ndarray | torch.Tensor, lens: AffineLensWeights | None = None
) -> torch.Tensor:
    """``[n_positions, vocab]`` float32 log-probs of the lens at ``layer`` for ``stream`` ``[n_positions, d]``."""
    logits = as_unembed(unembed)(final_norm(translate(stream, lens, layer)))
    return torch.log_softmax(logits.float(), dim=-1)


def lens_topk(
    stream: Mapping[int, Any], final_norm: Fn, unembed: Fn | np.ndarray | torch.Tensor, lens: AffineLensWeights | None, top_k: int
) -> dict[str, Any]:
    """``stream``: layer -> ``[n_positions, d]``. The contract's lens output: ``layers``,
    ``token_ids`` int32 and ``logprobs`` float32, both ``[n_layers, n_positions, top_k]``."""
    layers = sorted(stream)
    ids, values = [], []
    for layer in layers:
        top = lens_logprobs(stream[layer], layer, final_norm, unembed, lens).topk(top_k, dim=-1)
        ids.append(top.indices.to(torch.int32))
        values.append(top.values)
    return {"layers": layers, "token_ids": torch.stack(ids).numpy(), "logprobs": torch.stack(values).numpy()}


@torch.no_grad()
def sae_latents(stream: Any, sae: SaeWeights) -> torch.Tensor:
    """``[n_positions, d_sae]`` float32 latent activations of ``stream`` ``[n_positions, d_in]``."""
    h = _tensor(stream)
    if sae.apply_b_dec_to_input:
        h = h - torch.from_numpy(sae.b_dec)
    pre = h @ torch.from_numpy(sae.W_enc) + torch.from_numpy(sae.b_enc)
    if sae.architecture == "standard":
        return pre.clamp_min(0)
    if sae.architecture == "jumprelu":
        assert sae.threshold is not None
        return pre * (pre > torch.from_numpy(sae.threshold))
    assert sae.k is not None
    top = pre.topk(sae.k, dim=-1)
    return torch.zeros_like(pre).scatter(-1, top.indices, top.values.clamp_min(0))


def sae_topk(stream: Any, sae: SaeWeights, top_k: int) -> dict[str, Any]:
    """The contract's SAE output: ``layer``, ``latent_ids`` int32 and ``values`` float32, both
    ``[n_positions, top_k]``; slots beyond the positive latents hold id -1 and value 0."""
    top = sae_latents(stream, sae).topk(min(top_k, sae.d_sae), dim=-1)
    ids = torch.where(top.values > 0, top.indices, -1).to(torch.int32)
    values = top.values.clamp_min(0)
    if top_k > sae.d_sae:
        pad = top_k - sae.d_sae
        ids = torch.nn.functional.pad(ids, (0, pad), value=-1)
        values = torch.nn.functional.pad(values, (0, pad), value=0.0)
    return {"layer": sae.layer, "latent_ids": ids.numpy(), "values": values.numpy()}
