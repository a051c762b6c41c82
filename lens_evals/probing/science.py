"""The science run: one model, every layer, the three probes, honest numbers.

1. Capture Instructed-Pairs and our Roleplaying scenarios (off-policy) at every layer, one engine.
2. Per layer, fit ``ip-lr`` and ``ip-dom`` on 80 % of the Instructed-Pairs facts and measure
   validation AUROC on the other 20 % (grouped by fact); Roleplaying AUROC per layer is recorded
   for the plot only. The layer is the one with the best ``ip-lr`` validation AUROC: Roleplaying
   never chooses it.
3. At that layer: refit ``ip-lr`` / ``ip-dom`` on all Instructed-Pairs, ``rp-lr`` by grouped K-fold
   over scenarios, thresholds from the model's own answers to the control requests (with a
   bootstrap interval), then Roleplaying AUROC and recall at 1 % FPR per probe.

Writes ``OUT/MODEL-DTYPE.json`` and the probe set ``PROBE_DIR/MODEL__probe-set.{json,npz}``.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import numpy as np

from lens_evals.engine.frontend.offline import engine_for
from lens_evals.probing import datasets
from lens_evals.probing.extract import answer_requests
from lens_evals.probing.metrics import auroc
from lens_evals.probing.multi import (
    evaluate_offline,
    fit_difference_of_means,
    fit_logistic,
    fit_probe_set,
    probe_set_path,
    result_rows,
    threshold_interval,
)
from lens_evals.probing.train import capture, load_training_set, split_groups


def layer_rows(pairs: Any, roleplaying: Any, train: np.ndarray, val: np.ndarray) -> list[dict[str, Any]]:
    labels, rp_labels = np.array(pairs.labels), np.array(roleplaying.labels)
    rows = []
    for layer in pairs.layers:
        features, rp_features = pairs.at(layer), roleplaying.at(layer)
        row: dict[str, Any] = {"layer": layer}
        for kind, fit in (("ip-lr", fit_logistic), ("ip-dom", fit_difference_of_means)):
            readout = fit(kind, layer, [features[i] for i in train], labels[train])
            row[f"{kind}_validation_auroc"] = auroc(labels[val], readout.scores([features[i] for i in val]))
            row[f"{kind}_roleplaying_auroc"] = auroc(rp_labels, readout.scores(rp_features))
        rows.append(row)
    return rows


def chosen_layer(rows: list[dict[str, Any]]) -> int:
    """The layer whose ip-lr probe scores best on Instructed-Pairs validation (the first of ties):
    chosen without looking at Roleplaying, the test set."""
    return int(max(rows, key=lambda r: r["ip-lr_validation_auroc"])["layer"])


def run_science(
    model: str,
    out: str | Path = "docs/results",
    dtype: str | None = None,
    ip_limit: int | None = None,
    control_limit: int | None = None,
    control_max_tokens: int = 48,
    n_folds: int = 5,
    roleplaying_limit: int | None = None,
    llm: Any = None,
    engine_args: dict[str, Any] | None = None,
) -> dict[str, Any]:
    timings: dict[str, float] = {}
    start = time.perf_counter()
    with engine_for(model, llm, {**({"dtype": dtype} if dtype else {}), **(engine_args or {})}) as engine:
        timings["engine_start_s"] = time.perf_counter() - start
        config = engine.llm_engine.model_config
        layers = list(range(config.hf_config.num_hidden_layers))
        pairs_dialogues = load_training_set("instructed-pairs", ip_limit)
        roleplaying_dialogues = datasets.roleplaying_dialogues()[: 2 * roleplaying_limit if roleplaying_limit else None]

        start = time.perf_counter()
        pairs = capture(engine, pairs_dialogues, layers, "all", desc="instructed-pairs, every layer")
        roleplaying = capture(engine, roleplaying_dialogues, layers, "all", desc="roleplaying, every layer")
        timings["capture_s"] = time.perf_counter() - start
        train, val = split_groups(pairs_dialogues)
        rows = layer_rows(pairs, roleplaying, train, val)
        chosen = chosen_layer(rows)
        dtype_name = str(config.dtype).removeprefix("torch.")
        out_path = Path(out) / f"{Path(model).name}-{dtype_name}.json"
        out_path.parent.mkdir(parents=True, exist_ok=True)
        partial = out_path.with_suffix(".layers.json")  # kept if a later step fails
        partial.write_text(json.dumps({"chosen_layer": chosen, "layers": rows}, indent=2) + "\n", encoding="utf-8")

        probes = fit_probe_set(
            Path(model).name, chosen, pairs.at(chosen), pairs.labels, roleplaying.at(chosen), roleplaying_dialogues, n_folds
        )
        start = time.perf_counter()
        control = answer_requests(engine, datasets.control_requests()[:control_limit], max_tokens=control_max_tokens)
        timings["control_answers_s"] = time.perf_counter() - start
        control_features = capture(engine, control, [chosen], "all", desc="control answers").at(chosen)
        probes.calibrate(control_features)
        control_scores = {name: r.scores(control_features) for name, r in probes.readouts.items()}
        intervals = {name: threshold_interval(scores) for name, scores in control_scores.items()}
        by_size = {
            kind: {n: threshold_interval(control_scores[kind][:n]) for n in (100, 250, 500, len(control)) if n <= len(control)}
            for kind in ("ip-lr", "ip-dom")
        }
        results = result_rows(evaluate_offline(probes, roleplaying.at(chosen), roleplaying_dialogues))
        probes.card = {
            "dtype": dtype_name,
            "fit_intercept": False,
            "C": 0.1,
            "n_instructed_pairs": len(pairs_dialogues),
            "n_control": len(control),
            "control_max_tokens": control_max_tokens,
            "n_folds": n_folds,
            "chosen_by": "ip-lr validation AUROC on held-out Instructed-Pairs facts",
            "validation_auroc": {
                kind: next(r for r in rows if r["layer"] == chosen)[f"{kind}_validation_auroc"] for kind in ("ip-lr", "ip-dom")
            },
        }
        probes.save(probe_set_path(model))
        result = {
            "model": Path(model).name,
            "dtype": dtype_name,
            "n_layers": len(layers),
            "hidden_size": config.hf_config.hidden_size,
            "n_parameters": sum(int(np.prod(shape)) for shape in _parameter_shapes(config)),
            "n_instructed_pairs": len(pairs_dialogues),
            "n_validation": int(len(val)),
            "n_roleplaying": len(roleplaying_dialogues),
            "n_control": len(control),
            "control_max_tokens": control_max_tokens,
            "chosen_layer": chosen,
            "layers": rows,
            "probes": results,
            "thresholds": {name: {"threshold": r.threshold, "bootstrap_95": intervals[name]} for name, r in probes.readouts.items()},
            "threshold_interval_by_control_size": by_size,
            "control_scores": {kind: [round(float(v), 4) for v in control_scores[kind]] for kind in ("ip-lr", "ip-dom")},
            "timings_s": {k: round(v, 1) for k, v in timings.items()},
            "date": time.strftime("%Y-%m-%d"),
        }
        out_path.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
        partial.unlink()
        return result


def _parameter_shapes(config: Any) -> list[tuple[int, ...]]:
    """Parameter count from the HF config alone (embeddings, attention, MLP, every norm, an untied
    output head; biases left out)."""
    hf = config.hf_config
    hidden, inter, vocab, layers = hf.hidden_size, hf.intermediate_size, hf.vocab_size, hf.num_hidden_layers
    heads, kv = hf.num_attention_heads, getattr(hf, "num_key_value_heads", hf.num_attention_heads)
    head_dim = getattr(hf, "head_dim", None) or hidden // heads
    per_layer = [(hidden, heads * head_dim), (hidden, 2 * kv * head_dim), (heads * head_dim, hidden), (hidden, 3 * inter), (hidden, 2)]
    head = [] if getattr(hf, "tie_word_embeddings", True) else [(vocab, hidden)]  # tied: counted once, as model cards do
    return [(vocab, hidden), *(per_layer * layers), (hidden,), *head]  # (hidden,): the final norm


def plot_results(paths: list[Path], out: Path) -> None:
    """AUROC on Roleplaying against relative layer depth (left) and model size (right)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    runs = sorted((json.loads(p.read_text(encoding="utf-8")) for p in paths), key=lambda r: r["n_parameters"])
    fig, (by_layer, by_size) = plt.subplots(1, 2, figsize=(11, 4.2))
    for run in runs:
        depth = [r["layer"] / (run["n_layers"] - 1) for r in run["layers"]]
        label = f"{run['model']} ({run['dtype']})"
        (line,) = by_layer.plot(depth, [r["ip-lr_roleplaying_auroc"] for r in run["layers"]], marker=".", label=label)
        by_layer.plot(depth, [r["ip-lr_validation_auroc"] for r in run["layers"]], linestyle=":", color=line.get_color())
        by_layer.axvline(run["chosen_layer"] / (run["n_layers"] - 1), color=line.get_color(), linewidth=0.6, alpha=0.6)
    by_layer.axhline(0.5, color="grey", linewidth=0.8, linestyle="--")
    by_layer.set(
        xlabel="layer / (n_layers - 1)",
        ylabel="AUROC",
        ylim=(0.3, 1.02),
        title="ip-lr per layer: Roleplaying (solid), IP validation (dotted)",
    )
    by_layer.legend(fontsize=7, loc="lower right")
    sizes = [r["n_parameters"] / 1e9 for r in runs]
    for kind, marker in (("ip-lr", "o"), ("ip-dom", "s"), ("rp-lr", "^")):
        values = [next(p["auroc"] for p in r["probes"] if p["probe"] == kind) for r in runs]
        by_size.plot(sizes, values, marker=marker, label=kind)
    by_size.axhline(0.5, color="grey", linewidth=0.8, linestyle="--")
    by_size.set(
        xscale="log",
        xlabel="parameters (billions, log)",
        ylabel="Roleplaying AUROC at the chosen layer",
        ylim=(0.3, 1.02),
        title="AUROC by model size",
    )
    by_size.xaxis.set_major_locator(matplotlib.ticker.FixedLocator(sizes))  # one tick per model, no log clutter
    by_size.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
    by_size.set_xticklabels([f"{size:.3g}" for size in sizes])
    by_size.legend(fontsize=8)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)


