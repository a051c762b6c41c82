"""The report page: one self-contained HTML file (inline CSS and SVG, no script, no network);
several probes become CSS-only tabs."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from html import escape
from typing import Any

import numpy as np

from lens_evals.probing import metrics as detection
from lens_evals.report import plots
from lens_evals.report.reading import OracleSample, ProbeSection, ReportData
from lens_evals.report.readouts import readouts_html
from lens_evals.report.steering import steering_html
from lens_evals.report.style import CSS
from lens_evals.report.transcripts import transcripts_html, turns_html

CARD_FIELDS = (
    ("model", "model"),
    ("layer", "layer"),
    ("layers", "layers"),
    ("aggregation", "aggregation over tokens"),
    ("follow_up", "follow-up"),
    ("training_set", "training data"),
    ("n_train_dialogues", "training dialogues"),
    ("validation_auroc", "validation AUROC"),
    ("threshold", "threshold"),
    ("threshold_fpr", "threshold FPR"),
    ("control_set", "control set"),
    ("n_control", "control answers"),
    ("chosen_by", "chosen by"),
    ("score", "score"),
)


def _card_value(value: Any) -> Any:
    """A card field as shown: a recipe's layers joined, its follow-up as question and answer."""
    if isinstance(value, list) and all(isinstance(v, int) for v in value):
        return ", ".join(str(v) for v in value)
    if isinstance(value, dict) and {"question", "answer"} <= value.keys():
        return f"{value['question']} / {value['answer']}"
    return "none" if value is None else value


def _number(value: Any) -> str:
    if isinstance(value, float):
        return "n/a" if not math.isfinite(value) else f"{value:.3f}"
    return escape(str(value))


def table(rows: Sequence[Sequence[Any]], header: Sequence[str] | None = None, css: str = "") -> str:
    head = "<tr>" + "".join(f"<th>{escape(h)}</th>" for h in header) + "</tr>" if header else ""
    body = "".join("<tr>" + "".join(f"<td>{_number(cell)}</td>" for cell in row) + "</tr>" for row in rows)
    return f'<table class="{css}">{head}{body}</table>'


def confusion_html(section: ProbeSection) -> str:
    """Label against flagged; unlabelled samples counted apart."""
    negative, positive = section.classes
    count = {(label, flagged): 0 for label in (0, 1, None) for flagged in (True, False)}
    for sample in section.samples:
        count[(sample.label if sample.label in (0, 1) else None, sample.flagged)] += 1
    rows = [[f"{positive} (label 1)", count[(1, True)], count[(1, False)]], [f"{negative} (label 0)", count[(0, True)], count[(0, False)]]]
    if count[(None, True)] + count[(None, False)]:
        rows.append(["no label", count[(None, True)], count[(None, False)]])
    flagged = sum(n for (_, is_flagged), n in count.items() if is_flagged)
    return (
        f'<div class="confusion"><h3>Confusion matrix at the threshold</h3>'
        f"{table(rows, ['', 'flagged', 'not flagged'], 'confusion')}"
        f'<p class="flag-count"><b>{flagged}</b> of {len(section.samples)} samples flagged</p></div>'
    )


def section_metrics(section: ProbeSection) -> list[list[Any]]:
    labels, scores = section.labelled()
    y, s = np.asarray(labels), np.asarray(scores)
    negative, positive = section.classes
    return [
        ["AUROC", detection.auroc(labels, scores)],
        ["recall at the threshold (1% FPR on control)", detection.recall_at_threshold(labels, scores, section.threshold)],
        [f"false positive rate on {negative}", float((s[y == 0] > section.threshold).mean()) if (y == 0).any() else math.nan],
        [f"mean score {positive}", float(s[y == 1].mean()) if (y == 1).any() else math.nan],
        [f"mean score {negative}", float(s[y == 0].mean()) if (y == 0).any() else math.nan],
        ["samples (labelled)", f"{len(section.samples)} ({len(labels)})"],
    ]


