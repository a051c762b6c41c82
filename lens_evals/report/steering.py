"""The steering eval's part of the report: dose-response curves (mean over items of each measure
against the scale, a line per layer), their table, and the steered texts."""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass
from html import escape

import numpy as np
from inspect_ai.log import EvalLog

from lens_evals.report import plots

SCORER = "steering_scorer"
METADATA_KEY = "steering_effect"
MEASURES = (
    ("logprob_diff", "log P(positive ref) - log P(negative ref)"),
    ("word_balance", "net fraction of positive words"),
    ("perplexity", "perplexity under the unsteered model"),
)


@dataclass(frozen=True)
class SteeredSample:
    id: str
    item: int
    layer: int
    scale: float
    values: dict[str, float]
    prefix: str
    text: str
    vector_norm: float


@dataclass(frozen=True)
class SteeringSection:
    concept: str
    classes: tuple[str, str]
    samples: list[SteeredSample]

    def curves(self, measure: str) -> dict[int, tuple[list[float], list[float], list[float]]]:
        """{layer: (scales, means, standard errors)} over the samples that have ``measure``."""
        grouped: dict[int, dict[float, list[float]]] = defaultdict(lambda: defaultdict(list))
        for s in self.samples:
            value = s.values.get(measure)
            if value is not None and math.isfinite(value):
                grouped[s.layer][s.scale].append(value)
        out = {}
        for layer in sorted(grouped):
            scales = sorted(grouped[layer])
            values = [np.asarray(grouped[layer][x]) for x in scales]
            errors = [float(v.std(ddof=1) / math.sqrt(len(v))) if len(v) > 1 else 0.0 for v in values]
            out[layer] = (scales, [float(v.mean()) for v in values], errors)
        return out


def is_steering_log(log: EvalLog) -> bool:
    return METADATA_KEY in (log.eval.metadata or {})


def steering_section(log: EvalLog) -> SteeringSection | None:
    meta = (log.eval.metadata or {})[METADATA_KEY]
    samples = []
    for sample in log.samples or []:
        score = (sample.scores or {}).get(SCORER)
        if score is None or not isinstance(score.value, dict):
            continue
        found = score.metadata or {}
        samples.append(
            SteeredSample(
                id=str(sample.id),
                item=int(found["item"]),
                layer=int(found["layer"]),
                scale=float(found["scale"]),
                values={k: float(v) for k, v in score.value.items() if isinstance(v, (int, float))},
                prefix=str((sample.metadata or {}).get("answer_prefix", "")),
                text=str(found.get("text", "")),
                vector_norm=float(found.get("vector_norm", math.nan)),
            )
        )
    if not samples:
        return None
    classes = tuple(meta.get("classes") or ("negative", "positive"))
    return SteeringSection(concept=str(meta.get("concept", "")), classes=(str(classes[0]), str(classes[1])), samples=samples)


def _cell(value: float) -> str:
    return "n/a" if not math.isfinite(value) else f"{value:.3f}"


def steering_html(section: SteeringSection) -> str:
    figures, rows = [], []
    measures = [(key, label) for key, label in MEASURES if section.curves(key)]
    for key, label in measures:
        curves = section.curves(key)
        figures.append(
            f'<figure class="dose" id="dose-{key}">{plots.dose_response_svg(curves, label, log_y=key == "perplexity")}'
            f"<figcaption>{escape(label)}: mean over items ± standard error, a line per layer</figcaption></figure>"
        )
    layers = sorted({s.layer for s in section.samples})
    for layer in layers:
        for scale in sorted({s.scale for s in section.samples if s.layer == layer}):
            chosen = [s for s in section.samples if s.layer == layer and s.scale == scale]
            means = [
                np.mean([s.values[k] for s in chosen if k in s.values]) if any(k in s.values for s in chosen) else math.nan
                for k, _ in measures
            ]
            norm = _cell(chosen[0].vector_norm * scale)  # the norm of what is added: vector norm x scale
            rows.append(
                f"<tr><td>{layer}</td><td>{scale:g}</td><td>{norm}</td><td>{len(chosen)}</td>"
                + "".join(f"<td>{_cell(float(m))}</td>" for m in means)
                + "</tr>"
            )
    head = (
        "<tr><th>layer</th><th>scale</th><th>added norm</th><th>samples</th>"
        + "".join(f"<th>{escape(k)}</th>" for k, _ in measures)
        + "</tr>"
    )
    texts = "".join(
        f'<article class="transcript steered" data-sample="{escape(s.id)}"><header><b>item {s.item}</b> · layer {s.layer} · '
        f"scale {s.scale:g} · " + " · ".join(f"{escape(k)} {_cell(v)}" for k, v in sorted(s.values.items())) + "</header>"
        f'<div class="turn assistant">{escape(s.prefix)}<b>{escape(s.text)}</b></div></article>'
        for s in sorted(section.samples, key=lambda s: (s.item, s.layer, s.scale))
    )
    return (
        f'<section class="steering"><h2>Steering towards {escape(section.classes[1])} '
        f"(concept {escape(section.concept)})</h2>"
        f'<div class="figures">{"".join(figures)}</div>'
        f'<h3>Means per layer and scale</h3><table class="metrics">{head}{"".join(rows)}</table>'
        f"<h3>Steered texts ({len(section.samples)}; the answer prefix, then the steered continuation in bold)</h3>{texts}</section>"
    )
