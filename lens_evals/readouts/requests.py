"""Readout requests from fitted files: an affine lens file (``lens_files``) or an SAE-Lens folder
(``sae_files``) as the request objects the worker reads (``lens_evals.request.readouts``).

    from lens_evals.readouts.requests import lens_readout, sae_readout
    params = SamplingParams(extra_args={"output_readouts": [lens_readout("tuned.safetensors"), sae_readout("sae-l15/")]})
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Literal

import numpy as np

from lens_evals.readouts.lens_files import load_affine_lens
from lens_evals.readouts.sae_files import load_sae
from lens_evals.request.readouts import AffineLens, LensReadout, SaeReadout


def lens_readout(path: str | Path, name: str = "lens", layers: Sequence[int] | Literal["all"] = "all", top_k: int = 10) -> LensReadout:
    """The affine lens in ``path`` read at ``layers`` (``"all"``: every layer the file has)."""
    lens = load_affine_lens(path)
    wanted = lens.layers if layers == "all" else sorted(set(layers))
    missing = sorted(set(wanted) - set(lens.layers))
    if missing:
        raise ValueError(f"{path}: the lens has no translator for layers {missing} (it has {lens.layers})")
    weights = np.stack([lens.weights[layer] for layer in wanted])
    biases = np.stack([lens.biases[layer] for layer in wanted])
    return LensReadout(name=name, layers=list(wanted), top_k=top_k, lens=AffineLens(layers=list(wanted), weights=weights, biases=biases))


def sae_readout(folder: str | Path, name: str = "sae", top_k: int = 16) -> SaeReadout:
    """The SAE in ``folder`` (SAE-Lens layout) on the layer its cfg.json names."""
    sae = load_sae(folder)  # checked: its encoder is well formed
    return SaeReadout(name=name, layer=sae.layer, top_k=top_k, sae=sae.encoder())
