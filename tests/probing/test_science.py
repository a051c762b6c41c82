"""The science run's pieces that need no engine: the per-layer table picks the layer on
Instructed-Pairs validation only, the parameter count from a config, and the plot."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from sklearn.metrics import roc_auc_score
from transformers import AutoConfig

from lens_evals.probing.dialogues import Dialogue
from lens_evals.probing.science import _parameter_shapes, chosen_layer, layer_rows, plot_results, results_table
from lens_evals.probing.train import LayerFeatures


def features(n: int, informative_layer: int, seed: int) -> LayerFeatures:
    """Three layers of noise; only ``informative_layer`` shifts deceptive dialogues."""
    rng = np.random.default_rng(seed)
    labels = [i % 2 for i in range(n)]
    dialogues = [Dialogue(messages=[{"role": "assistant", "content": "x"}], label=y, group=f"g{i // 2}") for i, y in enumerate(labels)]
    rows = []
    for y in labels:
        stream = rng.normal(size=(3, 4, 8)).astype(np.float32)
        stream[informative_layer] += 1.5 * y
        rows.append(stream)
    return LayerFeatures([0, 1, 2], dialogues, rows)


def test_layer_rows_find_the_informative_layer_on_validation():
    pairs, roleplaying = features(80, informative_layer=2, seed=0), features(40, informative_layer=0, seed=1)
    train, val = np.arange(0, 64), np.arange(64, 80)
    rows = layer_rows(pairs, roleplaying, train, val)
    best = rows[chosen_layer(rows)]
    assert best["layer"] == 2 and best["ip-lr_validation_auroc"] > 0.9 and best["ip-dom_validation_auroc"] > 0.9
    # the chooser reads ip-lr's validation AUROC alone, the first of ties (the end-to-end run's tiny
    # model scores 1.0 at every layer, so there it cannot tell this from "always the first layer"):
    # Roleplaying's best is layer 3, ip-dom's layer 0, the last of the ties layer 3
    by_hand = [
        {"layer": n, "ip-lr_validation_auroc": v, "ip-lr_roleplaying_auroc": r, "ip-dom_validation_auroc": d}
        for n, (v, r, d) in enumerate([(0.5, 0.6, 0.95), (0.9, 0.5, 0.6), (0.7, 0.55, 0.6), (0.9, 0.8, 0.6)])
    ]
    assert chosen_layer(by_hand) == 1
    assert all(r[f"{kind}_validation_auroc"] < 0.8 for r in rows[:2] for kind in ("ip-lr", "ip-dom"))
    assert all(0.0 <= r[f"{kind}_roleplaying_auroc"] <= 1.0 for r in rows for kind in ("ip-lr", "ip-dom"))


def checkpoint_parameters(path: Path) -> int:
    """The parameter count of a checkpoint's safetensors files (the reference for the config's)."""
    from safetensors import safe_open

    total = 0
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), framework="numpy") as tensors:
            total += sum(math.prod(tensors.get_slice(name).get_shape()) for name in tensors.keys())
    return total


def parameter_count(path: Path) -> int:
    return sum(int(np.prod(s)) for s in _parameter_shapes(SimpleNamespace(hf_config=AutoConfig.from_pretrained(path))))


def test_parameter_count_from_the_config_matches_smollm2(smollm2_path):
    # SmolLM2-135M: tied embeddings, 30 norm pairs and the final norm (576), no biases
    assert parameter_count(smollm2_path) == checkpoint_parameters(smollm2_path) == 134_515_008


def test_plot_results_writes_a_png(tmp_path):
    paths = []
    for name, size in (("a", 1e8), ("b", 5e8)):
        run = {
            "model": name,
            "dtype": "float32",
            "n_layers": 3,
            "n_parameters": size,
            "chosen_layer": 1,
            "layers": [{"layer": i, "ip-lr_roleplaying_auroc": 0.5 + i / 10, "ip-lr_validation_auroc": 0.9} for i in range(3)],
            "probes": [{"probe": k, "auroc": 0.6, "recall_at_1pct_fpr": 0.25} for k in ("ip-lr", "ip-dom", "rp-lr")],
            "thresholds": {"ip-lr": {"threshold": 1.5, "bootstrap_95": [1.25, 2.0]}},
            "n_control": 10,
            "control_max_tokens": 8,
        }
        paths.append(tmp_path / f"{name}.json")
        paths[-1].write_text(json.dumps(run))
    plot_results(paths, tmp_path / "plot.png")
    assert (tmp_path / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = results_table(paths).splitlines()
    assert len(table) == 2 + 6 and table[2].startswith("| a | 100 M | float32 | 1 (3) | 0.900 | ip-lr | 0.600 | 0.250 |")
    assert "1.50 [1.25, 2.00]" in table[2] and "per fold" in table[4] and "| — |" in table[3]


def test_the_science_run_end_to_end_on_tiny_llama(tiny_path, tmp_path, monkeypatch):
    """Every step on a real (tiny, random) engine: the JSON has every layer, the layer chosen on
    Instructed-Pairs validation (every layer scores 1.0 there on this model: the first), the exact
    parameter count, and three probes whose AUROC and recall equal scikit-learn's and a count's
    on the saved probe set's scores of the Roleplaying dialogues captured afresh."""
    from lens_evals.probing.datasets import roleplaying_dialogues
    from lens_evals.probing.multi import load_probe_set, probe_set_path, scenario_key
    from lens_evals.probing.science import run_science
    from lens_evals.probing.train import capture
    from tests.conftest import make_llm

    monkeypatch.setenv("LENS_EVALS_PROBE_DIR", str(tmp_path / "probes"))
    with make_llm(tiny_path, enable_prefix_caching=False) as llm:
        result = run_science(
            str(tiny_path),
            tmp_path / "results",
            ip_limit=24,
            control_limit=12,
            control_max_tokens=6,
            n_folds=2,
            roleplaying_limit=6,
            llm=llm,
        )
        # the reference: the same 12 Roleplaying dialogues captured afresh at the chosen layer
        dialogues = roleplaying_dialogues()[:12]
        features = capture(llm, dialogues, [result["chosen_layer"]], "all", desc="reference").at(result["chosen_layer"])
    assert [r["layer"] for r in result["layers"]] == [0, 1, 2, 3] and result["n_roleplaying"] == 12
    validation = [r["ip-lr_validation_auroc"] for r in result["layers"]]
    assert result["chosen_layer"] == int(np.argmax(validation)), validation  # the first best, on validation only
    assert result["n_parameters"] == checkpoint_parameters(tiny_path) == 722_048  # untied head counted
    # every probe's AUROC (scikit-learn) and recall (by hand) from its saved readouts' scores
    probes = load_probe_set(probe_set_path(str(tiny_path)))
    labels = np.array([int(d.label) for d in dialogues])
    assert [p["probe"] for p in result["probes"]] == ["ip-lr", "ip-dom", "rp-lr"] and 0 < labels.sum() < len(labels)
    for row in result["probes"]:
        readouts = [probes.readout_for(row["probe"], scenario_key(d)) for d in dialogues]
        scores = np.array(
            [float((f.astype(np.float64) @ r.weights.astype(np.float64)).mean()) + r.bias for r, f in zip(readouts, features)]
        )
        thresholds = np.array([r.threshold for r in readouts])
        assert row["auroc"] == pytest.approx(roc_auc_score(labels, scores), abs=1e-12), row
        assert row["recall_at_1pct_fpr"] == pytest.approx(float((scores > thresholds)[labels == 1].mean()), abs=1e-12), row
    saved = json.loads((tmp_path / "results" / f"{tiny_path.name}-float32.json").read_text())
    assert saved["probes"] == result["probes"] and not list((tmp_path / "results").glob("*.layers.json"))
    assert probes.layer == result["chosen_layer"]
    low, high = result["thresholds"]["ip-lr"]["bootstrap_95"]
    assert low <= probes.readouts["ip-lr"].threshold <= high
