"""The target's last turn as the target itself reads it, through a ``vllm-lens`` model.

The conversation goes to the server as Inspect sends it to the target — tool calls, tool results
and the tools it had included, rendered by the server's own chat template (no rewrite into plain
text) — so the captures and probe scores of a turn that contains tool calls fall on the tokens the
target wrote (its text and its ``<tool_call>`` JSON, as the template writes them back).

The request sends the whole conversation, the final turn closed (``add_generation_prompt=False``),
with one generated token. The final turn's tokens are found with the server's ``/tokenize``: they
start where the conversation without that turn (plus the generation prompt) stops agreeing with it,
and end where the tokens the template closes an assistant turn with (measured on a one-word turn,
``x``) begin; a token that straddles either edge (a tokenizer merging the turn's first or last
characters with the template's) belongs to the turn. A *span* (a quote from the turn) narrows that to the fewest tokens whose text, by the
server's ``/detokenize``, contains the quote. The model is causal: what follows a token never
changes its activations, so the closing tokens change nothing in the turn.

Client-only (no torch, no vllm, no local tokenizer): it runs in Petri's venv. Requests the auditor
got wrong (a layer out of range, an empty or absent span) raise :class:`TurnReadError`, whose text
is meant to be read by the auditor."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from inspect_ai.model import ChatMessage, ChatMessageAssistant, GenerateConfig, Model
from inspect_ai.tool import ToolInfo

from lens_evals.inspect_kit.provider.outputs import output_activations
from lens_evals.probing.probe import Probe
from lens_evals.request.spec import CAPTURE_KEY, PROBE_KEY
from lens_evals.request.wire_model import float32_array

CLOSING_PROBE_TEXT = "x"  # a one-word turn, to measure the tokens that close an assistant turn


class TurnReadError(ValueError):
    """The request cannot be served as asked (bad layer, empty or absent span): the message says why."""


@dataclass(frozen=True)
class TurnTokens:
    """Where the final turn (or the span) sits in the closed conversation the request sends."""

    token_ids: list[int]  # the whole conversation, the final turn closed
    turn_start: int
    turn_end: int  # one past the turn's last token (the closing tokens excluded)
    start: int  # = turn_start unless a span was asked for
    end: int
    span: str | None = None

    @property
    def positions(self) -> np.ndarray:
        return np.arange(self.start, self.end)

    def as_dict(self) -> dict[str, Any]:
        return {
            "span": self.span,
            "turn_tokens": [self.turn_start, self.turn_end],
            "read_tokens": [self.start, self.end],
            "n_read": self.end - self.start,
            "n_prompt": len(self.token_ids),
        }


def _lens_api(model: Model) -> Any:
    from lens_evals.inspect_kit.provider.api import PROVIDER_NAME

    if not str(model).startswith(f"{PROVIDER_NAME}/") or not hasattr(model.api, "tokenize"):
        raise ValueError(f"reading the target's activations needs a {PROVIDER_NAME}/<model> model, got {model}")
    return model.api


def check_ends_with_assistant(messages: Sequence[ChatMessage]) -> None:
    if not messages or not isinstance(messages[-1], ChatMessageAssistant):
        raise ValueError("the conversation must end with the target's (assistant) turn to read")


async def _tokenize(
    api: Any, messages: list[Any], tools: list[Any] | None, *, generation_prompt: bool = False, continue_final: bool = False
) -> list[int]:
    body: dict[str, Any] = {
        "model": api.model_name,
        "messages": messages,
        "add_generation_prompt": generation_prompt,
        "continue_final_message": continue_final,
    }
    if tools:
        body["tools"] = tools
    return [int(t) for t in (await api.server_json("post", "/tokenize", body))["tokens"]]


async def _detokenize(api: Any, token_ids: Sequence[int]) -> str:
    return str((await api.server_json("post", "/detokenize", {"model": api.model_name, "tokens": list(token_ids)}))["prompt"])


def _shared_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    shared = 0
    while shared < min(len(a), len(b)) and a[shared] == b[shared]:
        shared += 1
    return shared


async def _closing_tokens(api: Any, earlier: list[Any], tools: list[Any] | None) -> list[int]:
    """The tokens the template writes after an assistant turn's last word (SmolLM2: ``<|im_end|>\\n``)."""
    probe_turn = [*earlier, {"role": "assistant", "content": CLOSING_PROBE_TEXT}]
    closed = await _tokenize(api, probe_turn, tools)
    opened = await _tokenize(api, probe_turn, tools, continue_final=True)
    if closed[: len(opened)] != opened:
        raise RuntimeError("this chat template writes an assistant turn differently when it is closed; cannot find its end")
    return closed[len(opened) :]


