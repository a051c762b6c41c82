"""Layer sweep: train one probe per layer from a single capture of every layer, and plot
validation AUROC per layer. Roleplaying transfer AUROC is drawn too, for information only; the
layer is chosen on validation alone."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from lens_evals.engine.frontend.offline import engine_for
from lens_evals.probing import datasets
from lens_evals.probing.metrics import auroc
from lens_evals.probing.train import (
    DEFAULT_MODEL,
    DEFAULT_TRAINING_SET,
    capture,
    dialogue_scores,
    fit_pipeline,
    load_training_set,
    selection_for,
    split_groups,
)


def sweep_layers(
    model: str = DEFAULT_MODEL,
    training_set: str = DEFAULT_TRAINING_SET,
    layers: Sequence[int] | None = None,
    C: float = 0.1,
    out: str | Path = "probes/sweep",
    llm: Any = None,
    limit: int | None = None,
    with_roleplaying: bool = True,
    engine_args: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Writes ``OUT.json`` and ``OUT.png``; returns the per-layer results. Without ``llm`` an
    engine is opened with ``engine_args`` (extra vLLM arguments)."""
    with engine_for(model, llm, engine_args) as engine:
        n_layers = engine.llm_engine.model_config.hf_config.num_hidden_layers
        layer_list = sorted(layers) if layers else list(range(n_layers))
        selection, _ = selection_for(training_set)
        dialogues = load_training_set(training_set, limit)
        data = capture(engine, dialogues, layer_list, selection, desc=f"{training_set}, {len(layer_list)} layers")
        roleplaying = None
        if with_roleplaying:
            roleplaying = capture(engine, datasets.roleplaying_dialogues(), layer_list, "all", desc="roleplaying")
        train_index, val_index = split_groups(dialogues)
        labels = np.array(data.labels)
        rows = []
        for layer in layer_list:
            features = data.at(layer)
            pipeline = fit_pipeline([features[i] for i in train_index], labels[train_index], C=C)
            row = {
                "layer": layer,
                "validation_auroc": auroc(labels[val_index], dialogue_scores(pipeline, [features[i] for i in val_index])),
            }
            if roleplaying is not None:
                row["roleplaying_auroc"] = auroc(roleplaying.labels, dialogue_scores(pipeline, roleplaying.at(layer)))
            rows.append(row)
        best = max(rows, key=lambda r: r["validation_auroc"])
        result = {
            "model": Path(model).name,
            "training_set": training_set,
            "C": C,
            "n_dialogues": len(dialogues),
            "n_val_dialogues": len(val_index),
            "best_layer_by_validation": best["layer"],
            "layers": rows,
        }
        out_path = Path(out)
        out_path.parent.mkdir(parents=True, exist_ok=True)
        out_path.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
        plot_sweep(result, out_path.with_suffix(".png"))
        return result


def plot_sweep(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layers = [r["layer"] for r in result["layers"]]
    fig, ax = plt.subplots(figsize=(7, 3.8))
    ax.plot(
        layers,
        [r["validation_auroc"] for r in result["layers"]],
        marker="o",
        label=f"{result['training_set']} validation ({result['n_val_dialogues']} dialogues)",
    )
    if "roleplaying_auroc" in result["layers"][0]:
        ax.plot(
            layers,
            [r["roleplaying_auroc"] for r in result["layers"]],
            marker="s",
            linestyle="--",
            label="Roleplaying transfer (not used to choose)",
        )
    ax.axhline(0.5, color="grey", linewidth=0.8, linestyle=":")
    ax.axvline(result["best_layer_by_validation"], color="tab:green", linewidth=0.8, label="chosen layer")
    ax.set(xlabel="layer", ylabel="AUROC", ylim=(0.3, 1.02), title=f"Linear probe AUROC per layer: {result['model']}")
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
