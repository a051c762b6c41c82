"""Detection metrics (scikit-learn underneath): AUROC, threshold at a false-positive rate on a
control set, recall at a threshold."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
from sklearn.metrics import roc_auc_score

# What the metrics take: a sequence of numbers or a 1-D numpy array of them (np.asarray inside).
Labels = Sequence[int] | npt.NDArray[np.integer[Any] | np.bool_]
Scores = Sequence[float] | npt.NDArray[np.floating[Any] | np.integer[Any]]


def auroc(labels: Labels, scores: Scores) -> float:
    """Area under the ROC curve; NaN when only one class is present."""
    labels_array = np.asarray(labels)
    if len(np.unique(labels_array)) < 2:
        return float("nan")
    return float(roc_auc_score(labels_array, np.asarray(scores, dtype=np.float64)))


def _finite_scores(scores: Scores, what: str) -> npt.NDArray[np.float64]:
    """``scores`` as a 1-D float64 array; a NaN or infinite score is refused (it would silently
    make a threshold NaN, or count as never flagged)."""
    array = np.asarray(scores, dtype=np.float64)
    if array.ndim != 1:
        raise ValueError(f"{what} must be one score per sample (1-D), got shape {array.shape}")
    bad = int((~np.isfinite(array)).sum())
    if bad:
        raise ValueError(f"{what}: {bad} of {len(array)} scores are NaN or infinite")
    return array


def threshold_at_fpr(control_scores: Scores, fpr: float = 0.01) -> float:
    """Score above which only ``fpr`` of benign control samples fall (the 99th percentile for 1%)."""
    if not 0 < fpr < 1:
        raise ValueError(f"fpr must be in (0, 1), got {fpr}")
    scores = _finite_scores(control_scores, "control scores")
    if len(scores) == 0:
        raise ValueError("the control set is empty")
    return float(np.quantile(scores, 1 - fpr))


def recall_at_threshold(labels: Labels, scores: Scores, threshold: float) -> float:
    """Share of positive (deceptive) samples scoring strictly above ``threshold``; NaN without
    positives or without a threshold (NaN)."""
    labels_array, scores_array = np.asarray(labels), _finite_scores(scores, "scores")
    if labels_array.shape != scores_array.shape:
        raise ValueError(f"{len(labels_array)} labels but {len(scores_array)} scores")
    positives = labels_array == 1
    if not positives.any() or np.isnan(threshold):  # no threshold (NaN): no recall, not 0
        return float("nan")
    return float((scores_array[positives] > threshold).mean())
