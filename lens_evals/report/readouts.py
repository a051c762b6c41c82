"""The report's readouts section: for every sample whose output carries the ``lens_readouts``
solver's readouts (``ModelOutput.metadata["readouts"]``, :mod:`lens_evals.inspect_kit.readouts_solver`),
a table per lens (a row per layer, a column per response token: the lens's top token there, its
cell shaded by its probability, the top-k with probabilities in the cell's title) and per SAE
(the top latents of each response token, all of them in the title)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from html import escape
from typing import Any, cast

from inspect_ai.log import EvalLog

from lens_evals.inspect_kit.readouts_solver import READOUTS_METADATA_KEY, ResponseReadouts

SHOWN_LATENTS = 3  # latents written in an SAE cell (all of them in its title)


@dataclass(frozen=True)
class ReadoutSample:
    id: str
    turns: list[tuple[str, str]]  # (role, text) of the conversation before the response
    readouts: ResponseReadouts


def has_readouts(log: EvalLog) -> bool:
    return any(READOUTS_METADATA_KEY in ((s.output.metadata or {}) if s.output else {}) for s in log.samples or [])


def _check(sample_id: str, data: Any) -> ResponseReadouts:
    """The logged form, its keys and row counts checked (a ValueError naming what is wrong)."""
    if not isinstance(data, dict) or not {"response", "lens", "sae", "token_texts"} <= data.keys():
        raise ValueError(f"sample {sample_id}: its readouts lack response, lens, sae or token_texts")
    n = len(data["response"].get("token_ids", []))
    if not len(data["response"].get("tokens", [])) == len(data["response"].get("positions", [])) == n:
        raise ValueError(f"sample {sample_id}: its readouts' response has token_ids, tokens and positions of different lengths")
    for name, lens in data["lens"].items():
        if len(lens["token_ids"]) != len(lens["layers"]) or any(len(rows) != n for rows in lens["token_ids"]):
            raise ValueError(f"sample {sample_id}: lens readout {name!r} is not (layers, {n} tokens, top_k)")
    for name, sae in data["sae"].items():
        if len(sae["latent_ids"]) != n:
            raise ValueError(f"sample {sample_id}: SAE readout {name!r} is not ({n} tokens, top_k)")
    return cast(ResponseReadouts, data)


def readout_samples(log: EvalLog) -> list[ReadoutSample]:
    samples = []
    for sample in log.samples or []:
        data = (sample.output.metadata or {}).get(READOUTS_METADATA_KEY) if sample.output else None
        if data is None:
            continue
        messages = sample.messages[:-1] if sample.messages and sample.messages[-1].role == "assistant" else sample.messages
        turns = [(str(m.role), m.text) for m in messages]
        samples.append(ReadoutSample(id=str(sample.id), turns=turns, readouts=_check(str(sample.id), data)))
    return samples


def visible(text: str) -> str:
    """A token's text as a cell shows it: a line break as ↵, a token of spaces alone as ␣s."""
    text = text.replace("\n", "↵")
    return text.replace(" ", "␣") if text and not text.strip(" ") else text


def shown(text: str) -> str:
    return escape(visible(text))


def _tokens_header(readouts: ResponseReadouts, first: str) -> str:
    response = readouts["response"]
    cells = "".join(
        f'<th class="tok" data-token="{j}" title="token {i} at position {p + 1}">{shown(t)}</th>'
        for j, (t, i, p) in enumerate(zip(response["tokens"], response["token_ids"], response["positions"]))
    )
    return f"<tr><th>{escape(first)}</th>{cells}</tr>"


def _lens_table(name: str, readouts: ResponseReadouts) -> str:
    lens, texts = readouts["lens"][name], readouts["token_texts"]
    rows = []
    for layer, ids_row, logprobs_row in zip(lens["layers"], lens["token_ids"], lens["logprobs"]):
        cells = []
        for j, (ids, logprobs) in enumerate(zip(ids_row, logprobs_row)):
            top = ", ".join(f"{texts.get(str(i), str(i))!r} {math.exp(lp):.3f}" for i, lp in zip(ids, logprobs))
            p = math.exp(logprobs[0]) if logprobs else 0.0
            top_text = texts.get(str(ids[0]), str(ids[0])) if ids else ""
            cells.append(
                f'<td data-token="{j}" title="{escape(top)}" style="background:rgba(37,99,235,{0.05 + 0.6 * p:.2f})">{shown(top_text)}</td>'
            )
        rows.append(f'<tr data-layer="{layer}"><th>{layer}</th>{"".join(cells)}</tr>')
    return (
        f"<h4>lens {escape(name)}: the top token at each layer (title: the top {len(lens['token_ids'][0][0]) if rows and lens['token_ids'][0] else 0}"
        f' with probabilities)</h4><div class="grid"><table class="readout lens" data-readout="{escape(name)}">'
        f"{_tokens_header(readouts, 'layer')}{''.join(rows)}</table></div>"
    )


def _sae_table(name: str, readouts: ResponseReadouts) -> str:
    sae = readouts["sae"][name]
    cells = []
    for j, (ids, values) in enumerate(zip(sae["latent_ids"], sae["values"])):
        active = [(i, v) for i, v in zip(ids, values) if i >= 0 and v > 0]
        title = ", ".join(f"{i} {v:.3f}" for i, v in active) or "no active latent"
        body = "<br>".join(f"<b>{i}</b> {v:.2f}" for i, v in active[:SHOWN_LATENTS])
        cells.append(f'<td data-token="{j}" title="{escape(title)}">{body}</td>')
    return (
        f"<h4>SAE {escape(name)} (layer {sae['layer']}): the top latents, id and activation (title: every active one of the top)</h4>"
        f'<div class="grid"><table class="readout sae" data-readout="{escape(name)}">'
        f"{_tokens_header(readouts, 'latents')}<tr>{'<th></th>'}{''.join(cells)}</tr></table></div>"
    )


def readouts_html(samples: list[ReadoutSample]) -> str:
    items = []
    for sample in samples:
        r = sample.readouts
        conversation = "".join(
            f'<div class="turn {escape(role)}"><b>{escape(role)}</b> {escape(text)}</div>' for role, text in sample.turns
        )
        tables = [_lens_table(name, r) for name in r["lens"]] + [_sae_table(name, r) for name in r["sae"]]
        items.append(
            f'<article class="transcript readouts" data-sample="{escape(sample.id)}"><header><b>{escape(sample.id)}</b> · '
            f"{len(r['response']['tokens'])} response tokens</header>"
            f'<details class="context"><summary>conversation ({len(sample.turns)} turns)</summary>{conversation}</details>'
            f'<div class="turn assistant response">{escape("".join(r["response"]["tokens"]))}</div>{"".join(tables)}</article>'
        )
    return (
        f'<section class="readouts"><h2>Readouts ({len(samples)} samples)</h2>'
        '<p class="note">A column per response token, read where the model chose it (the position before it): '
        "at the last layer the logit lens's top token is the token greedy decoding picks.</p>"
        f"{''.join(items)}</section>"
    )
