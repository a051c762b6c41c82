"""A deterministic prompt set of varied lengths, as token ids (so every system sees the same
tokens, whatever its tokenizer handling): text from a seeded word generator when the model has a
tokenizer, seeded random ids otherwise (the random-weight GPU model has none)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

WORDS = (
    "the a model river city student engine probe vector layer truth answer book friend team data "
    "reads writes finds likes steers captures sees builds asks tells keeps moves opens closes "
    "small large quiet bright old new red green early late under over near far and but because "
    "when while after before every some many few one two three four five six seven eight nine ten"
).split()
MIN_TOKENS = 8
MAX_TOKENS = 64  # lengths uniform in [MIN, MAX]: mean 36, close to the reference set's 36.5


def prompt_lengths(n: int, seed: int = 0) -> list[int]:
    rng = np.random.default_rng(seed)
    return [int(x) for x in rng.integers(MIN_TOKENS, MAX_TOKENS + 1, size=n)]


def _text(rng: np.random.Generator, n_words: int) -> str:
    words = rng.choice(WORDS, size=n_words)
    sentences, start = [], 0
    while start < n_words:
        end = start + int(rng.integers(4, 12))
        sentences.append(" ".join(words[start:end]).capitalize() + ".")
        start = end
    return " ".join(sentences)


def make_prompts(n: int, model_dir: Path, vocab_size: int, seed: int = 0, lengths: list[int] | None = None) -> list[list[int]]:
    """``n`` prompts of MIN_TOKENS..MAX_TOKENS token ids each (or of the given ``lengths``)."""
    lengths = prompt_lengths(n, seed) if lengths is None else lengths
    rng = np.random.default_rng(seed + 1)
    tokenizer = _load_tokenizer(model_dir)
    if tokenizer is None:
        # Stay clear of the low ids where special tokens usually live.
        low = min(1000, vocab_size // 4)
        return [[int(t) for t in rng.integers(low, vocab_size, size=length)] for length in lengths]
    prompts = []
    for length in lengths:
        ids = tokenizer(_text(rng, length * 2))["input_ids"][:length]
        if len(ids) < length:
            raise RuntimeError(f"prompt text tokenised to {len(ids)} < {length} tokens")
        prompts.append([int(t) for t in ids])
    return prompts


def _load_tokenizer(model_dir: Path) -> PreTrainedTokenizerBase | None:
    if not any((model_dir / name).exists() for name in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))