def results_table(paths: list[Path]) -> str:
    """The results page's table (markdown), one row per model and probe."""
    runs = sorted((json.loads(p.read_text(encoding="utf-8")) for p in paths), key=lambda r: r["n_parameters"])
    lines = [
        "| model | params | dtype | layer (of) | IP val. AUROC | probe | Roleplaying AUROC | recall at 1 % FPR | threshold [95 % bootstrap] | control |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for run in runs:
        chosen = next(r for r in run["layers"] if r["layer"] == run["chosen_layer"])
        for probe in run["probes"]:
            kind = probe["probe"]
            if kind in run["thresholds"]:
                t = run["thresholds"][kind]
                threshold = f"{t['threshold']:.2f} [{t['bootstrap_95'][0]:.2f}, {t['bootstrap_95'][1]:.2f}]"
            else:
                threshold = "per fold"
            validation = f"{chosen[f'{kind}_validation_auroc']:.3f}" if f"{kind}_validation_auroc" in chosen else "—"
            lines.append(
                f"| {run['model']} | {run['n_parameters'] / 1e6:.0f} M | {run['dtype']} | {run['chosen_layer']} "
                f"({run['n_layers']}) | {validation} | {kind} | {probe['auroc']:.3f} | {probe['recall_at_1pct_fpr']:.3f} "
                f"| {threshold} | {run['n_control']} x {run['control_max_tokens']} tok |"
            )
    return "\n".join(lines)
