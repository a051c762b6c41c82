"""``lens-evals report`` rendered by a real browser (Debian's chromium, headless) from real eval
logs; the rendered DOM is checked against the log: the ROC figure, one transcript per sample,
honest and deceptive versions side by side, every response token's text and score. And what
Inspect's viewer reads from the log: the scored response as the answer, label and flagged as
score columns, no probe weights in the logged model calls. Bad input: a clear error, a non-zero
exit and no page left behind."""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pytest
from inspect_ai import Task
from inspect_ai import eval as inspect_eval
from inspect_ai.dataset import Sample
from inspect_ai.event import InfoEvent
from inspect_ai.log import read_eval_log
from inspect_ai.scorer import match
from sklearn.linear_model import LogisticRegression
from sklearn.metrics import roc_auc_score, roc_curve
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler

from lens_evals import LinearProbe, SteeringVector
from lens_evals.cli.app import main as cli
from lens_evals.evals.roleplaying import roleplaying_task
from lens_evals.evals.roleplaying.multi_probe import roleplaying_probes_task
from lens_evals.inspect_kit.probe_reading import INFO_SOURCE
from lens_evals.inspect_kit.provider.logged_call import logged_extra_args, real_extra_args, split_xargs, wire_request
from lens_evals.inspect_kit.provider.xargs import to_vllm_xargs
from lens_evals.probing.multi import ProbeSet, Readout
from lens_evals.probing.probe import Probe, ProbeCard, load_probe
from lens_evals.request.spec import CAPTURE_KEY, PROBE_KEY, STEERING_KEY
from lens_evals.wire import formats as wire
from tests.conftest import on_gpu

N_SAMPLES = 4  # two scenarios, honest and deceptive


class ReportDom(HTMLParser):
    """What the browser rendered: figures, transcripts and their token spans."""

    def __init__(self) -> None:
        super().__init__()
        self.figures: dict[str, list[str]] = {}  # figure id -> tags inside
        self.transcripts: list[dict] = []
        self.figure_text: dict[str, str] = {}
        self.pairs = 0
        self.sections: list[str] = []  # probe names, one per section (a tab each when several)
        self.tabs = 0
        self.tables: list[tuple[int, str, list[list[str]]]] = []  # (section index, class, rows of cell texts)
        self.flag_counts: list[str] = []  # each section's "N of M samples flagged"
        self._figure: str | None = None
        self._span: dict | None = None
        self._cell = self._flag_count = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        classes = (a.get("class") or "").split()
        if tag == "figure":
            self._figure = a.get("id") or ""
            self.figures[self._figure] = []
        elif self._figure is not None:
            self.figures[self._figure].append(tag)
            self.figure_text.setdefault(self._figure, "")
        if tag == "section" and "probe" in classes:
            self.sections.append(a["data-probe"] or "")
        if tag == "input" and a.get("name") == "tabs":
            self.tabs += 1
        if tag == "div" and "pair" in classes:
            self.pairs += 1
        if tag == "article" and "transcript" in classes:
            self.transcripts.append(
                {
                    "id": a["data-sample"],
                    "label": a["data-label"],
                    "flagged": a["data-flagged"],
                    "pair_index": self.pairs,
                    "probe": self.sections[-1],
                    "tokens": [],
                }
            )
        if tag == "table":
            self.tables.append((len(self.sections) - 1, a.get("class") or "", []))
        if tag == "tr" and self.tables:
            self.tables[-1][2].append([])
        if tag in ("td", "th") and self.tables:
            self.tables[-1][2][-1].append("")
            self._cell = True
        if tag == "p" and "flag-count" in classes:
            self.flag_counts.append("")
            self._flag_count = True
        if tag == "span" and "tok" in classes and self.transcripts:
            self._span = {"score": a["data-score"], "excluded": "excluded" in classes, "style": a.get("style") or "", "text": ""}

    def handle_endtag(self, tag: str) -> None:
        self._cell = self._cell and tag not in ("td", "th")
        self._flag_count = self._flag_count and tag != "p"
        if tag == "figure":
            self._figure = None
        if tag == "span" and self._span is not None:
            self.transcripts[-1]["tokens"].append(self._span)
            self._span = None

    def handle_data(self, data: str) -> None:
        if self._figure is not None:
            self.figure_text[self._figure] = self.figure_text.get(self._figure, "") + data
        if self._span is not None:
            self._span["text"] += data
        if self._cell:
            self.tables[-1][2][-1][-1] += data
        if self._flag_count:
            self.flag_counts[-1] += data


