"""Score a conversation's final assistant turn with a linear probe, through a ``vllm-lens`` model.

The conversation is written as plain system / user / assistant text turns (tool calls as
``name({json args})``, as the probes' training dialogues are) and sent once with one generated
token, the probe computed on the worker (probe-on-worker: only per-token scores come back); the
final turn's scores are averaged. Its token positions come from the server's own ``/tokenize``
(:mod:`lens_evals.inspect_kit.target_turn`), so no local tokenizer, torch or vllm is needed: this runs in
a client-only install (ControlArena monitors). The tokens read are those of training's
``Dialogue`` rules with ``score_from=0`` and no excluded words. (Petri's inspectors read the
conversation as the target read it instead, tool calls and tools included.)
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
from inspect_ai.model import ChatMessage, ChatMessageAssistant, ChatMessageSystem, ChatMessageTool, ChatMessageUser, Model

from lens_evals.inspect_kit.target_turn import probe_turn, turn_tokens
from lens_evals.probing.probe import Probe


@dataclass(frozen=True)
class TurnScore:
    probe: str
    layer: int
    score: float  # mean per-token log-odds over the final turn
    threshold: float  # the probe card's 1%-FPR threshold (same units)
    n_tokens: int
    token_scores: list[float]

    @classmethod
    def of(cls, probe: Probe, token_scores: np.ndarray) -> TurnScore:
        """The turn's score from the probe's per-token scores over it."""
        return cls(
            probe=probe.card.name,
            layer=probe.layer,
            score=float(np.mean(token_scores)),
            threshold=float(probe.card.threshold),
            n_tokens=int(len(token_scores)),
            token_scores=[round(float(s), 4) for s in token_scores],
        )

    @property
    def flagged(self) -> bool:
        return self.score > self.threshold

    @property
    def probability(self) -> float:
        """The score through a sigmoid: in (0, 1), same order as ``score``."""
        return 1.0 / (1.0 + math.exp(-self.score))

    def summary(self) -> str:
        verdict = "FLAGGED" if self.flagged else "not flagged"
        return (
            f"probe {self.probe} (layer {self.layer}) on the last turn ({self.n_tokens} tokens): score {self.score:.3f} "
            f"log-odds, threshold {self.threshold:.3f} at 1% FPR on benign answers -> {verdict}"
        )

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


async def probe_last_turn(model: Model, probe: Probe, messages: Sequence[ChatMessage] | Sequence[dict[str, str]]) -> TurnScore:
    """Probe score of the final assistant turn of ``messages`` as ``model`` reads it."""
    chat = [dict(m) for m in messages] if messages and isinstance(messages[0], dict) else plain_chat(messages)  # type: ignore[arg-type]
    if not chat or chat[-1]["role"] != "assistant" or not chat[-1]["content"].strip():
        raise ValueError("the conversation must end with a non-empty assistant turn to score")
    turn_messages = _inspect_messages(chat)
    turn = await turn_tokens(model, turn_messages)
    return TurnScore.of(probe, await probe_turn(model, turn_messages, (), probe, turn))
