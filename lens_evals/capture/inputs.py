"""Prompt sets for ``lens-evals capture``: a JSONL file (one object per line with ``prompt``, a
string; ``messages``, a chat as ``[{"role", "content"}]``; or ``prompt_token_ids``), a file or
directory the ``datasets`` library reads (.parquet, .arrow, .csv, a ``save_to_disk`` directory)
with the same columns, or an Inspect ``.eval``/``.json`` log (each sample's transcript)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lens_evals.capture.manifest import CaptureError

PROMPT_FIELDS = ("prompt", "messages", "prompt_token_ids")
DATASETS_SUFFIXES = (".parquet", ".arrow", ".csv")


@dataclass(frozen=True)
class PromptItem:
    """One prompt of the set; exactly one of the three forms is set."""

    index: int
    prompt: str | None = None
    messages: tuple[tuple[str, str], ...] | None = None
    token_ids: tuple[int, ...] | None = None

    def tokenize(self, tokenizer: Any) -> list[int]:
        """Token ids as the engine sees them: a prompt with the tokenizer's special tokens (as vLLM
        adds them), a chat rendered with the model's chat template."""
        if self.token_ids is not None:
            return list(self.token_ids)
        if self.messages is not None:
            chat = [{"role": role, "content": content} for role, content in self.messages]
            text = tokenizer.apply_chat_template(chat, tokenize=False)
            return list(tokenizer(text, add_special_tokens=False)["input_ids"])
        return list(tokenizer(self.prompt)["input_ids"])


def _item(index: int, record: Any, where: str) -> PromptItem:
    if not isinstance(record, dict):
        raise CaptureError(f"{where}: expected an object with one of {', '.join(PROMPT_FIELDS)}, got {type(record).__name__}")
    present = [name for name in PROMPT_FIELDS if record.get(name) is not None]
    if len(present) != 1:
        found = ", ".join(sorted(record)) or "no fields"
        raise CaptureError(f"{where}: needs exactly one of {', '.join(PROMPT_FIELDS)} (found {found})")
    value = record[present[0]]
    if present[0] == "prompt":
        if not isinstance(value, str) or not value:
            raise CaptureError(f"{where}: 'prompt' must be a non-empty string")
        return PromptItem(index, prompt=value)
    if present[0] == "prompt_token_ids":
        if not isinstance(value, list) or not value or not all(type(t) is int and t >= 0 for t in value):
            raise CaptureError(f"{where}: 'prompt_token_ids' must be a non-empty list of non-negative integers")
        return PromptItem(index, token_ids=tuple(value))
    if not isinstance(value, list) or not value:
        raise CaptureError(f"{where}: 'messages' must be a non-empty list of {{'role', 'content'}} objects")
    messages = []
    for message in value:
        if not isinstance(message, dict) or not isinstance(message.get("role"), str) or not isinstance(message.get("content"), str):
            raise CaptureError(f"{where}: each message needs a string 'role' and a string 'content', got {message!r:.80}")
        messages.append((message["role"], message["content"]))
    return PromptItem(index, messages=tuple(messages))


def _read_jsonl(path: Path) -> list[PromptItem]:
    items: list[PromptItem] = []
    with open(path, "rb") as handle:
        for line_number, raw in enumerate(handle, start=1):
            try:  # a byte-order mark (from some editors) is not part of the first line's JSON
                line = raw.decode("utf-8-sig" if line_number == 1 else "utf-8")
            except UnicodeDecodeError as exc:
                raise CaptureError(f"{path}:{line_number}: not UTF-8 text ({exc.reason} at byte {exc.start + 1})") from None
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise CaptureError(f"{path}:{line_number}: not valid JSON ({exc.msg} at column {exc.colno})") from None
            items.append(_item(len(items), record, f"{path}:{line_number}"))
    return items


def _read_datasets(path: Path) -> list[PromptItem]:
    import datasets

    try:
        if path.is_dir():
            table = datasets.load_from_disk(str(path))
        elif path.suffix == ".parquet":
            table = datasets.Dataset.from_parquet(str(path))
        elif path.suffix == ".csv":
            table = datasets.Dataset.from_csv(str(path))
        else:
            table = datasets.Dataset.from_file(str(path))
    except Exception as exc:  # noqa: BLE001 - the datasets library raises many types; name the file and the cause
        raise CaptureError(f"{path}: the datasets library cannot read it: {exc}") from None
    if isinstance(table, datasets.DatasetDict):
        raise CaptureError(f"{path} holds several splits ({', '.join(table)}); point at one split's directory")
    return [_item(index, record, f"{path} row {index}") for index, record in enumerate(table)]


def _read_inspect_log(path: Path) -> list[PromptItem]:
    from inspect_ai.log import read_eval_log

    try:
        log = read_eval_log(str(path))
    except Exception as exc:  # noqa: BLE001 - Inspect raises several types for a file that is not a log
        raise CaptureError(f"{path}: not a readable Inspect log: {exc}") from None
    items: list[PromptItem] = []
    for sample in log.samples or []:
        messages = [{"role": m.role, "content": m.text} for m in sample.messages if m.text]
        items.append(_item(len(items), {"messages": messages}, f"{path} sample {sample.id}"))
    return items


def read_prompts(path: str | Path) -> list[PromptItem]:
    """Every prompt of the set, in order; a clear :class:`CaptureError` naming the line or row of
    the first bad one."""
    path = Path(path)
    if not path.exists():
        raise CaptureError(f"prompt set {path} does not exist")
    if path.is_dir() or path.suffix in DATASETS_SUFFIXES:
        items = _read_datasets(path)
    elif path.suffix == ".eval" or (path.suffix == ".json" and _looks_like_inspect_log(path)):
        items = _read_inspect_log(path)
    else:
        items = _read_jsonl(path)
    if not items:
        raise CaptureError(f"prompt set {path} holds no prompts")
    return items


def _looks_like_inspect_log(path: Path) -> bool:
    with open(path, "rb") as handle:
        head = handle.read(4096)
    return b'"eval"' in head and b'"version"' in head


def _files(path: Path) -> Iterable[Path]:
    return sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]


def source_sha256(path: str | Path) -> str:
    """SHA-256 of the prompt set's bytes (every file of a directory, in name order)."""
    digest = hashlib.sha256()
    for file in _files(Path(path)):
        with open(file, "rb") as handle:
            while chunk := handle.read(1 << 20):
                digest.update(chunk)
    return digest.hexdigest()