async def _span_tokens(api: Any, ids: Sequence[int], start: int, end: int, quote: str) -> tuple[int, int]:
    """The fewest tokens in ``ids[start:end]`` whose text contains ``quote`` (two binary searches)."""

    async def holds(a: int, b: int) -> bool:
        return quote in await _detokenize(api, ids[a:b])

    if not await holds(start, end):
        turn_text = await _detokenize(api, ids[start:end])
        raise TurnReadError(
            f"the span {quote!r} is not in the target's last turn; quote its text exactly. "
            f"The turn as the target wrote it: {turn_text[:600]!r}"
        )
    low, high = start + 1, end
    while low < high:  # the first end that contains the quote
        middle = (low + high) // 2
        low, high = (low, middle) if await holds(start, middle) else (middle + 1, high)
    span_end = low
    low, high = start, span_end - 1
    while low < high:  # the last start that still contains it
        middle = (low + high + 1) // 2
        low, high = (middle, high) if await holds(middle, span_end) else (low, middle - 1)
    return low, span_end


async def turn_tokens(model: Model, messages: Sequence[ChatMessage], tools: Sequence[ToolInfo] = (), span: str | None = None) -> TurnTokens:
    """Token positions of the final (assistant) turn of ``messages``, or of ``span`` within it."""
    check_ends_with_assistant(messages)
    api = _lens_api(model)
    chat = await api.messages_to_openai(list(messages))
    openai_tools = api.tools_to_openai(list(tools)) if tools else None
    full = await _tokenize(api, chat, openai_tools)
    start = _shared_prefix(full, await _tokenize(api, chat[:-1], openai_tools, generation_prompt=True))
    closing = await _closing_tokens(api, chat[:-1], openai_tools)
    end = max(start, len(full) - _shared_prefix(full[::-1], closing[::-1]))
    if end == start:
        raise TurnReadError("the target's last turn has no tokens (an empty reply): there is nothing to read")
    if span is None:
        return TurnTokens(full, start, end, start, end)
    quote = span.strip()
    if not quote:
        raise TurnReadError(
            "the span is empty: quote a part of the target's last turn (its text or a tool call's "
            "arguments, as written), or leave span out to read the whole turn"
        )
    span_start, span_end = await _span_tokens(api, full, start, end, quote)
    return TurnTokens(full, start, end, span_start, span_end, quote)


def check_layer(layer: int) -> None:
    if layer < 0:
        raise TurnReadError(f"layer {layer} is out of range: layers count from 0 (the first decoder layer)")


async def _lens_request(
    model: Model, messages: Sequence[ChatMessage], tools: Sequence[ToolInfo], extra_args: dict[str, Any], wanted: str
) -> dict[str, Any]:
    """One request over the closed conversation (one generated token); the decoded activations.
    A request the server refuses (a layer out of range) becomes a TurnReadError with its reason."""
    config = GenerateConfig(max_tokens=1, temperature=0.0, extra_body={"extra_args": extra_args, "add_generation_prompt": False})
    try:
        output = await model.generate(list(messages), tools=list(tools), config=config)
    except Exception as exc:  # the server's 400 (openai.BadRequestError): its message is the reason
        if getattr(exc, "status_code", None) == 400:
            raise TurnReadError(f"the target's server refused the request: {_server_message(exc)}") from None
        raise
    if output.error:
        raise TurnReadError(f"the target's server refused the request: {output.error}")
    return output_activations(output, wanted)  # taken out of the output: arrays stay out of the log


def _server_message(exc: Exception) -> str:
    """The server's reason, without the request Inspect's error repeats (ModelGenerateError wraps
    the openai error: ``provider_message`` is its text, ``__cause__`` the error itself)."""
    cause = exc.__cause__ or exc
    body = getattr(cause, "body", None)
    if isinstance(body, dict):
        inner = body.get("error", body)
        if isinstance(inner, dict) and inner.get("message"):
            return str(inner["message"])
    text = str(getattr(exc, "provider_message", None) or cause)
    return re.sub(r"^Error code: \d+ - ", "", text)


def _check_rows(rows: int, turn: TurnTokens) -> None:
    if rows != len(turn.token_ids):
        raise RuntimeError(
            f"the request covered {rows} tokens, /tokenize counted {len(turn.token_ids)}: the server rendered the conversation differently"
        )


async def capture_turn(
    model: Model, messages: Sequence[ChatMessage], tools: Sequence[ToolInfo], layer: int, turn: TurnTokens
) -> np.ndarray:
    """The residual stream after ``layer`` at the turn's (or span's) tokens: (tokens, hidden)."""
    check_layer(layer)
    activations = await _lens_request(model, messages, tools, {CAPTURE_KEY: [layer]}, "residual_stream")
    stream = float32_array(activations["residual_stream"][0])  # (n_prompt, hidden)
    _check_rows(stream.shape[0], turn)
    return np.ascontiguousarray(stream[turn.positions])


async def probe_turn(
    model: Model, messages: Sequence[ChatMessage], tools: Sequence[ToolInfo], probe: Probe, turn: TurnTokens
) -> np.ndarray:
    """The probe's per-token scores (computed on the worker) at the turn's (or span's) tokens."""
    activations = await _lens_request(model, messages, tools, {PROBE_KEY: [probe.linear_probe()]}, "probe_scores")
    scores = np.asarray(activations["probe_scores"][probe.card.name], dtype=np.float64)
    _check_rows(scores.shape[0], turn)
    at_turn: np.ndarray = scores[turn.positions]
    return at_turn
