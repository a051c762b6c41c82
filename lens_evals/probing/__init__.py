"""Linear probes on residual-stream activations: datasets, training, cards, metrics."""

from lens_evals.probing.dialogues import Dialogue, tokenize_dialogue
from lens_evals.probing.metrics import auroc, recall_at_threshold, threshold_at_fpr
from lens_evals.probing.probe import Probe, ProbeCard, load_probe

__all__ = ["Dialogue", "Probe", "ProbeCard", "auroc", "load_probe", "recall_at_threshold", "threshold_at_fpr", "tokenize_dialogue"]
