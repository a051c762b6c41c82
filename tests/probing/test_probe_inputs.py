"""Bad inputs to probe metrics and probe files: refused with a ValueError that names the
problem, never a silent NaN threshold, a card that cannot be read back, or a probe set whose
readouts do not fit together."""

from __future__ import annotations

import json

import numpy as np
import pytest

from lens_evals.probing.metrics import recall_at_threshold, threshold_at_fpr
from lens_evals.probing.multi import ProbeSet, Readout, fit_difference_of_means, load_probe_set
from lens_evals.probing.probe import Probe, load_probe
from lens_evals.probing.train import fit_pipeline
from tests.probing.test_probing import _card

NAN = float("nan")


def test_a_nan_control_score_is_refused_not_turned_into_a_nan_threshold() -> None:
    with pytest.raises(ValueError, match="1 of 3 scores are NaN"):
        threshold_at_fpr([0.1, NAN, 0.3])
    with pytest.raises(ValueError, match="1-D"):
        threshold_at_fpr(np.ones((3, 4)))  # one row per token, not per sample
    # finite scores: numpy's linear-interpolation quantile, 0..9 at 5 % -> 9 - 0.05 * 9 = 8.55
    assert threshold_at_fpr(np.arange(10.0), 0.05) == pytest.approx(8.55)


def test_recall_without_a_threshold_is_nan_and_bad_scores_are_refused() -> None:
    assert np.isnan(recall_at_threshold([1, 1, 0], [0.1, 2.0, 3.0], NAN))  # was 0.0
    assert recall_at_threshold([1, 1, 0], [0.1, 2.0, 3.0], 1.0) == 0.5  # hand count: one of two positives above
    with pytest.raises(ValueError, match="NaN"):
        recall_at_threshold([1, 1], [NAN, 1.0], 0.5)  # was 0.5: the NaN counted as "not flagged"
    with pytest.raises(ValueError, match="3 labels but 2 scores"):
        recall_at_threshold([1, 1, 0], [0.1, 1.0], 0.5)


def _probe(hidden: int = 4, **card_changes: object) -> Probe:
    rng = np.random.default_rng(0)
    features = [rng.normal(size=(3, hidden)) + label for label in (0, 1) * 5]
    return Probe(fit_pipeline(features, [0, 1] * 5), _card(hidden_size=hidden, **card_changes))


def test_a_card_with_a_nan_validation_auroc_loads_back(tmp_path) -> None:
    # a validation split with one class gives AUROC NaN; JSON null made the saved card unreadable
    loaded = load_probe(_probe(validation_auroc=NAN).save(tmp_path))
    assert np.isnan(loaded.card.validation_auroc)
    assert loaded.card.threshold == 1.25


def test_a_probe_whose_card_gives_another_hidden_size_is_refused(tmp_path) -> None:
    path = _probe(hidden=4).save(tmp_path)
    card = json.loads(path.with_suffix(".json").read_text())
    path.with_suffix(".json").write_text(json.dumps({**card, "hidden_size": 8}))
    with pytest.raises(ValueError, match="reads 4 features but its card .* says hidden_size 8"):
        load_probe(path)


def _save_set(tmp_path):
    readouts = {
        "ip-lr": Readout("ip-lr", 1, np.arange(4, dtype=np.float32), 0.5, 1.0),
        "ip-dom": Readout("ip-dom", 1, np.ones(4, np.float32), -0.5, 2.0),
    }
    return ProbeSet("m", 1, readouts).save(tmp_path / "set")


def _rewrite_meta(change):
    def apply(json_path, npz_path):
        meta = json.loads(json_path.read_text())
        change(meta)
        json_path.write_text(json.dumps(meta))

    return apply


def _rewrite_arrays(**arrays):
    return lambda json_path, npz_path: np.savez(npz_path, **arrays)


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (_rewrite_arrays(**{"ip-lr": np.ones((2, 4)), "ip-dom": np.ones(4)}), "1-D real array, got float64 \\(2, 4\\)"),
        (_rewrite_arrays(**{"ip-lr": np.ones(3), "ip-dom": np.ones(4)}), "one hidden size"),
        (_rewrite_arrays(**{"ip-lr": np.ones(4) * 1j, "ip-dom": np.ones(4)}), "complex128"),
        (_rewrite_arrays(**{"ip-lr": np.full(4, np.nan), "ip-dom": np.ones(4)}), "NaN or inf"),
        (_rewrite_arrays(**{"ip-lr": np.array([{"a": 1}], dtype=object), "ip-dom": np.ones(4)}), "allow_pickle=False"),
        (_rewrite_arrays(**{"ip-dom": np.ones(4)}), "'ip-lr' has no weights"),
        (_rewrite_meta(lambda meta: meta["readouts"]["ip-lr"].update(layer=-1)), "read layers 0 or more"),
        (_rewrite_meta(lambda meta: meta.pop("readouts")), "no key 'readouts'"),
        (_rewrite_meta(lambda meta: meta["readouts"]["ip-lr"].update(bias=None)), "not 'NoneType'"),
    ],
)
def test_a_damaged_probe_set_is_refused_with_its_name(tmp_path, damage, message) -> None:
    json_path = _save_set(tmp_path)
    assert load_probe_set(json_path).readouts["ip-lr"].bias == 0.5  # the undamaged set loads
    damage(json_path, json_path.with_suffix(".npz"))
    with pytest.raises(ValueError, match=f"set.json \\+ set.npz is not a usable probe set: .*{message}"):
        load_probe_set(json_path)


def test_a_difference_of_means_on_one_class_is_refused_not_nan() -> None:
    one_class = [np.ones((2, 3)), np.zeros((1, 3))]
    with pytest.raises(ValueError, match="both classes, got labels \\[1\\]"):
        fit_difference_of_means("ip-dom", 1, one_class, [1, 1])  # was: weights and bias all NaN
    readout = fit_difference_of_means("ip-dom", 1, one_class, [1, 0])  # hand: w = 1 - 0, bias = -w . (1 + 0) / 2
    assert readout.weights.tolist() == [1.0, 1.0, 1.0] and readout.bias == -1.5
