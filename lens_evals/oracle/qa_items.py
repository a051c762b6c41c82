"""Question-answer items for training and evaluating an activation oracle.

Each item is a target conversation (one user message, ``context``), a question about it and a
one-word answer. Families:

* ``truth``: Geometry of Truth statements (cities, Spanish-English translations; shipped in
  ``lens_evals/data/geometry_of_truth``), True/False;
* ``sentiment``, ``topic``, ``language``, ``word``: written for this project
  (``lens_evals/data/oracle/*.yaml``).

The split is a fixed function of each item's *group* (a city, a sentiment word, a topic noun,
a sentence, a word): within each family and answer, every fifth group in hash order is
held out, so held-out items share no group with training items and the held-out split never
changes between runs or machines."""

from __future__ import annotations

import csv
import hashlib
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import yaml

from lens_evals.data import data_file

Split = Literal["train", "heldout"]
FAMILIES = ("truth", "sentiment", "topic", "language", "word")
QUESTIONS = {
    "truth": "Is this statement true or false?",
    "sentiment": "Is the sentiment positive or negative?",
    "topic": "What is the topic?",
    "language": "Which language is it?",
    "word": "What word is the text about?",
}
HELDOUT_EVERY = 5
GOT_FILES = ("cities.csv", "sp_en_trans.csv")


@dataclass(frozen=True)
class OracleItem:
    family: str
    context: str  # the target's user message
    question: str
    answer: str  # one word
    group: str  # held-out items share no group with training items
    split: Split = "train"


def answer_matches(generated: str, answer: str) -> bool:
    """The first word of the oracle's answer, case and punctuation aside, is the answer."""
    words = "".join(ch if ch.isalnum() else " " for ch in generated).split()
    return bool(words) and words[0].lower() == answer.lower()


def _hash(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def assign_splits(items: Iterable[OracleItem]) -> list[OracleItem]:
    """Hold out every ``HELDOUT_EVERY``-th group (in hash order) of each (family, answer)."""
    items = list(items)
    groups: dict[tuple[str, str], set[str]] = {}
    for item in items:
        groups.setdefault((item.family, item.answer if item.family != "word" else ""), set()).add(item.group)
    heldout: set[tuple[str, str]] = set()
    for (family, _), names in groups.items():
        ordered = sorted(names, key=lambda name: _hash(f"{family}:{name}"))
        heldout.update((family, name) for name in ordered[::HELDOUT_EVERY])
    return [
        OracleItem(
            item.family,
            item.context,
            item.question,
            item.answer,
            item.group,
            "heldout" if (item.family, item.group) in heldout else "train",
        )
        for item in items
    ]


def _yaml(name: str) -> dict[str, Any]:
    with open(data_file("oracle", name), encoding="utf-8") as f:
        data: dict[str, Any] = yaml.safe_load(f)
    return data


def truth_items() -> list[OracleItem]:
    items = []
    for name in GOT_FILES:
        with open(data_file("geometry_of_truth", name), encoding="utf-8") as f:
            for row in csv.DictReader(f):
                # cities: both statements about one city share a group; translations: the Spanish word
                group = row.get("city") or row["statement"].split("'")[1]
                items.append(
                    OracleItem("truth", row["statement"], QUESTIONS["truth"], "True" if row["label"] == "1" else "False", f"{name}:{group}")
                )
    return items


def sentiment_items() -> list[OracleItem]:
    data = _yaml("sentiment.yaml")
    return [
        OracleItem("sentiment", template.format(noun=noun, word=word), QUESTIONS["sentiment"], label, word)
        for label, words in data["labels"].items()
        for word in words
        for noun in data["nouns"]
        for template in data["templates"]
    ]


def topic_items() -> list[OracleItem]:
    data = _yaml("topic.yaml")
    return [
        OracleItem("topic", template.format(noun=noun), QUESTIONS["topic"], label, noun)
        for label, nouns in data["labels"].items()
        for noun in nouns
        for template in data["templates"]
    ]


def language_items() -> list[OracleItem]:
    data = _yaml("language.yaml")
    return [
        OracleItem("language", sentence, QUESTIONS["language"], language, row[0])
        for row in data["sentences"]
        for language, sentence in zip(data["languages"], row)
    ]


def word_items() -> list[OracleItem]:
    data = _yaml("words.yaml")
    return [
        OracleItem("word", template.format(word=word), QUESTIONS["word"], word, word)
        for word in data["words"]
        for template in data["templates"]
    ]


def all_items() -> list[OracleItem]:
    items = truth_items() + sentiment_items() + topic_items() + language_items() + word_items()
    return assign_splits(items)


def sample_mix(
    items: Sequence[OracleItem], split: Split, per_family: int, seed: int = 0, families: Sequence[str] = FAMILIES
) -> list[OracleItem]:
    """Up to ``per_family`` items of each family from one split, answers balanced round-robin."""
    rng = random.Random(seed)
    mix: list[OracleItem] = []
    for family in families:
        by_answer: dict[str, list[OracleItem]] = {}
        for item in items:
            if item.family == family and item.split == split:
                by_answer.setdefault(item.answer, []).append(item)
        pools = [rng.sample(pool, len(pool)) for _, pool in sorted(by_answer.items())]
        rng.shuffle(pools)
        picked: list[OracleItem] = []
        while len(picked) < per_family and any(pools):
            for pool in pools:
                if pool and len(picked) < per_family:
                    picked.append(pool.pop())
        mix.extend(picked)
    rng.shuffle(mix)
    return mix


def taboo_prompt_sets() -> list[str]:
    """The names :func:`taboo_prompts` takes (``data/activation_oracles_secret_keeping/*.txt``)."""
    return sorted(path.stem for path in data_file("activation_oracles_secret_keeping").glob("*.txt"))


def taboo_prompts(name: str = "taboo_standard_test") -> list[str]:
    """User prompts of the Taboo secret-keeping benchmark (``data/activation_oracles_secret_keeping``)."""
    lines = data_file("activation_oracles_secret_keeping", f"{name}.txt").read_text(encoding="utf-8").splitlines()
    return [line.strip() for line in lines if line.strip()]
