"""Training a small TopK sparse autoencoder (after Gao et al. 2024, "Scaling and evaluating sparse
autoencoders") on one layer's residual stream: ``z = topk_k(relu((x - b_dec) @ W_enc + b_enc))``,
``x_hat = z @ W_dec + b_dec``, loss = mean squared error. ``W_dec``'s rows are kept at unit norm
(renormalised after each step), ``W_enc`` starts as ``W_dec.T``, ``b_dec`` as the data mean. Trained
on the raw stream (what the worker's readout sees), from a ``lens-evals capture`` directory or an
array; evaluated on held-out tokens: reconstruction MSE, fraction of variance explained, dead
latents (never active on the held-out tokens)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from lens_evals.readouts.sae_files import SaeWeights


@dataclass(frozen=True)
class SaeSettings:
    d_sae: int = 2048
    k: int = 32
    steps: int = 2000
    batch_tokens: int = 512
    lr: float = 1e-3
    seed: int = 0


@dataclass(frozen=True)
class SaeReport:
    n_train_tokens: int
    n_heldout_tokens: int
    mse: float  # mean over held-out tokens and dimensions of (x - x_hat)^2
    fraction_variance_explained: float  # 1 - sum ||x - x_hat||^2 / sum ||x - mean||^2
    dead_latents: int  # never active on the held-out tokens
    dead_fraction: float
    mean_active: float  # mean number of active latents per held-out token

    def as_dict(self) -> dict[str, float | int]:
        return asdict(self)


def capture_tokens(
    capture_dir: str | Path, layer: int, skip_first: int = 1, held_out: float = 0.1, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(train, held_out)`` float32 ``[n, d]`` token rows of ``layer`` from a capture directory,
    split by prompt (a seeded ``held_out`` fraction of the prompts, at least one), each prompt's
    first ``skip_first`` positions left out (attention-sink tokens carry outsized norms)."""
    from lens_evals.capture.loader import CaptureReader

    reader = CaptureReader(capture_dir)
    rows = [row.activations[0, skip_first:].float() for row in reader.rows([layer])]
    rows = [r for r in rows if r.shape[0]]
    if len(rows) < 2:
        raise ValueError(f"{capture_dir}: needs at least 2 prompts with more than {skip_first} tokens at layer {layer}")
    order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(seed)).tolist()
    n_held = min(len(rows) - 1, max(1, round(len(rows) * held_out)))
    return torch.cat([rows[i] for i in order[:-n_held]]), torch.cat([rows[i] for i in order[-n_held:]])


def _encode(x: torch.Tensor, w_enc: torch.Tensor, b_enc: torch.Tensor, b_dec: torch.Tensor, k: int) -> torch.Tensor:
    pre = torch.relu((x - b_dec) @ w_enc + b_enc)
    top = pre.topk(k, dim=-1)
    return torch.zeros_like(pre).scatter(-1, top.indices, top.values)


def train_sae(train: torch.Tensor, layer: int, settings: SaeSettings = SaeSettings(), progress: bool = True) -> SaeWeights:
    """A TopK SAE on ``train`` ``[n, d]`` (float32)."""
    from tqdm.auto import tqdm

    if not 1 <= settings.k <= settings.d_sae:
        raise ValueError(f"k must lie in 1..d_sae={settings.d_sae}, got {settings.k}")
    n, d = train.shape
    generator = torch.Generator().manual_seed(settings.seed)
    w_dec = torch.randn(settings.d_sae, d, generator=generator)
    w_dec = (w_dec / w_dec.norm(dim=1, keepdim=True)).requires_grad_(True)
    w_enc = w_dec.detach().T.clone().requires_grad_(True)
    b_enc = torch.zeros(settings.d_sae, requires_grad=True)
    b_dec = train.mean(0).clone().requires_grad_(True)
    optimiser = torch.optim.Adam([w_enc, b_enc, w_dec, b_dec], lr=settings.lr)
    for _ in tqdm(range(settings.steps), desc="sae", disable=not progress):
        x = train[torch.randint(0, n, (min(settings.batch_tokens, n),), generator=generator)]
        z = _encode(x, w_enc, b_enc, b_dec, settings.k)
        loss = ((z @ w_dec + b_dec - x) ** 2).sum(-1).mean()
        optimiser.zero_grad(set_to_none=True)
        loss.backward()
        optimiser.step()
        with torch.no_grad():
            w_dec /= w_dec.norm(dim=1, keepdim=True).clamp_min(1e-8)
    return SaeWeights(
        W_enc=w_enc.detach().numpy().astype(np.float32),
        b_enc=b_enc.detach().numpy().astype(np.float32),
        W_dec=w_dec.detach().numpy().astype(np.float32),
        b_dec=b_dec.detach().numpy().astype(np.float32),
        architecture="topk",
        layer=layer,
        apply_b_dec_to_input=True,
        k=settings.k,
    )


@torch.no_grad()
def evaluate_sae(sae: SaeWeights, held_out: torch.Tensor, n_train_tokens: int = 0) -> SaeReport:
    """Reconstruction quality and dead latents of ``sae`` on ``held_out`` ``[n, d]``."""
    from lens_evals.readouts.reference import sae_latents

    z = sae_latents(held_out, sae)
    x_hat = z @ torch.from_numpy(sae.W_dec) + torch.from_numpy(sae.b_dec)
    err = ((held_out - x_hat) ** 2).sum()
    var = ((held_out - held_out.mean(0)) ** 2).sum()
    active = z > 0
    dead = int((~active.any(0)).sum())
    return SaeReport(
        n_train_tokens=n_train_tokens,
        n_heldout_tokens=int(held_out.shape[0]),
        mse=float(err / held_out.numel()),
        fraction_variance_explained=float(1 - err / var),
        dead_latents=dead,
        dead_fraction=dead / sae.d_sae,
        mean_active=float(active.sum(-1).float().mean()),
    )
