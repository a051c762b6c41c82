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


def threshold_at_fpr(control_scores: Scores, fpr: float = 0.01) -> float:
    """Score above which only ``fpr`` of benign control samples fall (the 99th percentile for 1%)."""
    if not 0 < fpr < 1:
        raise ValueError(f"fpr must be in (0, 1), got {fpr}")
    if len(control_scores) == 0:
        raise ValueError("the control set is empty")
    return float(np.quantile(np.asarray(control_scores, dtype=np.float64), 1 - fpr))


def recall_at_threshold(labels: Labels, scores: Scores, threshold: float) -> float:
    """Share of positive (deceptive) samples scoring strictly above ``threshold``."""
    labels_array, scores_array = np.asarray(labels), np.asarray(scores, dtype=np.float64)
    positives = labels_array == 1
    if not positives.any():
        return float("nan")
    return float((scores_array[positives] > threshold).mean())
