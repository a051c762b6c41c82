"""Transcripts as HTML: the response's tokens coloured by probe score around the threshold
(red above it, blue below, stronger further away), tokens outside the score greyed, honest and
deceptive versions of a scenario side by side."""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from html import escape
from itertools import groupby

import numpy as np

from lens_evals.report.reading import ProbeSection, ScoredSample, Turn

ABOVE, BELOW = (220, 38, 38), (37, 99, 235)


def natural_key(text: str) -> tuple[tuple[int, int | str], ...]:
    """Sort "2" before "10": digit runs compare as numbers."""
    return tuple((0, int(part)) if part.isdigit() else (1, part) for part in re.split(r"(\d+)", text) if part)


def colour_spread(section: ProbeSection) -> float:
    """Distance from the threshold at which a token's colour is full: the 95th percentile of the
    finite distances (one NaN or inf token score must not blank or wash out every colour)."""
    distances = [
        abs(score - section.threshold)
        for sample in section.samples
        for score in sample.token_scores[sample.scored[0] : sample.scored[1]]
        if math.isfinite(score - section.threshold)
    ]
    return max(float(np.percentile(distances, 95)), 1e-6) if distances else 1.0


def token_colour(score: float, threshold: float, spread: float) -> str:
    """Red above the threshold, blue below, stronger further away; a NaN score has no colour."""
    if math.isnan(score - threshold):
        return "transparent"
    distance = (score - threshold) / spread
    red, green, blue = ABOVE if distance > 0 else BELOW
    return f"rgba({red},{green},{blue},{0.08 + 0.72 * min(abs(distance), 1.0):.2f})"


def legend(threshold: float, spread: float) -> str:
    low, high = token_colour(threshold - spread, threshold, spread), token_colour(threshold + spread, threshold, spread)
    return (
        f'<div class="legend"><span>{threshold - spread:.2f}</span>'
        f'<span class="bar" style="background:linear-gradient(90deg,{low},rgba(255,255,255,0) 50%,{high})">'
        f'<span class="mark" title="threshold"></span></span><span>{threshold + spread:.2f}</span>'
        f'<span class="note">token score; the line is the threshold {threshold:.2f}; '
        f'<span class="excluded-sample">grey</span> tokens are not part of the sample score</span></div>'
    )


def response_html(sample: ScoredSample, threshold: float, spread: float) -> str:
    spans = []
    for row, (text, score) in enumerate(zip(sample.tokens, sample.token_scores)):
        shown = escape(text)
        if sample.scored[0] <= row < sample.scored[1]:
            above = " above" if score > threshold else ""
            spans.append(
                f'<span class="tok{above}" data-score="{score!r}" title="{score:.4f}" '
                f'style="background:{token_colour(score, threshold, spread)}">{shown}</span>'
            )
        else:
            spans.append(f'<span class="tok excluded" data-score="{score!r}" title="{score:.4f} (not scored)">{shown}</span>')
    return f'<div class="turn assistant response">{"".join(spans)}</div>'


def turns_html(turns: Sequence[Turn]) -> str:
    body = "".join(f'<div class="turn {escape(t.role)}"><b>{escape(t.role)}</b> {escape(t.text)}</div>' for t in turns)
    return f'<details class="context"><summary>conversation ({len(turns)} turns)</summary>{body}</details>'


def sample_html(sample: ScoredSample, section: ProbeSection, spread: float, with_turns: bool) -> str:
    label = section.classes[sample.label] if sample.label in (0, 1) else "unknown"
    verdict = "FLAGGED" if sample.flagged else "not flagged"
    score = f"{sample.score:.2f}" if math.isfinite(sample.score) else "n/a"
    return (
        f'<article class="transcript label-{escape(label)}" data-sample="{escape(sample.id)}" data-label="{escape(label)}" '
        f'data-flagged="{str(sample.flagged).lower()}" data-score="{sample.score!r}">'
        f"<header><b>{escape(sample.id)}</b> · {escape(label)} · score {score} · "
        f'<span class="{"flagged" if sample.flagged else "calm"}">{verdict}</span></header>'
        f"{turns_html(sample.turns) if with_turns else ''}{response_html(sample, section.threshold, spread)}"
        f'<p class="explanation">{escape(sample.explanation)}</p></article>'
    )


def transcripts_html(section: ProbeSection) -> str:
    """Every sample; versions of one scenario (same pair key) side by side, negative class first."""
    spread = colour_spread(section)
    blocks: list[str] = []
    ordered = sorted(section.samples, key=lambda s: (s.pair is None, natural_key(s.pair or s.id), s.label if s.label is not None else 2))
    for key, group in groupby(ordered, key=lambda s: s.pair):
        members = list(group)
        if key is None:
            blocks.extend(f'<div class="single">{sample_html(s, section, spread, True)}</div>' for s in members)
            continue
        shared = all(m.turns == members[0].turns for m in members)
        columns = "".join(sample_html(m, section, spread, not shared) for m in members)
        blocks.append(
            f'<div class="pair"><h4>scenario {escape(key)}</h4>{turns_html(members[0].turns) if shared else ""}'
            f'<div class="columns">{columns}</div></div>'
        )
    return legend(section.threshold, spread) + "".join(blocks)
