"""What the page shows per token: the lens's top tokens at each layer and the top SAE latents.

The ONE place that decides how these are read (docs/chat.md): the worker's readouts (#42,
``output_readouts``, docs/readouts.md): a lens readout (the logit lens, or a tuned / Jacobian lens
from ``--lens FILE``) on the chosen layers and an SAE readout on its layer, computed in the step
on the worker; only their top-k come back."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from lens_evals.request.readouts import LensReadout, SaeReadout

READOUTS_KEY = "output_readouts"
LENS_NAME, SAE_NAME = "chat-lens", "chat-sae"


@dataclass(frozen=True)
class DetailsRequest:
    lens: LensReadout | None  # named LENS_NAME, its layers resolved
    sae: SaeReadout | None = None  # named SAE_NAME
    sae_label: str = ""  # what the page calls the SAE (its folder's name)

    @property
    def layers(self) -> list[int]:
        return list(self.lens.layers) if self.lens is not None and isinstance(self.lens.layers, list) else []


def details_xargs(request: DetailsRequest) -> dict[str, Any]:
    """The ``vllm_xargs`` entries asking for the details of every position of a request."""
    readouts = [r.to_json() for r in (request.lens, request.sae) if r is not None]  # vllm_xargs: strings
    return {READOUTS_KEY: readouts} if readouts else {}


def token_details(
    activations: Mapping[str, Any], positions: Sequence[int], request: DetailsRequest, texts: Callable[[Sequence[int]], Mapping[int, str]]
) -> list[dict[str, Any]]:
    """Per position in ``positions`` (absolute, prompt tokens counted from 0):
    ``{"lens": [{"layer": L, "top": [[text, prob], ...]}, ...], "sae": [[latent, value], ...]}``.
    ``texts`` maps token ids to their text."""
    readouts = activations.get("readouts") or {}
    lens_rows: dict[int, dict[int, tuple[np.ndarray, np.ndarray]]] = {}
    if request.lens is not None:
        lens = readouts.get(LENS_NAME)
        if lens is None:
            raise ValueError("the lens server returned no lens readout (is it a lens server with readouts?)")
        ids, logprobs = np.asarray(lens["token_ids"]), np.asarray(lens["logprobs"], dtype=np.float32)
        for row, layer in enumerate(lens["layers"]):
            lens_rows[int(layer)] = {p: (ids[row, p], logprobs[row, p]) for p in positions if p < ids.shape[1]}
    wanted = {int(i) for rows in lens_rows.values() for ids_, _ in rows.values() for i in ids_}
    names = texts(sorted(wanted)) if wanted else {}
    latents = _sae_rows(readouts, positions) if request.sae is not None else {}
    details = []
    for p in positions:
        lens_view = [
            {"layer": layer, "top": [[names[int(i)], round(float(np.exp(lp)), 4)] for i, lp in zip(*rows[p], strict=True)]}
            for layer, rows in lens_rows.items()
            if p in rows
        ]
        details.append({"lens": lens_view, "sae": latents.get(p, [])})
    return details


def _sae_rows(readouts: Mapping[str, Any], positions: Sequence[int]) -> dict[int, list[list[float]]]:
    sae = readouts.get(SAE_NAME)
    if sae is None:
        raise ValueError("the lens server returned no SAE readout (is it a lens server with readouts?)")
    ids, values = np.asarray(sae["latent_ids"]), np.asarray(sae["values"], dtype=np.float32)
    return {
        p: [[int(i), round(float(v), 4)] for i, v in zip(ids[p], values[p], strict=True) if i >= 0 and v > 0]
        for p in positions
        if p < ids.shape[0]
    }
