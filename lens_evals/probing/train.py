"""Train linear probes on engine activations: dataset -> activations (offline vLLM, batched) ->
StandardScaler + LogisticRegression (L2) -> validation AUROC on held-out groups -> threshold at
1% FPR on the model's own answers to benign requests -> ``probes/NAME.safetensors`` + card."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from sklearn.linear_model import LogisticRegression
from sklearn.model_selection import GroupShuffleSplit
from sklearn.pipeline import Pipeline, make_pipeline
from sklearn.preprocessing import StandardScaler

from lens_evals import settings
from lens_evals.engine.frontend.offline import engine_for
from lens_evals.probing import datasets
from lens_evals.probing.dialogues import Dialogue, TokenSelection
from lens_evals.probing.extract import answer_requests, extract_features
from lens_evals.probing.metrics import auroc, threshold_at_fpr
from lens_evals.probing.probe import PROBE_SUFFIX, Probe, ProbeCard

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2-135m-instruct"
DEFAULT_TRAINING_SET = "instructed-pairs"
# Chosen by validation AUROC on Instructed-Pairs (never on Roleplaying): see `lens-evals probes sweep`.
# Qwen2.5-Coder-0.5B: first layer at validation AUROC 1.000 (docs/results.md); the 1.5B's is the same
# relative depth (8/24 of 28 layers), not swept yet.
DEFAULT_LAYERS = {"smollm2-135m-instruct": 15, "tiny-llama": 1, "qwen2.5-coder-0.5b-instruct": 8, "qwen2.5-coder-1.5b-instruct": 9}


def probe_dir() -> Path:
    return settings.PROBE_DIR.get()


def default_probe_name(model: str = DEFAULT_MODEL, training_set: str = DEFAULT_TRAINING_SET) -> str:
    return f"{Path(model).name}__{training_set.replace(':', '-').replace(',', '-')}"


def selection_for(training_set: str) -> tuple[TokenSelection, int]:
    """Token selection and words excluded per training set (Instructed-Pairs: all but the last 5;
    coup intents: every token of the action; Geometry of Truth: the last token)."""
    if training_set in ("instructed-pairs", "varied-pairs"):
        return "all", 5
    return ("all", 0) if training_set == "coup" else ("last", 0)


def fit_pipeline(features: Sequence[np.ndarray], labels: Sequence[int], C: float = 0.1, fit_intercept: bool = True) -> Pipeline:
    """Fit on per-token rows; every token of a dialogue carries the dialogue's label."""
    rows = np.concatenate(features)
    row_labels = np.concatenate([np.full(len(f), label) for f, label in zip(features, labels)])
    pipeline = make_pipeline(StandardScaler(), LogisticRegression(C=C, max_iter=2000, fit_intercept=fit_intercept))
    return pipeline.fit(rows, row_labels)


def dialogue_scores(pipeline: Pipeline, features: Sequence[np.ndarray]) -> np.ndarray:
    return np.array([pipeline.decision_function(f).mean() for f in features])


