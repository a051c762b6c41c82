"""One readout of a probe set exported as a single-probe file (for the on-policy Roleplaying task,
which takes one probe): its scores, worker weights and threshold are the readout's."""

from __future__ import annotations

import numpy as np
import pytest

from lens_evals.probing.multi import ProbeSet, Readout, export_single_probe, load_probe_set
from lens_evals.probing.probe import load_probe
from tests.tolerance import assert_values_close

CARD = {"dtype": "bfloat16", "C": 0.1, "n_instructed_pairs": 40, "n_control": 12, "validation_auroc": {"ip-lr": 0.9, "ip-dom": 0.8}}


def saved_set(tmp_path, weights, bias, threshold=1.25, card=CARD):
    probes = ProbeSet(
        "some-model",
        3,
        {
            "ip-lr": Readout("ip-lr", 3, np.asarray(weights, np.float32), bias, threshold),
            "rp-lr/fold0": Readout("rp-lr/fold0", 3, np.ones(len(weights), np.float32), 0.0, 2.0),
        },
        card=card,
    )
    return probes.save(tmp_path / "some-model__probe-set")


def test_the_exported_probe_scores_as_the_readout_hand_computed(tmp_path):
    # weights (1, 2), bias 0.5: tokens (1, 1) and (3, 0) score 3.5 each, so the dialogue scores 3.5
    path = export_single_probe(saved_set(tmp_path, [1.0, 2.0], 0.5), "ip-lr", tmp_path / "single")
    probe = load_probe(path)
    assert probe.score(np.array([[1.0, 1.0], [3.0, 0.0]])) == 3.5
    assert (probe.layer, probe.card.threshold, probe.card.dtype, probe.card.validation_auroc) == (3, 1.25, "bfloat16", 0.9)
    weights, bias = probe.folded()
    assert weights.tolist() == [1.0, 2.0] and bias == 0.5  # what the worker is sent


def test_the_exported_probe_equals_the_readout_on_random_activations(tmp_path):
    rng = np.random.default_rng(0)
    set_path = saved_set(tmp_path, rng.normal(size=64), -0.3)
    readout = load_probe_set(set_path).readouts["ip-lr"]
    probe = load_probe(export_single_probe(set_path, "ip-lr", tmp_path / "single"))
    dialogues = [rng.normal(size=(n, 64)).astype(np.float32) for n in (1, 5, 17)]
    assert_values_close(np.array([probe.score(d) for d in dialogues]), readout.scores(dialogues), "exported vs readout")


def test_a_fold_readout_or_an_unknown_one_is_not_exported(tmp_path):
    set_path = saved_set(tmp_path, [1.0, 2.0], 0.0)
    for kind in ("rp-lr", "ip-dom"):
        with pytest.raises(ValueError, match="not a single readout"):
            export_single_probe(set_path, kind, tmp_path / "single")


def test_a_set_without_validation_auroc_exports_nan_not_zero(tmp_path):
    # `probes train-set` measures no validation AUROC: the exported card said 0.000 (worst possible)
    card = {k: v for k, v in CARD.items() if k != "validation_auroc"}
    probe = load_probe(export_single_probe(saved_set(tmp_path, [1.0, 2.0], 0.5, card=card), "ip-lr", tmp_path / "single"))
    assert np.isnan(probe.card.validation_auroc)
    assert probe.card.threshold == 1.25
