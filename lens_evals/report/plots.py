"""The report's figures: matplotlib (Agg) rendered to inline SVG text (no files, no network)."""

from __future__ import annotations

import io
from collections.abc import Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.ticker import FuncFormatter, NullFormatter  # noqa: E402
from sklearn.metrics import roc_curve  # noqa: E402

# text.parse_math off: class names and families come from the log; "$...$" in one is text, not mathtext to parse
plt.rcParams.update({"svg.fonttype": "none", "font.size": 9, "figure.dpi": 100, "text.parse_math": False})
NEGATIVE_COLOUR, POSITIVE_COLOUR, CONTROL_COLOUR = "#2563eb", "#dc2626", "#6b7280"


def _svg(figure: Figure) -> str:
    buffer = io.StringIO()
    figure.savefig(buffer, format="svg", bbox_inches="tight")
    plt.close(figure)
    text = buffer.getvalue()
    return text[text.index("<svg") :]  # drop the XML prologue and doctype: the SVG sits inside HTML


def roc_svg(labels: Sequence[int], scores: Sequence[float], threshold: float, classes: tuple[str, str]) -> str:
    """ROC of score against label, with the probe's threshold (its 1%-FPR point on the control
    set) and the point at 1% FPR on this eval's own negatives."""
    y, s = np.asarray(labels), np.asarray(scores, dtype=np.float64)
    fpr, tpr, _ = roc_curve(y, s)
    figure, axes = plt.subplots(figsize=(4.2, 3.8))
    axes.plot(fpr, tpr, color="#111827", lw=1.6, label="ROC")
    axes.plot([0, 1], [0, 1], color="#9ca3af", lw=0.8, ls="--", label="chance")
    negatives, positives = s[y == 0], s[y == 1]
    at_threshold = (float((negatives > threshold).mean()), float((positives > threshold).mean()))
    axes.plot(
        *at_threshold,
        "o",
        color=POSITIVE_COLOUR,
        ms=7,
        label=f"probe threshold {threshold:.2f} (1% FPR on control): FPR {at_threshold[0]:.2f}, TPR {at_threshold[1]:.2f}",
    )
    one_percent = float(np.interp(0.01, fpr, tpr))
    axes.plot(0.01, one_percent, "s", color=NEGATIVE_COLOUR, ms=6, label=f"1% FPR on this eval's {classes[0]}: TPR {one_percent:.2f}")
    axes.set(
        xlabel=f"false positive rate ({classes[0]} flagged)",
        ylabel=f"true positive rate ({classes[1]} flagged)",
        xlim=(-0.01, 1.01),
        ylim=(-0.01, 1.01),
    )
    axes.legend(loc="upper center", bbox_to_anchor=(0.5, -0.16), fontsize=7, frameon=False)
    return _svg(figure)


def histogram_svg(
    labels: Sequence[int], scores: Sequence[float], threshold: float, classes: tuple[str, str], control: Sequence[float] = ()
) -> str:
    """Score histograms per class (density), the control set's distribution and the threshold."""
    y, s = np.asarray(labels), np.asarray(scores, dtype=np.float64)
    every = np.concatenate([s, np.asarray(control, dtype=np.float64), [threshold]])
    bins: list[float] = np.linspace(every.min(), every.max(), 40).tolist()  # hist's bins are typed as a Sequence
    figure, axes = plt.subplots(figsize=(6.4, 3.4))
    for label, colour in ((0, NEGATIVE_COLOUR), (1, POSITIVE_COLOUR)):
        chosen = s[y == label]
        if len(chosen):
            axes.hist(chosen, bins=bins, density=True, alpha=0.45, color=colour, label=f"{classes[label]} ({len(chosen)})")
    if len(control):
        axes.hist(
            control, bins=bins, density=True, histtype="step", lw=1.5, color=CONTROL_COLOUR, label=f"control answers ({len(control)})"
        )
    axes.axvline(threshold, color="#111827", lw=1.2, ls="--", label=f"threshold {threshold:.2f}")
    axes.set(xlabel="probe score (mean log-odds; higher = more " + classes[1] + ")", ylabel="density")
    axes.legend(fontsize=7)
    return _svg(figure)


def accuracy_svg(families: Sequence[str], oracle: Sequence[float], zero_vector: Sequence[float]) -> str:
    """Oracle accuracy per family against its zero-vector baseline."""
    x = np.arange(len(families))
    figure, axes = plt.subplots(figsize=(max(4.0, 0.9 * len(families) + 2), 3.2))
    axes.bar(x - 0.2, oracle, width=0.4, color=POSITIVE_COLOUR, label="oracle (activations injected)")
    axes.bar(x + 0.2, zero_vector, width=0.4, color=CONTROL_COLOUR, label="zero vector (nothing injected)")
    axes.set_xticks(x, families, rotation=20, ha="right")
    axes.set(ylabel="accuracy", ylim=(0, 1.05))
    axes.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.25), ncol=2, frameon=False)
    return _svg(figure)


def dose_response_svg(curves: dict[int, tuple[list[float], list[float], list[float]]], measure: str, log_y: bool = False) -> str:
    """A measure's mean against the steering scale, a line (with standard-error bars) per layer."""
    figure, axes = plt.subplots(figsize=(4.6, 3.4))
    colours = plt.get_cmap("viridis")(np.linspace(0.1, 0.85, max(1, len(curves))))
    for colour, (layer, (scales, means, errors)) in zip(colours, sorted(curves.items())):
        axes.errorbar(scales, means, yerr=errors, color=colour, marker="o", ms=4, lw=1.5, capsize=2, label=f"layer {layer}")
    axes.set(xlabel="steering scale (0 = unsteered)", ylabel=measure)
    if log_y:  # plain tick labels: mathtext is off (text.parse_math), so 10^2 would show as its source
        axes.set_yscale("log")
        axes.yaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
        axes.yaxis.set_minor_formatter(NullFormatter())
    axes.legend(fontsize=7)
    return _svg(figure)
