"""Loaded by Inspect through the ``inspect_ai`` entry point: registers providers and solvers."""

from lens_evals.evals.provider import VLLMLensAPI  # noqa: F401
from lens_evals.evals.solvers import capture_activations, steer  # noqa: F401