def split_groups(dialogues: Sequence[Dialogue], val_fraction: float = 0.2, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    groups = [d.group or str(i) for i, d in enumerate(dialogues)]
    splitter = GroupShuffleSplit(n_splits=1, test_size=val_fraction, random_state=seed)
    train_index, val_index = next(splitter.split(np.zeros(len(dialogues)), groups=groups))
    return train_index, val_index


@dataclass
class LayerFeatures:
    """Activations of one dataset at several layers: features[i] is (n_layers, n_tokens, hidden)."""

    layers: list[int]
    dialogues: list[Dialogue]
    features: list[np.ndarray]

    def at(self, layer: int) -> list[np.ndarray]:
        index = self.layers.index(layer)
        return [f[index] for f in self.features]

    @property
    def labels(self) -> list[int]:
        return [int(d.label) for d in self.dialogues]  # type: ignore[arg-type]


def capture(llm: Any, dialogues: list[Dialogue], layers: Sequence[int], selection: TokenSelection, desc: str) -> LayerFeatures:
    layer_list = sorted(layers)
    return LayerFeatures(layer_list, dialogues, extract_features(llm, dialogues, layer_list, selection, desc=desc))


def load_training_set(training_set: str, limit: int | None = None, seed: int = 0) -> list[Dialogue]:
    dialogues = datasets.training_dialogues(training_set)
    if limit is not None and limit < len(dialogues):
        groups = sorted({d.group for d in dialogues})
        keep = set(np.random.default_rng(seed).permutation(groups)[: max(2, limit // 2)])
        dialogues = [d for d in dialogues if d.group in keep]
    return dialogues


def train_probe(
    model: str = DEFAULT_MODEL,
    layer: int | None = None,
    training_set: str = DEFAULT_TRAINING_SET,
    C: float = 0.1,
    out_dir: str | Path | None = None,
    name: str | None = None,
    llm: Any = None,
    limit: int | None = None,
    control_limit: int | None = None,
    control_max_tokens: int = 64,
    seed: int = 0,
    engine_args: dict[str, Any] | None = None,
) -> Probe:
    """Train, validate, calibrate and save one probe; returns it (its card holds the numbers).
    Without ``llm`` an engine is opened with ``engine_args`` (extra vLLM arguments)."""
    layer = DEFAULT_LAYERS.get(Path(model).name, 0) if layer is None else layer
    with engine_for(model, llm, engine_args) as engine:
        selection, exclude = selection_for(training_set)
        dialogues = load_training_set(training_set, limit, seed)
        data = capture(engine, dialogues, [layer], selection, desc=f"{training_set} layer {layer}")
        train_index, val_index = split_groups(dialogues, seed=seed)
        features, labels = data.at(layer), np.array(data.labels)
        pipeline = fit_pipeline([features[i] for i in train_index], labels[train_index], C=C)
        val_auroc = auroc(labels[val_index], dialogue_scores(pipeline, [features[i] for i in val_index]))
        logger.warning("layer %d: validation AUROC %.3f on %d held-out dialogues", layer, val_auroc, len(val_index))

        requests = datasets.control_requests()[:control_limit]
        control = answer_requests(engine, requests, max_tokens=control_max_tokens)
        control_features = capture(engine, control, [layer], "all", desc="control answers").at(layer)
        control_scores = dialogue_scores(pipeline, control_features)
        card = ProbeCard(
            name=name or default_probe_name(model, training_set),
            model=Path(model).name,
            layer=layer,
            hidden_size=int(features[0].shape[-1]),
            dtype=str(engine.llm_engine.model_config.dtype).removeprefix("torch."),
            token_selection=selection,
            exclude_last_words=exclude,
            training_set=training_set,
            n_train_dialogues=len(train_index),
            n_val_dialogues=len(val_index),
            n_train_tokens=int(sum(len(features[i]) for i in train_index)),
            regularization_C=C,
            validation_auroc=val_auroc,
            threshold=threshold_at_fpr(control_scores, 0.01),
            control_set=f"lens_evals benign_requests.yaml answered by the model (greedy, {control_max_tokens} tokens)",
            n_control=len(control_scores),
            control_scores=[round(float(s), 4) for s in control_scores],
            versions=ProbeCard.current_versions(),
            created=ProbeCard.today(),
        )
        probe = Probe(pipeline=pipeline, card=card)
        saved = probe.save(out_dir if out_dir is not None else probe_dir())
        logger.warning("saved %s (threshold %.3f at 1%% FPR on %d control answers)", saved, card.threshold, card.n_control)
        return probe


def ensure_default_probe(model: str = DEFAULT_MODEL, training_set: str = DEFAULT_TRAINING_SET) -> Path:
    """Path of the model's probe on ``training_set`` (Instructed-Pairs by default), trained if missing."""
    path = probe_dir() / f"{default_probe_name(model, training_set)}{PROBE_SUFFIX}"
    if not path.is_file() or not path.with_suffix(".json").is_file():
        logger.warning("no probe at %s: training it (a few minutes on CPU)", path)
        train_probe(model, training_set=training_set)
    return path
