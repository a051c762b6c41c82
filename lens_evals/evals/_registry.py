"""Loaded by Inspect through the ``inspect_ai`` entry point: registers providers and solvers."""

from lens_evals.evals.oracle_scorers import oracle_answer_match, zero_vector_match  # noqa: F401
from lens_evals.evals.oracle_solver import activation_oracle  # noqa: F401
from lens_evals.evals.provider import VLLMLensAPI  # noqa: F401
from lens_evals.evals.solvers import capture_activations, steer  # noqa: F401