def rendered(page: Path) -> ReportDom:
    chromium = shutil.which("chromium")
    if chromium is None and on_gpu():
        pytest.skip("no chromium on the lent GPU machine (no network to install it); it runs on every CPU CI machine")
    assert chromium, "chromium is missing: scripts/setup.sh installs Debian's chromium"
    result = subprocess.run(
        [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--dump-dom", page.as_uri()], capture_output=True, text=True, timeout=180
    )
    assert result.returncode == 0 and "<html" in result.stdout, result.stderr[-2000:]
    dom = ReportDom()
    dom.feed(result.stdout)
    return dom


def random_probe(directory: Path, seed: int = 0) -> Path:
    """A real scikit-learn probe for tiny-llama's layer 1 (hidden 128), fitted on random rows:
    the report test needs real engine scores, not a meaningful probe."""
    rng = np.random.default_rng(seed)
    rows = rng.normal(size=(256, 128))
    pipeline = make_pipeline(StandardScaler(), LogisticRegression(C=1.0)).fit(rows, (rows[:, 0] > 0).astype(int))
    control = pipeline.decision_function(rng.normal(size=(100, 128)))
    card = ProbeCard(
        name=f"tiny-random-{seed}",
        model="tiny-llama",
        layer=1,
        hidden_size=128,
        dtype="float32",
        token_selection="all",
        training_set="random rows (test)",
        n_train_dialogues=256,
        n_val_dialogues=0,
        n_train_tokens=256,
        regularization_C=1.0,
        validation_auroc=0.5,
        threshold=float(np.quantile(control, 0.99)),
        control_set="random rows (test)",
        n_control=100,
        control_scores=[round(float(c), 4) for c in control],
        versions=ProbeCard.current_versions(),
        created=dt.datetime.now(dt.UTC).isoformat(),
    )
    return Probe(pipeline=pipeline, card=card).save(directory)


def random_probe_set(directory: Path) -> Path:
    """The three-probe work's probe set with two random readouts (ip-lr, ip-dom) for tiny-llama."""
    rng = np.random.default_rng(2)
    readouts = {
        kind: Readout(kind, 1, rng.normal(size=128).astype(np.float32), 0.0, float(threshold))
        for kind, threshold in (("ip-lr", 1.0), ("ip-dom", -1.0))
    }
    return ProbeSet("tiny-llama", 1, readouts).save(directory / "tiny__probe-set")


@pytest.fixture(scope="module")
def tiny_logs(tiny_path, tmp_path_factory) -> dict[str, Path]:
    """Logs of the Roleplaying task on tiny-llama through a real lens server (one server for
    both): with one probe, and with two probes read in one pass (the multi-probe task: two tabs)."""
    directory = tmp_path_factory.mktemp("report")
    probe = random_probe(directory)
    tasks = [
        roleplaying_task(probe, tokenizer=str(tiny_path)),
        roleplaying_probes_task(random_probe_set(directory), probes="ip-lr,ip-dom", tokenizer=str(tiny_path)),
    ]
    logs = inspect_eval(tasks, model="vllm-lens/tiny-llama", limit=N_SAMPLES, log_dir=str(directory / "logs"), display="none", max_tasks=1)
    assert [log.status for log in logs] == ["success", "success"], [log.error for log in logs]
    return {"one": Path(logs[0].location), "two": Path(logs[1].location), "probe": probe}


def check_report(log_path: Path, page: Path, n_samples: int) -> ReportDom:
    """The rendered page against the log: figures, transcripts, pairs, every token's text and
    score, for each probe (a section, a tab each when several)."""
    log = read_eval_log(str(log_path))
    dom = rendered(page)
    assert len(dom.sections) >= 1 and len(dom.transcripts) == n_samples * len(dom.sections)
    assert dom.pairs == len(dom.sections) * n_samples // 2  # honest and deceptive side by side
    for index, probe in enumerate(dom.sections):
        assert "svg" in dom.figures[f"roc-{index}"] and "svg" in dom.figures[f"hist-{index}"], dom.figures.keys()
        shown_by_id = {t["id"]: t for t in dom.transcripts if t["probe"] == probe}
        assert len(shown_by_id) == n_samples == len(log.samples)
        for sample in log.samples:
            check_sample(sample, probe, shown_by_id[str(sample.id)], dom)
        check_detection(log, probe, index, dom)
    return dom


def check_detection(log, probe: str, index: int, dom: ReportDom) -> None:
    """The section's metrics table, confusion matrix, flagged count and ROC legend against the
    log's labels, scores and flags, recomputed here (scikit-learn's AUROC and ROC curve)."""
    labels, values, flags, thresholds = [], [], [], set()
    for sample in log.samples:
        reading = next(e.data for e in sample.events if isinstance(e, InfoEvent) and e.source == INFO_SOURCE and e.data["probe"] == probe)
        score = next(s for s in sample.scores.values() if probe in (s.metadata["probe"], s.metadata.get("readout")))  # readout: a recipe's
        labels.append({"honest": 0, "deceptive": 1}[sample.metadata["kind"]])
        values.append(score.value["score"] if isinstance(score.value, dict) else score.value)
        flags.append(score.value["flagged"] if isinstance(score.value, dict) else score.metadata["flagged"])
        thresholds.add(float(reading["threshold"]))
    y, s, flagged = np.array(labels), np.array(values, dtype=np.float64), np.array(flags, dtype=bool)
    (threshold,) = thresholds
    assert (flagged == (s > threshold)).all() and 0 < y.sum() < len(y)
    tables = {}
    for section, css, rows in dom.tables:
        tables.setdefault((section, css), rows)
    expected = {
        "AUROC": roc_auc_score(y, s),
        "recall at the threshold (1% FPR on control)": flagged[y == 1].mean(),
        "false positive rate on honest": flagged[y == 0].mean(),
        "mean score deceptive": s[y == 1].mean(),
        "mean score honest": s[y == 0].mean(),
        "samples (labelled)": f"{len(y)} ({len(y)})",
    }
    shown = {row[0]: row[1] for row in tables[(index, "metrics")]}
    assert shown == {k: v if isinstance(v, str) else f"{v:.3f}" for k, v in expected.items()}
    count = {(label, flag): int(((y == label) & (flagged == flag)).sum()) for label in (0, 1) for flag in (True, False)}
    assert tables[(index, "confusion")] == [
        ["", "flagged", "not flagged"],
        ["deceptive (label 1)", str(count[(1, True)]), str(count[(1, False)])],
        ["honest (label 0)", str(count[(0, True)]), str(count[(0, False)])],
    ]
    assert dom.flag_counts[index] == f"{int(flagged.sum())} of {len(y)} samples flagged"
    fpr, tpr, _ = roc_curve(y, s)
    legend = dom.figure_text[f"roc-{index}"]
    assert f"FPR {flagged[y == 0].mean():.2f}, TPR {flagged[y == 1].mean():.2f}" in legend, legend
    assert f"1% FPR on this eval's honest: TPR {np.interp(0.01, fpr, tpr):.2f}" in legend, legend


def check_sample(sample, probe: str, shown: dict, dom: ReportDom) -> None:
    reading = next(e.data for e in sample.events if isinstance(e, InfoEvent) and e.source == INFO_SOURCE and e.data["probe"] == probe)
    score = next(s for s in sample.scores.values() if s.metadata["probe"] == probe)
    value = score.value["score"] if isinstance(score.value, dict) else score.value  # probe_scorer / multi-probe scorers
    flagged = score.value["flagged"] if isinstance(score.value, dict) else score.metadata["flagged"]
    assert [t["text"] for t in shown["tokens"]] == [row[0] for row in reading["rows"]]
    assert [float(t["score"]) for t in shown["tokens"]] == [row[1] for row in reading["rows"]]
    first, end = reading["scored"]
    assert [t["excluded"] for t in shown["tokens"]] == [not first <= i < end for i in range(len(reading["rows"]))]
    assert all("background:rgba(" in t["style"] for t in shown["tokens"][first:end])  # coloured by score
    # The scored tokens are the scored response, and their mean is the sample's score.
    scored_text = "".join(row[0] for row in reading["rows"][first:end])
    assert scored_text.strip() == sample.messages[-1].text[sample.metadata["score_from"] :].strip()
    assert score.answer in (None, scored_text.strip())
    assert np.mean([row[1] for row in reading["rows"][first:end]]) == pytest.approx(value, abs=1e-4)
    assert shown["label"] == sample.metadata["kind"] and shown["flagged"] == str(flagged).lower()
    partner = [t for t in dom.transcripts if t["pair_index"] == shown["pair_index"]]
    assert sorted(t["label"] for t in partner) == ["deceptive", "honest"]  # its pair holds both versions


def test_report_of_a_real_log_renders_in_chromium(tiny_logs, tmp_path) -> None:
    page = tmp_path / "report.html"
    assert cli(["report", str(tiny_logs["one"]), "--out", str(page)]) == 0
    dom = check_report(tiny_logs["one"], page, N_SAMPLES)
    assert dom.sections == ["tiny-random-0"] and dom.tabs == 0
    # The histogram draws the probe card's control scores beside the classes and the threshold.
    threshold = read_eval_log(str(tiny_logs["one"])).eval.metadata["probe"]["threshold"]
    assert "control answers (100)" in dom.figure_text["hist-0"] and f"threshold {threshold:.2f}" in dom.figure_text["hist-0"]
    assert "1% FPR on this eval's honest" in dom.figure_text["roc-0"] and "probe threshold" in dom.figure_text["roc-0"]


def test_the_three_probe_tasks_probes_are_tabs(tiny_logs, tmp_path) -> None:
    page = tmp_path / "two.html"
    assert cli(["report", str(tiny_logs["two"]), "--out", str(page)]) == 0
    dom = check_report(tiny_logs["two"], page, N_SAMPLES)
    assert dom.sections == ["ip-lr", "ip-dom"] and dom.tabs == 2


def test_the_log_reads_well_and_carries_no_probe_weights(tiny_logs) -> None:
    log_path, probe_path = tiny_logs["one"], tiny_logs["probe"]
    log = read_eval_log(str(log_path), resolve_attachments=True)
    weights = wire.encode_array(load_probe(probe_path).linear_probe().weights)["data"]
    for sample in log.samples:
        text = sample.model_dump_json()
        assert weights[:64] not in text  # not in the logged model call, nor anywhere else
        call = next(e for e in sample.events if e.event == "model").call
        item = json.loads(call.request["extra_body"]["vllm_xargs"]["output_probe_scores"][0])
        assert item["name"] == "tiny-random-0" and set(item["weights"]) == {"encoding", "sha256", "base64_chars"}
        # What the samples list shows: the scored response, label and flagged as score columns.
        score = sample.scores["probe_scorer"]
        assert set(score.value) == {"score", "flagged", "label"} and score.value["label"] == sample.metadata["kind"]
        final = sample.messages[-1].text
        assert score.answer == final[sample.metadata["score_from"] :].strip() and score.answer
        margin = score.value["score"] - score.metadata["threshold"]
        assert f"{abs(margin):.2f} {'above' if margin > 0 else 'below'}" in score.explanation
        assert "higher = more deceptive" in score.explanation
        assert "token_scores" not in json.dumps(sample.metadata)  # per-token scores only in the info event
    metrics = log.results.scores[0].metrics
    assert {"AUROC", "recall at 1% FPR", "flagged", "mean score deceptive", "mean score honest"} <= set(metrics)
    assert "tiny-random-0" in log.eval.metadata["probe card"] and log.eval.metadata["probe"]["layer"] == 1


def test_logged_forms_hold_digests_and_the_wire_gets_the_arrays() -> None:
    """What the provider logs of steering vectors and probes (config and request), and what it sends."""
    rng = np.random.default_rng(3)
    vector = SteeringVector(activations=rng.normal(size=(2, 64)).astype(np.float32), layer_indices=[0, 1])
    probe = LinearProbe(name="p", layer=1, weights=rng.normal(size=64).astype(np.float32), bias=0.5)
    extra_args = {STEERING_KEY: [vector], PROBE_KEY: [probe], CAPTURE_KEY: [1]}
    logged = logged_extra_args(extra_args)
    shown = json.dumps(logged)  # what Inspect writes for the generate config
    assert wire.encode_array(probe.weights)["data"] not in shown and '"data"' not in shown
    assert (
        logged[PROBE_KEY][0]["weights"]["sha256"] == hashlib.sha256(wire.encode_array(probe.weights)["data"].encode()).hexdigest()[:16]
        and logged[PROBE_KEY][0]["name"] == "p"
    )
    assert real_extra_args(logged)[STEERING_KEY][0] is vector and real_extra_args(logged)[PROBE_KEY][0] is probe
    assert logged_extra_args(logged) == logged  # a retry sees logged items and keeps them
    xargs = to_vllm_xargs(real_extra_args(logged))
    logged_xargs, payloads = split_xargs(xargs)
    assert '"data"' not in json.dumps(logged_xargs) and logged_xargs[CAPTURE_KEY] == [1]
    sent = wire_request({"model": "m", "extra_body": {"vllm_xargs": logged_xargs}}, payloads)
    assert sent["extra_body"]["vllm_xargs"] == xargs  # the server gets every array


def bad_input_fails_cleanly(log: Path, tmp_path: Path, expected: str, capsys) -> None:
    out = tmp_path / "out" / "page.html"
    assert cli(["report", str(log), "--out", str(out)]) != 0
    assert expected in capsys.readouterr().err
    assert not out.exists() and (not out.parent.exists() or not any(out.parent.iterdir()))  # no partial page


def test_log_of_another_task_is_refused(tmp_path, capsys) -> None:
    task = Task(name="plain_match", dataset=[Sample(input="hi", target="x")], scorer=match())
    log = inspect_eval(task, model="mockllm/model", log_dir=str(tmp_path / "logs"), display="none")[0]
    bad_input_fails_cleanly(Path(log.location), tmp_path, "which has no probe scores and no oracle answers", capsys)


def test_log_without_probe_scores_is_refused(tiny_path, tmp_path, capsys) -> None:
    """The probe task run on a model that returns no activations: every sample fails unscored."""
    probe = random_probe(tmp_path)
    log = inspect_eval(
        roleplaying_task(probe, tokenizer=str(tiny_path)),
        model="mockllm/model",
        limit=2,
        log_dir=str(tmp_path / "logs"),
        display="none",
        fail_on_error=False,
    )[0]
    assert all(sample.error for sample in read_eval_log(log.location).samples)
    bad_input_fails_cleanly(Path(log.location), tmp_path, "no probe scores in this log", capsys)


def test_truncated_log_is_refused(tiny_logs, tmp_path, capsys) -> None:
    log_path = tiny_logs["one"]
    truncated = tmp_path / "truncated.eval"
    truncated.write_bytes(log_path.read_bytes()[: log_path.stat().st_size // 2])
    bad_input_fails_cleanly(truncated, tmp_path, "not a readable Inspect eval log", capsys)
    bad_input_fails_cleanly(tmp_path / "missing.eval", tmp_path, "no such file", capsys)


@pytest.mark.slow
def test_main_job_report_of_288_samples(tmp_path) -> None:
    """The README's main job end to end: its log and the report it writes beside it."""
    from lens_evals.cli.roleplaying import run_roleplaying

    assert run_roleplaying(log_dir=str(tmp_path)) == 0
    log_path = next(tmp_path.glob("*.eval"))
    page = log_path.with_suffix(".html")
    assert page.is_file()
    check_report(log_path, page, 288)
