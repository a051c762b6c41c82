"""The recipe study's table (markdown) and plot (test AUROC with its 95 % interval per recipe and
model, recall at 1 % FPR beside it), from ``probes recipes`` JSON files."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from lens_evals.probing.recipe_defaults import APOLLO_70B_AUROC


def _runs(paths: list[Path]) -> list[dict[str, Any]]:
    return [json.loads(p.read_text(encoding="utf-8")) for p in paths]


def recipes_table(paths: list[Path]) -> str:
    lines = [
        "| model | recipe | layers | agg. | dev AUROC | test AUROC [95 %] | recall at 1 % FPR | honest flagged |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for run in _runs(paths):
        for row in run["recipes"]:
            low, high = row["test_auroc_95"]
            best = " **(best on dev)**" if row["recipe"] == run["best_by_dev"] else ""
            lines.append(
                f"| {run['model']} | {row['recipe']}{best} | {','.join(map(str, row['layers']))} | {row['aggregation']} "
                f"| {row['dev_auroc']:.3f} | {row['test_auroc']:.3f} [{low:.3f}, {high:.3f}] | {row['recall_at_1pct_fpr']:.3f} "
                f"| {row['flagged_honest']:.3f} |"
            )
    return "\n".join(lines)


def plot_recipes(paths: list[Path], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = _runs(paths)
    n_rows = max(len(r["recipes"]) for r in runs)
    fig, (left, right) = plt.subplots(
        1, 2, figsize=(12, 0.32 * n_rows * len(runs) + 1.8), sharey=True, gridspec_kw={"width_ratios": [3, 1.3]}
    )
    labels: list[str] = []
    for offset, run in enumerate(runs):
        for row in run["recipes"]:
            y = len(labels)
            low, high = row["test_auroc_95"]
            colour = "tab:red" if row["recipe"] == run["best_by_dev"] else f"C{offset}"
            left.errorbar(
                row["test_auroc"], y, xerr=[[row["test_auroc"] - low], [high - row["test_auroc"]]], fmt="o", color=colour, capsize=2
            )
            left.plot(row["dev_auroc"], y, marker="x", color="grey", linestyle="none")
            right.barh(y, row["recall_at_1pct_fpr"], color=colour, alpha=0.7)
            labels.append(f"{run['model'].removesuffix('-instruct')}: {row['recipe']}")
    left.axvline(0.5, color="grey", linewidth=0.8, linestyle="--")
    left.axvline(APOLLO_70B_AUROC, color="tab:green", linewidth=0.8, linestyle=":", label=f"Apollo 70B ({APOLLO_70B_AUROC})")
    left.set_yticks(range(len(labels)))
    left.set_yticklabels(labels, fontsize=7)
    left.invert_yaxis()
    left.set(xlim=(0.2, 1.0), xlabel="Roleplaying AUROC (test split, o with 95 % bootstrap; x: dev split)")
    left.legend(fontsize=7, loc="lower right")
    right.set(xlim=(0, 1), xlabel="recall at 1 % FPR on control answers")
    fig.suptitle("Probe recipes trained off Roleplaying (red: chosen on the dev split)", fontsize=10)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
