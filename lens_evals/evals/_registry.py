"""Loaded by Inspect through the ``inspect_ai`` entry point (``pyproject.toml``): registers the
``vllm-lens`` model API, the solvers and scorers, and every task as ``lens_evals/<task>``
(``inspect eval lens_evals/roleplaying_probe``). Importing it trains nothing, changes no
environment variable and needs neither torch nor vllm (Petri's client-only venv loads it too)."""

from lens_evals.evals.activation_oracle import (  # noqa: F401
    activation_oracle,
    activation_oracle_heldout,
    activation_oracle_secret_word,
    oracle_answer_match,
    zero_vector_match,
)
from lens_evals.evals.coup import coup_probe  # noqa: F401
from lens_evals.evals.petri_audit import petri_audit  # noqa: F401
from lens_evals.evals.roleplaying import roleplaying_probe  # noqa: F401
from lens_evals.evals.steering_effect import steering_effect  # noqa: F401
from lens_evals.inspect_kit.lens_solvers import capture_activations, steer  # noqa: F401
from lens_evals.inspect_kit.probe_scorer import probe_scorer  # noqa: F401
from lens_evals.inspect_kit.probe_solver import probe_scores  # noqa: F401
from lens_evals.inspect_kit.provider.api import VLLMLensAPI  # noqa: F401
from lens_evals.inspect_kit.readouts_solver import lens_readouts  # noqa: F401
