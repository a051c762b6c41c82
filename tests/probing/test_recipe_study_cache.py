"""The recipe study in two steps (what scripts/gpu_probe_recipes.sh does on the GPU): capture only,
then fit from the cache without opening the engine, with the same numbers as one run on the same
engine; on tiny-llama (no right answers: its known lies are too few and their row is left out)."""

from __future__ import annotations

import json

import pytest

from lens_evals.probing.recipe_study import run_recipe_study


def test_capture_only_then_fit_without_the_engine(llm, tiny_path, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cache, small = tmp_path / "cache", {"control_limit": 4, "control_max_tokens": 4, "ip_limit": 8, "roleplaying_limit": 12}
    captured = run_recipe_study(str(tiny_path), tmp_path / "a", cache=cache, llm=llm, capture_only=True, **small)
    assert captured["engine_opened"] and "recipes" not in captured and not (tmp_path / "a").exists()
    assert json.loads((cache / "model.json").read_text()) == {"n_layers": 4, "dtype": "float32"}

    def no_engine(*args, **kwargs):
        pytest.fail("the engine was opened although the cache holds every capture")

    monkeypatch.setattr("lens_evals.probing.recipe_study.engine_for", no_engine)
    fitted = run_recipe_study(str(tiny_path), tmp_path / "b", cache=cache, **small)
    assert fitted["engine_opened"] is False and fitted["known_lie_pairs"] < 4 and "lies" not in fitted["n_train"]
    monkeypatch.undo()
    once = run_recipe_study(str(tiny_path), tmp_path / "c", cache=tmp_path / "cache-c", llm=llm, **small)
    assert [r["recipe"] for r in fitted["recipes"]] == [r["recipe"] for r in once["recipes"]]
    for two_step, one_run in zip(fitted["recipes"], once["recipes"]):
        assert two_step["test_auroc"] == pytest.approx(one_run["test_auroc"], abs=1e-9), two_step["recipe"]
