"""Readouts that need fitting or files (issue #42), host side: affine-lens files (tuned /
Jacobian lens), SAE-Lens folders, the client-side reference math, and fitting a tuned lens, a
Jacobian lens and a TopK SAE. Never imports the engine. See docs/readouts-fitting.md."""

from lens_evals.readouts.lens_files import AffineLensWeights, LensFileError, load_affine_lens, save_affine_lens
from lens_evals.readouts.sae_files import SaeFileError, SaeWeights, load_sae, save_sae

__all__ = [
    "AffineLensWeights",
    "LensFileError",
    "SaeFileError",
    "SaeWeights",
    "load_affine_lens",
    "load_sae",
    "save_affine_lens",
    "save_sae",
]
