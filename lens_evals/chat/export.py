"""The conversation as ONE self-contained HTML file: inline CSS, the data inline, no script and
nothing fetched; a token's lens and SAE view shows on hover (CSS only)."""

from __future__ import annotations

import html
import json
import math
from importlib import resources
from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class ExportedMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: str = Field(max_length=20)
    content: str = Field(max_length=50000)
    tokens: list[dict[str, Any]] | None = Field(default=None, max_length=4096)
    steering: str | None = Field(default=None, max_length=500)


class Export(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str = Field(max_length=500)
    probe: str | None = Field(default=None, max_length=200)
    messages: list[ExportedMessage] = Field(max_length=400)


def colour(score: float, scale: float) -> str:
    """Red for positive probe scores, blue for negative; opacity by |score| / scale."""
    strength = 0.0 if scale <= 0 else min(1.0, abs(score) / scale)
    rgb = "220,38,38" if score > 0 else "37,99,235"
    return f"rgba({rgb},{0.1 + 0.6 * strength:.3f})"


def score_scale(messages: list[ExportedMessage], probe: str | None) -> float:
    values = [abs(float(t["scores"][probe])) for m in messages for t in m.tokens or [] if probe and probe in t.get("scores", {})]
    finite = [v for v in values if math.isfinite(v)]
    return max(finite, default=0.0)


def _tip(token: dict[str, Any], probe: str | None) -> str:
    rows = []
    if probe and probe in token.get("scores", {}):
        rows.append(f"<div><b>{html.escape(probe)}</b>: {float(token['scores'][probe]):.3f}</div>")
    for entry in token.get("lens", []):
        tops = ", ".join(f"{html.escape(json.dumps(text))} {float(p):.2f}" for text, p in entry["top"])
        rows.append(f"<div>L{int(entry['layer'])}: {tops}</div>")
    if token.get("sae"):
        rows.append("<div>SAE: " + ", ".join(f"#{int(i)} {float(v):.2f}" for i, v in token["sae"]) + "</div>")
    return f'<span class="tip">{"".join(rows)}</span>' if rows else ""


def _message(message: ExportedMessage, probe: str | None, scale: float) -> str:
    head = f'<div class="role">{html.escape(message.role)}'
    if message.steering:
        head += f' <span class="steer">steered: {html.escape(message.steering)}</span>'
    head += "</div>"
    if not message.tokens:
        return f'<div class="msg {html.escape(message.role)}">{head}<div class="text">{html.escape(message.content)}</div></div>'
    spans = []
    for token in message.tokens:
        score = token.get("scores", {}).get(probe) if probe else None
        style = f' style="background:{colour(float(score), scale)}"' if score is not None else ""
        spans.append(f'<span class="tok"{style}>{html.escape(str(token.get("text", "")))}{_tip(token, probe)}</span>')
    return f'<div class="msg {html.escape(message.role)}">{head}<div class="text">{"".join(spans)}</div></div>'


def export_html(export: Export) -> str:
    css = resources.files("lens_evals.chat").joinpath("static/chat.css").read_text(encoding="utf-8")
    scale = score_scale(export.messages, export.probe)
    body = "\n".join(_message(m, export.probe, scale) for m in export.messages)
    probe = f"coloured by probe {html.escape(export.probe)} (max |score| {scale:.3f})" if export.probe else "no probe"
    data = export.model_dump_json().replace("<", "\\u003c")  # no "</script>" inside the data
    return (
        '<!doctype html>\n<html lang="en"><head><meta charset="utf-8">'
        f"<title>lens-evals chat: {html.escape(export.model)}</title><style>{css}</style></head>"
        f'<body class="export"><h1>lens-evals chat</h1><p class="meta">model {html.escape(export.model)}; {probe}; '
        "hover a token for its lens and SAE view</p>"
        f'<div id="log">{body}</div>'
        f'<script type="application/json" id="conversation">{data}</script></body></html>\n'
    )
