"""Labelled dialogues and which of their tokens a probe reads.

A :class:`Dialogue` is a chat whose final message is the assistant's; the probe scores that
message's tokens from ``score_from`` (a character offset, e.g. past an answer prefix such as
``"Employee:"``) up to the end, less the last ``exclude_last_words`` words. The chat is
rendered with the model's own chat template (``continue_final_message``, as vLLM's chat
endpoint does with ``continue_final_message=true``), so offline training and the Inspect
scorer pick the very same token positions.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

TokenSelection = Literal["all", "last"]
HONEST, DECEPTIVE = 0, 1


@dataclass(frozen=True)
class Dialogue:
    messages: list[dict[str, str]]
    label: int | None  # 1 = deceptive / false, 0 = honest / true, None = unknown
    score_from: int = 0
    exclude_last_words: int = 0
    group: str = ""  # items sharing a group stay on one side of a train/validation split
    metadata: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.messages or self.messages[-1].get("role") != "assistant":
            raise ValueError("a probe dialogue must end with the assistant message to score")
        if not 0 <= self.score_from <= len(self.messages[-1]["content"]):
            raise ValueError(f"score_from {self.score_from} is outside the final message")


@dataclass(frozen=True)
class TokenizedDialogue:
    token_ids: list[int]
    scored_positions: np.ndarray  # absolute token positions the probe reads, ascending


def scored_char_span(content: str, score_from: int, exclude_last_words: int) -> tuple[int, int]:
    """(start, end) character span of ``content`` that is scored; end drops trailing words."""
    end = len(content.rstrip())
    if exclude_last_words > 0:
        word_starts = [m.start() for m in re.finditer(r"\S+", content)]
        word_starts = [s for s in word_starts if s >= score_from]
        if len(word_starts) <= exclude_last_words:
            raise ValueError(f"fewer than {exclude_last_words + 1} words to score in {content!r}")
        end = len(content[: word_starts[-exclude_last_words]].rstrip())
    start = score_from + (len(content[score_from:]) - len(content[score_from:].lstrip()))
    if end <= start:
        raise ValueError(f"nothing to score in {content!r} from character {score_from}")
    return start, end


def render(tokenizer: Any, messages: Sequence[dict[str, str]]) -> str:
    """The chat as the model sees it, ending inside the final assistant message."""
    text: str = tokenizer.apply_chat_template(list(messages), tokenize=False, continue_final_message=True)
    return text


def tokenize_dialogue(tokenizer: Any, dialogue: Dialogue, selection: TokenSelection = "all") -> TokenizedDialogue:
    text = render(tokenizer, dialogue.messages)
    content = dialogue.messages[-1]["content"]
    content_at = text.rfind(content)
    if content_at < 0:
        raise ValueError("the chat template changed the final message; cannot locate its tokens")
    start, end = scored_char_span(content, dialogue.score_from, dialogue.exclude_last_words)
    start, end = start + content_at, end + content_at
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    positions = [i for i, (s, e) in enumerate(encoded["offset_mapping"]) if e > start and s < end]
    if not positions:
        raise ValueError(f"no tokens fall in the scored span of {content!r}")
    if selection == "last":
        positions = positions[-1:]
    return TokenizedDialogue(list(encoded["input_ids"]), np.asarray(positions, dtype=np.int64))
