"""What the page shows per token: the lens's top tokens at each layer and the top SAE latents.

The ONE place that decides how these are read (docs/chat.md): today the registered ``logit_lens``
hook on the worker (the model's own final norm and unembedding, float32) and, for an SAE, a
capture of its layer encoded on the host (``host_sae``). When the worker's readouts (#42,
``output_readouts``) are served, ``details_xargs`` asks for them and ``token_details`` reads
``activations["readouts"]`` instead; nothing else changes."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from lens_evals.chat.host_sae import HostSae
from lens_evals.request.hooks import Hook
from lens_evals.request.spec import CAPTURE_KEY, HOOKS_KEY


@dataclass(frozen=True)
class DetailsRequest:
    layers: list[int]  # the lens's layers, ascending
    top_k: int = 5
    sae: HostSae | None = None
    sae_top_k: int = 8


def details_xargs(request: DetailsRequest) -> dict[str, Any]:
    """The ``vllm_xargs`` entries asking for the details of every position of a request."""
    xargs: dict[str, Any] = {}
    if request.layers:
        xargs[HOOKS_KEY] = [Hook("logit_lens", request.layers, args={"top_k": request.top_k}).to_json()]
    if request.sae is not None:
        xargs[CAPTURE_KEY] = [request.sae.layer]
    return xargs


def token_details(
    activations: Mapping[str, Any], positions: Sequence[int], request: DetailsRequest, texts: Callable[[Sequence[int]], Mapping[int, str]]
) -> list[dict[str, Any]]:
    """Per position in ``positions`` (absolute, prompt tokens counted from 0):
    ``{"lens": [{"layer": L, "top": [[text, prob], ...]}, ...], "sae": [[latent, value], ...]}``.
    ``texts`` maps token ids to their text."""
    saved = activations.get("saved") or {}
    lens_rows: dict[int, dict[int, tuple[np.ndarray, np.ndarray]]] = {}
    for layer in request.layers:
        if f"top_ids.{layer}" not in saved:
            raise ValueError(f"the lens server returned no logit-lens rows for layer {layer}")
        ids, logprobs = np.asarray(saved[f"top_ids.{layer}"]), np.asarray(saved[f"top_logprobs.{layer}"], dtype=np.float32)
        at = {int(p): row for row, p in enumerate(np.asarray(saved[f"positions.{layer}"]).reshape(-1))}
        lens_rows[layer] = {p: (ids[at[p]], logprobs[at[p]]) for p in positions if p in at}
    wanted = {int(i) for rows in lens_rows.values() for ids, _ in rows.values() for i in ids}
    names = texts(sorted(wanted)) if wanted else {}
    latents = _sae_rows(activations, positions, request) if request.sae is not None else {}
    details = []
    for p in positions:
        lens = [
            {"layer": layer, "top": [[names[int(i)], round(float(np.exp(lp)), 4)] for i, lp in zip(*rows[p])]}
            for layer, rows in lens_rows.items()
            if p in rows
        ]
        details.append({"lens": lens, "sae": latents.get(p, [])})
    return details


def _sae_rows(activations: Mapping[str, Any], positions: Sequence[int], request: DetailsRequest) -> dict[int, list[list[float]]]:
    assert request.sae is not None
    stream = np.asarray(activations["residual_stream"], dtype=np.float32)[0]  # (n_positions, hidden): the one layer
    chosen = [p for p in positions if p < stream.shape[0]]
    if not chosen:
        return {}
    latents = request.sae.encode(stream[chosen])
    k = min(request.sae_top_k, latents.shape[1])
    top = np.argsort(-latents, axis=-1, kind="stable")[:, :k]
    return {p: [[int(i), round(float(latents[row, i]), 4)] for i in top[row] if latents[row, i] > 0] for row, p in enumerate(chosen)}
