"""Probe files that cannot run code: safetensors weights + JSON card, rebuilt into a scikit-learn
pipeline that scores exactly as the saved one; joblib pickles only when named and opted in; the
default probes are the repository's, never the working directory's ./probes. No engine."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import joblib
import numpy as np
import pytest
from safetensors.numpy import load_file
from sklearn.linear_model import LogisticRegression
from sklearn.pipeline import Pipeline, make_pipeline
from sklearn.preprocessing import StandardScaler

from lens_evals import settings
from lens_evals.cli.app import main
from lens_evals.inspect_kit.default_probes import default_probe, default_probe_set
from lens_evals.probing.probe import Probe, convert_probe, load_probe
from tests.probing.test_probing import _card

ROOT = Path(__file__).resolve().parents[2]
RNG = np.random.default_rng(11)


def _fitted(hidden: int = 8, dtype: type = np.float64, **options: object) -> Pipeline:
    rows = RNG.normal(size=(60, hidden)).astype(dtype)
    labels = (rows[:, 0] + 0.3 * RNG.normal(size=60) > 0).astype(int)
    scaler = StandardScaler(with_mean=bool(options.pop("with_mean", True)))
    return make_pipeline(scaler, LogisticRegression(**options)).fit(rows, labels)  # type: ignore[arg-type]


def _assert_same_scores(a: Pipeline, b: Pipeline, hidden: int) -> None:
    rows = RNG.normal(scale=3.0, size=(200, hidden))
    for method in ("decision_function", "predict_proba", "predict"):
        assert np.array_equal(getattr(a, method)(rows), getattr(b, method)(rows)), method
        assert np.array_equal(getattr(a, method)(rows.astype(np.float32)), getattr(b, method)(rows.astype(np.float32))), method


@pytest.mark.parametrize(
    "options",
    [{}, {"dtype": np.float32}, {"C": 3.0, "fit_intercept": False}, {"with_mean": False, "class_weight": "balanced"}],
    ids=["float64", "float32 rows", "no intercept", "no centering"],
)
def test_a_saved_probe_loads_back_scoring_exactly_as_it_did(tmp_path, options) -> None:
    probe = Probe(_fitted(**dict(options)), _card())
    path = probe.save(tmp_path)
    assert path == tmp_path / "unit.safetensors" and sorted(p.name for p in tmp_path.iterdir()) == ["unit.json", "unit.safetensors"]
    assert set(load_file(str(path))) >= {"standardscaler.scale_", "logisticregression.coef_", "logisticregression.intercept_"}
    card = json.loads((tmp_path / "unit.json").read_text())
    assert [step["kind"] for step in card["pipeline"]] == ["StandardScaler", "LogisticRegression"]
    loaded = load_probe(path)
    assert loaded.card == probe.card
    assert [type(step).__name__ for step in loaded.pipeline] == ["StandardScaler", "LogisticRegression"]
    _assert_same_scores(loaded.pipeline, probe.pipeline, 8)
    weights, bias = loaded.folded()
    assert np.array_equal(weights, probe.folded()[0]) and bias == probe.folded()[1]


def _joblib_probe(directory: Path, name: str = "unit") -> tuple[Path, Pipeline]:
    """A probe as saved before safetensors: NAME.joblib + a card without pipeline steps."""
    pipeline = _fitted()
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{name}.joblib"
    joblib.dump(pipeline, path)
    card = _card(name=name).model_dump(mode="json", exclude={"pipeline"})
    (directory / f"{name}.json").write_text(json.dumps(card))
    return path, pipeline


def test_a_joblib_probe_is_refused_without_opt_in_and_never_unpickled(tmp_path, monkeypatch) -> None:
    path, _ = _joblib_probe(tmp_path)

    def forbidden(*args: object, **kwargs: object) -> None:
        raise AssertionError("unpickled a probe file")

    for module, name in ((joblib, "load"), (pickle, "load"), (pickle, "loads")):
        monkeypatch.setattr(module, name, forbidden)
    monkeypatch.delenv(settings.ALLOW_PICKLE_PROBES.name, raising=False)
    for given in (path, tmp_path / "unit", tmp_path / "unit.json", tmp_path / "unit.safetensors"):
        with pytest.raises(ValueError, match=r"joblib pickle.*allow_pickle=True.*lens-evals probes convert .*unit\.joblib"):
            load_probe(given)
    monkeypatch.setenv(settings.ALLOW_PICKLE_PROBES.name, "0")
    with pytest.raises(ValueError, match="LENS_EVALS_ALLOW_PICKLE_PROBES=1"):
        load_probe(path)
    # Opted in, but not naming the .joblib file: still refused.
    with pytest.raises(ValueError, match="joblib pickle"):
        load_probe(tmp_path / "unit", allow_pickle=True)
    # Opted in and named: the pickle is what gets read (here the patched loader says so).
    with pytest.raises(AssertionError, match="unpickled"):
        load_probe(path, allow_pickle=True)
    monkeypatch.setenv(settings.ALLOW_PICKLE_PROBES.name, "1")
    with pytest.raises(AssertionError, match="unpickled"):
        load_probe(path)


def test_convert_gives_a_safetensors_probe_scoring_as_the_joblib_one(tmp_path, capsys) -> None:
    path, pipeline = _joblib_probe(tmp_path / "probes", "qwen2.5-coder-0.5b-instruct__x")  # dots in the name
    written = json.loads(path.with_suffix(".json").read_text())  # the old card, as saved (its time included)
    assert main(["probes", "convert", str(path)]) == 0
    converted = Path(capsys.readouterr().out.strip())
    assert converted == path.with_suffix(".safetensors")
    loaded = load_probe(converted)
    _assert_same_scores(loaded.pipeline, joblib.load(path), 8)
    _assert_same_scores(loaded.pipeline, pipeline, 8)
    assert loaded.card.model_dump(mode="json", exclude={"pipeline"}) == written
    assert load_probe(path.with_suffix("")).card == loaded.card  # the name alone now finds the safetensors file
    with pytest.raises(SystemExit):
        main(["probes", "convert", str(converted)])  # only .joblib files
    assert "is not a .joblib probe file" in capsys.readouterr().err
    assert convert_probe(path) == converted  # again: the same files
    joblib.dump(pipeline, tmp_path / "lone.joblib")  # no card beside it: a message, exit 2
    assert main(["probes", "convert", str(tmp_path / "lone.joblib")]) == 2
    assert "probe file missing" in capsys.readouterr().err and not (tmp_path / "lone.safetensors").exists()


def test_a_probes_folder_in_the_working_directory_is_not_the_default(tmp_path, monkeypatch) -> None:
    """Before: LENS_EVALS_PROBE_DIR unset meant ./probes, so running a task in someone else's
    checkout loaded (unpickled) whatever probe it held."""
    planted = tmp_path / "probes"
    for name in ("smollm2-135m-instruct__instructed-pairs", "smollm2-135m-instruct__coup"):
        _joblib_probe(planted, name)
        Probe(_fitted(), _card(name=name)).save(planted)
    for suffix in (".json", ".npz"):
        (planted / f"smollm2-135m-instruct__probe-set{suffix}").write_text("planted")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(settings.PROBE_DIR.name, raising=False)
    committed = ROOT / "probes"
    assert settings.PROBE_DIR.get() == committed
    assert default_probe() == committed / "smollm2-135m-instruct__instructed-pairs.safetensors"
    assert default_probe(training_set="coup") == committed / "smollm2-135m-instruct__coup.safetensors"
    assert default_probe_set().parent == committed
    assert load_probe(default_probe(training_set="coup")).card.hidden_size == 576  # the committed probe, not the planted one (8)
    monkeypatch.setenv(settings.PROBE_DIR.name, "probes")  # named by the user: theirs to choose
    assert default_probe().parent == Path("probes")


def test_committed_probes_are_safetensors_and_load(monkeypatch) -> None:
    committed = ROOT / "probes"
    assert not list(committed.glob("*.joblib")), "pickled probes are committed"
    names = sorted(path.stem for path in committed.glob("*.safetensors"))
    assert names == ["smollm2-135m-instruct__coup", "smollm2-135m-instruct__instructed-pairs"]
    rows = RNG.normal(size=(4, 576)).astype(np.float32)
    for name in names:
        probe = load_probe(committed / name)
        weights, bias = probe.folded()
        np.testing.assert_allclose(probe.token_scores(rows), rows @ weights + bias, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda st, card: card["pipeline"][0].update(kind="os.system"), "os.system"),
        (lambda st, card: card["pipeline"][1]["params"].update(bogus=1), "bogus"),
        (lambda st, card: card["pipeline"][1]["fitted"].update(__class__=1), "__class__"),
        (lambda st, card: card.update(pipeline=[]), "no pipeline steps"),
        (lambda st, card: st.write_bytes(st.read_bytes()[:-8]), "not a readable safetensors file"),
        (lambda st, card: st.write_bytes(b"\x80\x04" + pickle.dumps({"a": 1})), "not a readable safetensors file"),
    ],
    ids=["unknown step", "unknown parameter", "unknown attribute", "no steps", "truncated", "pickle bytes"],
)
def test_a_damaged_probe_file_is_a_clear_error(tmp_path, monkeypatch, damage, message) -> None:
    monkeypatch.setattr(pickle, "loads", lambda *a, **k: pytest.fail("unpickled"))
    path = Probe(_fitted(), _card()).save(tmp_path)
    card = json.loads(path.with_suffix(".json").read_text())
    damage(path, card)
    path.with_suffix(".json").write_text(json.dumps(card))
    with pytest.raises(ValueError, match=message):
        load_probe(path)