def probe_html(section: ProbeSection, index: int) -> str:
    labels, scores = section.labelled()
    card = [[title, _card_value(section.card[key])] for key, title in CARD_FIELDS if key in section.card]
    card = card or [["threshold", section.threshold]]
    figures = ""
    if len(set(labels)) == 2:
        control = section.card.get("control_scores") or []
        figures = (
            f'<div class="figures"><figure class="roc" id="roc-{index}">{plots.roc_svg(labels, scores, section.threshold, section.classes)}'
            f"<figcaption>ROC: {escape(section.classes[1])} against {escape(section.classes[0])}</figcaption></figure>"
            f'<figure class="histogram" id="hist-{index}">'
            f"{plots.histogram_svg(labels, scores, section.threshold, section.classes, control)}"
            f"<figcaption>score distributions, the threshold"
            f"{' and the control answers' if control else ' (the probe card holds no control scores)'}</figcaption></figure></div>"
        )
    else:
        figures = '<p class="note">ROC and histograms need samples of both labels.</p>'
    return (
        f'<section class="probe" data-probe="{escape(section.name)}"><h2>Probe {escape(section.name)}</h2>'
        f'<div class="summary"><div><h3>Probe card</h3>{table(card, css="card")}</div>'
        f"<div><h3>Detection</h3>{table(section_metrics(section), css='metrics')}</div>{confusion_html(section)}</div>"
        f"{figures}<h3>Transcripts ({len(section.samples)})</h3>{transcripts_html(section)}</section>"
    )


def tabs_html(names: Sequence[str], panels: Sequence[str]) -> str:
    """CSS-only tabs: a radio button per tab; the checked one shows its panel."""
    if len(panels) == 1:
        return panels[0]
    inputs = "".join(
        f'<input type="radio" name="tabs" id="tab-{i}"{" checked" if i == 0 else ""}><label for="tab-{i}">{escape(name)}</label>'
        for i, name in enumerate(names)
    )
    rules = " ".join(f"#tab-{i}:checked ~ #panel-{i}{{display:block}}" for i in range(len(panels)))
    body = "".join(f'<div class="panel" id="panel-{i}">{panel}</div>' for i, panel in enumerate(panels))
    return f'<style>{rules}</style><div class="tabs">{inputs}{body}</div>'


def oracle_html(samples: Sequence[OracleSample]) -> str:
    by_family: dict[str, list[OracleSample]] = defaultdict(list)
    for sample in samples:
        by_family[sample.family or "all"].append(sample)
    families = sorted(by_family)
    oracle = [float(np.mean([s.correct for s in by_family[f]])) for f in families]
    zero = [float(np.mean([bool(s.zero_vector_correct) for s in by_family[f]])) for f in families]
    rows = [[f, len(by_family[f]), o, z] for f, o, z in zip(families, oracle, zero)]
    items = "".join(
        f'<article class="transcript oracle {"correct" if s.correct else "wrong"}" data-sample="{escape(s.id)}">'
        f"<header><b>{escape(s.id)}</b> · {escape(s.family)} · target <b>{escape(s.target)}</b></header>{turns_html(s.prompt)}"
        f'<div class="turn"><b>question</b> {escape(s.question)}</div>'
        f'<div class="turn assistant"><b>oracle</b> {escape(s.answer)} {"✓" if s.correct else "✗"}</div>'
        + (
            f'<div class="turn zero"><b>zero vector</b> {escape(s.zero_vector_answer)} {"✓" if s.zero_vector_correct else "✗"}</div>'
            if s.zero_vector_answer is not None
            else ""
        )
        + "</article>"
        for s in samples
    )
    return (
        f'<section class="oracle"><h2>Activation oracle</h2>'
        f"{table(rows, ['family', 'samples', 'oracle accuracy', 'zero-vector accuracy'], 'metrics')}"
        f'<figure class="accuracy">{plots.accuracy_svg(families, oracle, zero)}</figure>'
        f"<h3>Transcripts ({len(samples)})</h3>{items}</section>"
    )


def page_html(data: ReportData) -> str:
    metrics = table([[name, value] for name, value in data.metrics.items()], css="metrics")
    intro = ""
    if data.steering is not None:
        body = steering_html(data.steering)
    elif data.probes:
        body = tabs_html([p.name for p in data.probes], [probe_html(p, i) for i, p in enumerate(data.probes)])
        intro = escape(str(data.metadata.get("dataset", "")))
    elif data.oracle:
        body = oracle_html(data.oracle)
    else:
        body = ""
    if data.readouts:
        body += readouts_html(data.readouts)
    return (
        f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>{escape(data.title)}</title>'
        f'<meta name="viewport" content="width=device-width, initial-scale=1"><style>{CSS}</style></head><body>'
        f'<header class="page"><h1>{escape(data.title)}</h1><p>log <code>{escape(data.location)}</code> · created '
        f"{escape(data.created)}{' · dataset ' + intro if intro else ''}</p>"
        f"<details><summary>metrics as Inspect computed them</summary>{metrics}</details></header>"
        f"<main>{body}</main></body></html>"
    )
