"""The report page built from hostile or broken values a log can hold (no engine, no browser):
NaN / inf token scores, class names with ``$`` (matplotlib's mathtext), markup and bidi controls
in token texts. The real-log tests are in tests/test_report.py."""

from __future__ import annotations

import math
import re
from html import escape
from pathlib import Path

import numpy as np
import pytest
from inspect_ai import Task
from inspect_ai import eval as inspect_eval
from inspect_ai.dataset import Sample
from inspect_ai.log import transcript
from inspect_ai.scorer import Score, Scorer, Target, scorer
from inspect_ai.solver import Generate, Solver, TaskState, solver

from lens_evals.cli.app import main as cli
from lens_evals.inspect_kit.probe_reading import INFO_SOURCE
from lens_evals.report.page import page_html
from lens_evals.report.reading import ProbeSection, ReportData, ScoredSample, Turn
from lens_evals.report.style import CSS

THRESHOLD = 0.5


def sample(sample_id: str, label: int, tokens: list[str], scores: list[float]) -> ScoredSample:
    mean = float(np.mean(scores))
    return ScoredSample(
        id=sample_id,
        turns=[Turn("user", "question")],
        tokens=tokens,
        token_scores=scores,
        scored=(0, len(scores)),
        score=mean,
        flagged=mean > THRESHOLD,
        label=label,
        explanation="why",
    )


def page(samples: list[ScoredSample], classes: tuple[str, str] = ("honest", "deceptive")) -> str:
    section = ProbeSection("p", THRESHOLD, {"name": "p"}, classes, samples)
    return page_html(ReportData("t", "t", "m", "now", "log.eval", {}, {}, probes=[section]))


def token_spans(html: str) -> list[tuple[str, str, str]]:
    """(class, style, text) of every token span."""
    return re.findall(r'<span class="(tok[^"]*)" data-score="[^"]*" title="[^"]*"(?: style="([^"]*)")?>([^<]*)</span>', html)


def test_a_nan_token_score_leaves_the_other_tokens_coloured() -> None:
    finite = [[2.0, -1.0, 0.9], [3.0, 0.0]]
    html = page([sample("1", 0, ["a", "b", "c", "n"], [*finite[0], math.nan]), sample("2", 1, ["d", "e", "i"], [*finite[1], math.inf])])
    # reference: full colour at the 95th percentile of the finite distances to the threshold
    spread = float(np.percentile([abs(s - THRESHOLD) for s in finite[0] + finite[1]], 95))
    spans = {text: (css, style) for css, style, text in token_spans(html)}
    assert set(spans) == {"a", "b", "c", "n", "d", "e", "i"}
    for text, score in zip("abcde", finite[0] + finite[1]):
        red_green_blue = "220,38,38" if score > THRESHOLD else "37,99,235"
        alpha = 0.08 + 0.72 * min(abs(score - THRESHOLD) / spread, 1.0)
        assert spans[text][1] == f"background:rgba({red_green_blue},{alpha:.2f})", text
    assert spans["i"][1] == "background:rgba(220,38,38,0.80)"  # +inf: full red
    assert "nan" not in spans["n"][1]
    assert "nan)" not in html


def test_class_names_with_dollar_signs_are_drawn_as_text() -> None:
    classes = ("cost $5", "b$\\frac$ <x>")
    html = page([sample("1", 0, ["a"], [0.0]), sample("2", 1, ["b"], [1.0])], classes)
    figures = re.findall(r"<svg.*?</svg>", html, flags=re.S)
    assert len(figures) == 2
    assert escape(classes[1], quote=False) in figures[1]  # the histogram's legend, as written


def test_token_text_is_escaped_and_bidi_isolated() -> None:
    hostile = ["<script>alert(1)</script>", '"\' onmouseover="x', "</style>", "\u202eevil", "\u200b"]
    html = page([sample('<img src=x onerror="y">', 0, hostile, [0.0] * 5), sample("2", 1, ["ok"], [1.0])])
    assert "<script" not in html and "<img" not in html and html.count("</style>") == len(re.findall(r"<style[ >]", html))
    assert [text for _, _, text in token_spans(html) if text != "ok"] == [escape(t) for t in hostile]
    # a right-to-left override in one token must not reverse the tokens after it
    assert re.search(r"\.tok\{[^}]*unicode-bidi:isolate", CSS)


def probe_log(directory: Path) -> Path:
    """A readable probe-task log without an engine: a solver logs a probe_tokens reading, a scorer
    returns the probe score as probe_scorer does."""

    @solver
    def reading() -> Solver:
        async def solve(state: TaskState, generate: Generate) -> TaskState:
            data = {"probe": "p", "threshold": THRESHOLD, "scored": [0, 2], "rows": [["a", 0.0], ["b", 1.0]]}
            transcript().info(data, source=INFO_SOURCE)
            return state

        return solve

    @scorer(metrics=[])
    def probe_score() -> Scorer:
        async def score(state: TaskState, target: Target) -> Score:
            return Score(value={"score": 0.5, "flagged": False, "label": "honest"}, metadata={"probe": "p", "label": 0})

        return score

    task = Task(dataset=[Sample(input="hi", target="honest")], solver=reading(), scorer=probe_score(), metadata={"probe": {"name": "p"}})
    log = inspect_eval(task, model="mockllm/model", log_dir=str(directory), display="none")[0]
    return Path(log.location)


@pytest.mark.parametrize("where", ["the log", "a directory"])
def test_the_page_never_replaces_the_log_or_a_directory(tmp_path, capsys, where: str) -> None:
    log = probe_log(tmp_path)
    assert cli(["report", str(log), "--out", str(tmp_path / "fine.html")]) == 0  # the log is a readable probe log
    kept = log.read_bytes()
    out = log if where == "the log" else tmp_path
    before = sorted(p.name for p in tmp_path.iterdir())
    assert cli(["report", str(log), "--out", str(out)]) == 2
    assert ("the log itself" if where == "the log" else "a directory") in capsys.readouterr().err
    assert log.read_bytes() == kept and sorted(p.name for p in tmp_path.iterdir()) == before
