"""Fitting a tuned lens (after Belrose et al. 2023, "Eliciting Latent Predictions from
Transformers with the Tuned Lens"): per layer i an affine translator ``T_i(h) = h @ (I + A_i).T
+ b_i``, started at the identity (``A_i = 0, b_i = 0``: the logit lens), trained to minimise
``KL(p_final || p_lens_i)`` over tokens, where ``p_final`` is the model's own next-token
distribution and ``p_lens_i = softmax(unembed(final_norm(T_i(h_i))))``.

Trained on streams captured once (:func:`lens_evals.readouts.hf_parts.capture_streams` or a
``lens-evals capture`` directory), never re-running the model: each step draws a batch of tokens,
the target distribution comes from the last layer's stream through the frozen head. Adam with a
linearly decaying learning rate; every layer is trained in the same step (one backward per layer,
so only one layer's logits are alive at a time). The last layer keeps the identity (its lens is
the model's output)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np
import torch

from lens_evals.readouts.lens_files import AffineLensWeights

Fn = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class TunedLensSettings:
    steps: int = 200
    batch_tokens: int = 256
    lr: float = 1e-3
    seed: int = 0


def kl_to_target(target_logprobs: torch.Tensor, lens_logits: torch.Tensor) -> torch.Tensor:
    """Mean over rows of ``KL(target || softmax(lens_logits))`` in nats."""
    lens_logprobs = torch.log_softmax(lens_logits.float(), dim=-1)
    return (target_logprobs.exp() * (target_logprobs - lens_logprobs)).sum(-1).mean()


@torch.no_grad()
def top_mass_tokens(final_stream: torch.Tensor, head: Fn, n: int, chunk: int = 512) -> torch.Tensor:
    """The ``n`` token ids carrying the most probability mass of the final distribution summed
    over the tokens of ``final_stream`` (``head``: last-layer stream -> logits), ascending."""
    mass: torch.Tensor | None = None
    for begin in range(0, final_stream.shape[0], chunk):
        probs = torch.softmax(head(final_stream[begin : begin + chunk]).float(), dim=-1).sum(0)
        mass = probs if mass is None else mass + probs
    assert mass is not None
    return mass.topk(min(n, mass.shape[0])).indices.sort().values


def fit_tuned_lens(
    streams: Mapping[int, torch.Tensor],
    final_stream: torch.Tensor,
    final_norm: Fn,
    unembed: Fn,
    settings: TunedLensSettings = TunedLensSettings(),
    progress: bool = True,
    last_layer: int | None = None,
) -> tuple[AffineLensWeights, list[float]]:
    """``streams``: layer -> ``[n_tokens, d]`` (the same tokens, in the same order, as
    ``final_stream``, the last layer's stream before the final norm). Returns the lens (plus the
    identity at ``last_layer`` when given) and the mean training KL per step (summed over layers)."""
    from tqdm.auto import tqdm

    layers = sorted(streams)
    n_tokens, d = final_stream.shape
    if any(streams[layer].shape != (n_tokens, d) for layer in layers):
        raise ValueError("every layer's stream must have the final stream's shape [n_tokens, d]")
    generator = torch.Generator().manual_seed(settings.seed)
    residual = torch.zeros(len(layers), d, d, requires_grad=True)
    bias = torch.zeros(len(layers), d, requires_grad=True)
    optimiser = torch.optim.Adam([residual, bias], lr=settings.lr)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimiser, lambda step: 1.0 - step / max(1, settings.steps))
    history: list[float] = []
    for _ in tqdm(range(settings.steps), desc="tuned lens", disable=not progress):
        rows = torch.randint(0, n_tokens, (min(settings.batch_tokens, n_tokens),), generator=generator)
        with torch.no_grad():
            target = torch.log_softmax(unembed(final_norm(final_stream[rows])).float(), dim=-1)
        optimiser.zero_grad(set_to_none=True)
        total = 0.0
        for index, layer in enumerate(layers):
            h = streams[layer][rows]
            translated = h + h @ residual[index].T + bias[index]
            loss = kl_to_target(target, unembed(final_norm(translated)))
            loss.backward()
            total += loss.item()
        optimiser.step()
        schedule.step()
        history.append(total)
    eye = np.eye(d, dtype=np.float32)
    weights = {layer: eye + residual[i].detach().numpy().astype(np.float32) for i, layer in enumerate(layers)}
    biases = {layer: bias[i].detach().numpy().astype(np.float32).copy() for i, layer in enumerate(layers)}
    if last_layer is not None and last_layer not in weights:
        weights[last_layer], biases[last_layer] = eye.copy(), np.zeros(d, dtype=np.float32)
    meta = {"steps": str(settings.steps), "batch_tokens": str(settings.batch_tokens), "lr": str(settings.lr), "seed": str(settings.seed)}
    return AffineLensWeights("tuned", weights, biases, meta), history
