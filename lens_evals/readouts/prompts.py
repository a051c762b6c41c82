"""Prompt sets for fitting lenses: a prompt file (anything ``lens-evals capture`` reads) or, by
default, a built-in set: passages packed from the package's own text (the true/false facts and
the benign requests), shuffled with a seed. Each prompt is cut to ``max_tokens`` tokens."""

from __future__ import annotations

import csv
import random
from importlib import resources
from pathlib import Path
from typing import Any

import yaml


def _builtin_sentences() -> list[str]:
    data = resources.files("lens_evals.data")
    with (data / "repe_facts" / "facts_true_false.csv").open(encoding="utf-8") as handle:
        facts = [row["statement"] for row in csv.DictReader(handle)]
    requests = yaml.safe_load((data / "control" / "benign_requests.yaml").read_text(encoding="utf-8"))
    return [s.strip() for s in [*facts, *requests] if isinstance(s, str) and s.strip()]


def builtin_passages(n: int, seed: int = 0, sentences_per_passage: int = 6) -> list[str]:
    """``n`` passages of ``sentences_per_passage`` sentences each, drawn without replacement
    (while the pool lasts) from the built-in text."""
    pool = _builtin_sentences()
    rng = random.Random(seed)
    rng.shuffle(pool)
    passages = []
    for index in range(n):
        start = (index * sentences_per_passage) % max(1, len(pool) - sentences_per_passage)
        passages.append(" ".join(pool[start : start + sentences_per_passage]))
    return passages


def prompt_token_ids(
    tokenizer: Any, path: str | Path | None, n: int, max_tokens: int, seed: int = 0, min_tokens: int = 8
) -> list[list[int]]:
    """Token ids of up to ``n`` prompts (the file's first ``n``, or built-in passages), each cut to
    ``max_tokens``; prompts shorter than ``min_tokens`` are left out."""
    if path is None:
        ids = [list(tokenizer(text)["input_ids"]) for text in builtin_passages(n, seed)]
    else:
        from lens_evals.capture.inputs import read_prompts

        ids = [item.tokenize(tokenizer) for item in read_prompts(path)[:n]]
    return [row[:max_tokens] for row in ids if len(row) >= min_tokens]


def split(prompts: list[list[int]], held_out: float, seed: int = 0) -> tuple[list[list[int]], list[list[int]]]:
    """``(train, held_out)``: a seeded shuffle, the last ``held_out`` fraction held out (at least one)."""
    order = list(range(len(prompts)))
    random.Random(seed).shuffle(order)
    n_held = max(1, round(len(prompts) * held_out))
    if n_held >= len(prompts):
        raise ValueError(f"{len(prompts)} prompts leave none to train on with {held_out:.0%} held out")
    return [prompts[i] for i in order[:-n_held]], [prompts[i] for i in order[-n_held:]]
