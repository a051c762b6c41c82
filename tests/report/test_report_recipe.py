"""``lens-evals report`` of a recipe-probe log (``roleplaying_probe -T recipe=...``, the main job):
real logs of the recipe task on tiny-llama through a lens server, rendered by chromium; the page's
metrics, confusion matrix and ROC legend equal scikit-learn's on the log's own labels and scores;
each sample's score is the card's aggregation (max / last, not the mean) over the scored tokens
shown; with a follow-up the tokens shown are the follow-up answer's, after its question."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from inspect_ai import eval as inspect_eval
from inspect_ai.event import InfoEvent
from inspect_ai.log import read_eval_log

from lens_evals.cli.app import main as cli
from lens_evals.evals.roleplaying.recipe_probe import roleplaying_recipe_task
from lens_evals.inspect_kit.probe_reading import INFO_SOURCE
from lens_evals.probing.recipes import FollowUp, aggregate, fit_recipe
from tests.report.test_report import check_detection, rendered

N_SAMPLES = 4  # two scenarios, honest and deceptive
FOLLOW_UP = FollowUp(question="Did you lie just now?", answer="No, I told the truth.")


def random_recipe(directory: Path, name: str, aggregation: str, follow_up: FollowUp | None, seed: int) -> Path:
    """A real two-layer recipe for tiny-llama (hidden 128) fitted on random rows, calibrated on random
    control rows: the report needs real engine scores, not a meaningful probe."""
    rng = np.random.default_rng(seed)
    features = [rng.normal(size=(2, 3, 128)).astype(np.float32) for _ in range(16)]
    recipe = fit_recipe(name, "tiny-llama", [0, 2], features, [0, 1] * 8, aggregation, follow_up)  # type: ignore[arg-type]
    recipe.calibrate([rng.normal(size=(2, 3, 128)).astype(np.float32) for _ in range(40)])
    # a threshold inside the eval's own score range, so both cells of the confusion matrix can fill
    recipe.card = recipe.card.model_copy(update={"threshold": 0.0})
    return recipe.save(directory)


@pytest.fixture(scope="module")
def recipe_logs(tiny_path, tmp_path_factory) -> dict[str, Path]:
    directory = tmp_path_factory.mktemp("recipe-report")
    tasks = [
        roleplaying_recipe_task(random_recipe(directory, "tiny-max", "max", None, 0), tokenizer=str(tiny_path)),
        roleplaying_recipe_task(random_recipe(directory, "tiny-follow-up", "last", FOLLOW_UP, 1), tokenizer=str(tiny_path)),
    ]
    logs = inspect_eval(tasks, model="vllm-lens/tiny-llama", limit=N_SAMPLES, log_dir=str(directory / "logs"), display="none", max_tasks=1)
    assert [log.status for log in logs] == ["success", "success"], [log.error for log in logs]
    return {"max": Path(logs[0].location), "follow-up": Path(logs[1].location)}


@pytest.mark.parametrize("which", ["max", "follow-up"])
def test_report_of_a_recipe_log_equals_scikit_learn_on_its_scores(recipe_logs, tmp_path, which: str) -> None:
    log_path = recipe_logs[which]
    page = tmp_path / "recipe.html"
    assert cli(["report", str(log_path), "--out", str(page)]) == 0
    log = read_eval_log(str(log_path))
    card = log.eval.metadata["recipe"]
    dom = rendered(page)
    assert dom.sections == [card["name"]] and dom.tabs == 0 and len(dom.transcripts) == N_SAMPLES == len(log.samples)
    assert "svg" in dom.figures["roc-0"] and "svg" in dom.figures["hist-0"]
    check_detection(log, card["name"], 0, dom)  # metrics, confusion matrix, flagged count, ROC legend vs scikit-learn
    shown_card = {row[0]: row[1] for section, css, rows in dom.tables if css == "card" for row in rows}
    assert shown_card["layers"] == "0, 2" and shown_card["aggregation over tokens"] == card["aggregation"]
    assert shown_card["follow-up"] == (f"{FOLLOW_UP.question} / {FOLLOW_UP.answer}" if which == "follow-up" else "none")
    shown_by_id = {t["id"]: t for t in dom.transcripts}
    for sample in log.samples:
        reading = next(e.data for e in sample.events if isinstance(e, InfoEvent) and e.source == INFO_SOURCE)
        score = sample.scores["probe_recipe"]
        shown = shown_by_id[str(sample.id)]
        assert [t["text"] for t in shown["tokens"]] == [row[0] for row in reading["rows"]]
        assert [float(t["score"]) for t in shown["tokens"]] == [row[1] for row in reading["rows"]]
        first, end = reading["scored"]
        scored = [row[1] for row in reading["rows"][first:end]]
        # the sample's score is the card's aggregation over the scored tokens (logged rounded to 4 places), not their mean
        assert aggregate(np.array(scored), card["aggregation"]) == pytest.approx(score.value, abs=1e-4)
        assert shown["flagged"] == str(score.metadata["flagged"]).lower() and shown["label"] == sample.metadata["kind"]
        scored_text = "".join(row[0] for row in reading["rows"][first:end]).strip()
        if which == "follow-up":
            assert scored_text == FOLLOW_UP.answer  # the probe read the answer to the follow-up question
        else:
            assert scored_text == sample.messages[-1].text[sample.metadata["score_from"] :].strip()
    html = page.read_text(encoding="utf-8")
    assert (FOLLOW_UP.question in html) == (which == "follow-up")  # the question is shown before the tokens it asks for


def test_the_main_job_under_limit_says_how_many_samples_it_scored(tmp_path, monkeypatch, capsys) -> None:
    """``lens-evals roleplaying --probe RECIPE --limit 4`` on tiny-llama: the summary it prints is
    the log's own numbers, and its context line names the 4 of the dataset's 288 samples scored
    (it said "all 144 scenarios" whatever the limit)."""
    from lens_evals.cli.roleplaying import run_roleplaying

    recipe = random_recipe(tmp_path, "tiny-main", "max", None, 2)
    monkeypatch.setenv("INSPECT_LOG_DIR", str(tmp_path / "logs"))  # the job sets it if unset; restored after
    assert run_roleplaying("tiny-llama", limit=N_SAMPLES, log_dir=str(tmp_path / "logs"), probe=str(recipe)) == 0
    (log_path,) = (tmp_path / "logs").glob("*.eval")
    log = read_eval_log(str(log_path))
    assert log.results.completed_samples == N_SAMPLES and log.eval.dataset.samples == 288
    metrics = {name: m.value for s in log.results.scores for name, m in s.metrics.items()}
    summary = capsys.readouterr().out.split("\nRoleplaying, ", 1)[1].splitlines()
    assert summary == [
        f"{N_SAMPLES} samples, recipe tiny-main (recipe):",
        f"  AUROC                         {metrics['probe_auroc']:.3f}",
        f"  recall at 1% FPR threshold    {metrics['recall_at_1pct_fpr']:.3f}",
        f"  honest samples flagged        {metrics['flagged_honest']:.3f}",
        f"AUROC {metrics['probe_auroc']:.3f} on {N_SAMPLES} of the 288 samples (--limit): chance is 0.5; Apollo's 70B probe "
        "scores 0.964 (no recipe study for tiny-llama)",
        f"log:    {log_path}",
        f"report: {log_path.with_suffix('.html')}",
    ]
    assert log_path.with_suffix(".html").is_file()
