"""Score a conversation's final assistant turn with a linear probe, through a ``vllm-lens`` model.

The conversation is sent once with ``continue_final_message`` and one generated token, with the
probe computed on the worker (probe-on-worker: only per-token scores come back); the final turn's
scores are averaged. Its token positions come from the server's own ``/tokenize`` (the chat
without the final turn, with the generation prompt, is the prefix), so no local tokenizer, torch
or vllm is needed: this runs in a client-only install
(ControlArena monitors, Petri auditor tools). The tokens read are those of training's ``Dialogue``
rules with ``score_from=0`` and no excluded words.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from typing import Any, Sequence

import numpy as np
from inspect_ai.model import (
    ChatMessage, ChatMessageAssistant, ChatMessageSystem, ChatMessageTool, ChatMessageUser, GenerateConfig, Model,
)

from lens_evals.probing.probe import Probe
from lens_evals.spec import PROBE_KEY


@dataclass(frozen=True)
class TurnScore:
    probe: str
    layer: int
    score: float  # mean per-token log-odds over the final turn
    threshold: float  # the probe card's 1%-FPR threshold (same units)
    n_tokens: int
    token_scores: list[float]

    @property
    def flagged(self) -> bool:
        return self.score > self.threshold

    @property
    def probability(self) -> float:
        """The score through a sigmoid: in (0, 1), same order as ``score``."""
        return 1.0 / (1.0 + math.exp(-self.score))

    def summary(self) -> str:
        verdict = "FLAGGED" if self.flagged else "not flagged"
        return (f"probe {self.probe} (layer {self.layer}) on the last turn ({self.n_tokens} tokens): score {self.score:.3f} "
                f"log-odds, threshold {self.threshold:.3f} at 1% FPR on benign answers -> {verdict}")

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "flagged": self.flagged}


def tool_call_text(function: str, arguments: dict[str, Any]) -> str:
    return f"{function}({json.dumps(arguments, ensure_ascii=False, sort_keys=True)})"


def message_text(message: ChatMessage) -> str:
    """A message as plain text; an assistant's tool calls are written out as ``name({json args})``."""
    parts = [message.text.strip()] if message.text.strip() else []
    if isinstance(message, ChatMessageAssistant):
        parts += [tool_call_text(call.function, call.arguments) for call in message.tool_calls or []]
    if isinstance(message, ChatMessageTool):
        return f"[result of {message.function}] {message.text.strip()}" if message.function else message.text.strip()
    return "\n".join(parts)


def plain_chat(messages: Sequence[ChatMessage]) -> list[dict[str, str]]:
    """Any Inspect conversation as system / user / assistant text turns (tool results become user
    turns, as chat templates without tool support need); must end with an assistant turn."""
    chat: list[dict[str, str]] = []
    for message in messages:
        role = {"system": "system", "assistant": "assistant"}.get(message.role, "user")
        chat.append({"role": role, "content": message_text(message)})
    if not chat or chat[-1]["role"] != "assistant":
        raise ValueError("the conversation must end with the assistant turn to score")
    return chat


def _inspect_messages(chat: Sequence[dict[str, str]]) -> list[ChatMessage]:
    kinds = {"system": ChatMessageSystem, "user": ChatMessageUser, "assistant": ChatMessageAssistant}
    return [kinds[m["role"]](content=m["content"]) for m in chat]


def _lens_api(model: Model) -> Any:
    from lens_evals.evals.provider import PROVIDER_NAME

    if not str(model).startswith(f"{PROVIDER_NAME}/") or not hasattr(model.api, "tokenize"):
        raise ValueError(f"probing needs a {PROVIDER_NAME}/<model> model, got {model}")
    return model.api


async def final_turn_positions(model: Model, chat: Sequence[dict[str, str]]) -> tuple[int, np.ndarray]:
    """(number of prompt tokens, positions of the final assistant turn's tokens) on the server:
    the tokens past what the chat without that turn (plus the generation prompt) shares with it."""
    api = _lens_api(model)
    full = await api.tokenize(messages=list(chat), continue_final_message=True)
    prefix = await api.tokenize(messages=list(chat[:-1]))
    shared = 0
    while shared < min(len(full), len(prefix)) and full[shared] == prefix[shared]:
        shared += 1
    if shared >= len(full):
        raise ValueError("the final assistant turn has no tokens to score")
    return len(full), np.arange(shared, len(full))


async def probe_last_turn(model: Model, probe: Probe, messages: Sequence[ChatMessage] | Sequence[dict[str, str]]) -> TurnScore:
    """Probe score of the final assistant turn of ``messages`` as ``model`` reads it."""
    chat = [dict(m) for m in messages] if messages and isinstance(messages[0], dict) else plain_chat(messages)  # type: ignore[arg-type]
    if not chat or chat[-1]["role"] != "assistant" or not chat[-1]["content"].strip():
        raise ValueError("the conversation must end with a non-empty assistant turn to score")
    n_tokens, positions = await final_turn_positions(model, chat)
    config = GenerateConfig(max_tokens=1, temperature=0.0, extra_body={
        "extra_args": {PROBE_KEY: [probe.linear_probe()]}, "continue_final_message": True, "add_generation_prompt": False})
    output = await model.generate(_inspect_messages(chat), config=config)
    activations = (output.metadata or {}).pop("activations", None)
    if not activations or probe.card.name not in activations.get("probe_scores", {}):
        raise RuntimeError("the model returned no probe scores: is it a vllm-lens/<model> model?")
    all_scores = np.asarray(activations["probe_scores"][probe.card.name], dtype=np.float64)  # one per token
    if all_scores.shape[0] != n_tokens:
        raise RuntimeError(f"the chat request covered {all_scores.shape[0]} tokens, /tokenize counted {n_tokens}")
    token_scores = all_scores[positions]
    return TurnScore(probe=probe.card.name, layer=probe.layer, score=float(token_scores.mean()),
                     threshold=float(probe.card.threshold), n_tokens=int(len(positions)),
                     token_scores=[round(float(s), 4) for s in token_scores])
