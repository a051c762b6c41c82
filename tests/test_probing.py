"""Probe metrics, cards and token selection, against scikit-learn and hand-computed values."""

from __future__ import annotations

import numpy as np
import pytest
from inspect_ai.scorer import SampleScore, Score
from sklearn.metrics import roc_auc_score
from transformers import AutoTokenizer

from lens_evals.inspect_kit.probe_scorer import auroc, class_mean, flagged_count, recall_at_threshold
from lens_evals.probing import datasets
from lens_evals.probing.dialogues import Dialogue, scored_char_span, tokenize_dialogue
from lens_evals.probing.metrics import threshold_at_fpr
from lens_evals.probing.probe import Probe, ProbeCard, load_probe
from lens_evals.probing.train import fit_pipeline

RNG = np.random.default_rng(7)


def sample_scores(labels, values, threshold=0.0):
    return [
        SampleScore(
            score=Score(
                value={"score": float(v), "flagged": bool(v > threshold), "label": None},
                metadata={"label": label, "threshold": threshold, "flagged": bool(v > threshold)},
            ),
            sample_id=i,
        )
        for i, (label, v) in enumerate(zip(labels, values))
    ]


def test_metrics_equal_sklearn_and_hand_counts() -> None:
    labels = RNG.integers(0, 2, size=200)
    values = RNG.normal(size=200) + labels * 0.8
    scores = sample_scores(labels, values, threshold=0.5)
    assert auroc()(scores) == {"AUROC": pytest.approx(roc_auc_score(labels, values), abs=1e-12)}
    assert recall_at_threshold()(scores) == {
        "recall at 1% FPR": pytest.approx(((values > 0.5) & (labels == 1)).sum() / (labels == 1).sum())
    }
    assert class_mean(1, "deceptive")(scores) == {"mean score deceptive": pytest.approx(values[labels == 1].mean())}
    assert class_mean(0, "honest")(scores) == {"mean score honest": pytest.approx(values[labels == 0].mean())}
    assert flagged_count()(scores) == {"flagged": float((values > 0.5).sum())}
    # Unlabelled (on-policy ambiguous) and NaN samples are left out.
    extra = sample_scores([None, 1], [99.0, float("nan")], threshold=0.5)
    assert auroc()(scores + extra) == {"AUROC": pytest.approx(roc_auc_score(labels, values), abs=1e-12)}


def test_threshold_is_the_99th_percentile() -> None:
    control = np.arange(1, 201, dtype=float)  # 1..200: 1% (two values) lie above the threshold
    threshold = threshold_at_fpr(control, 0.01)
    assert (control > threshold).sum() == 2
    with pytest.raises(ValueError):
        threshold_at_fpr([], 0.01)


def _card(**changes) -> ProbeCard:
    fields = dict(
        name="unit",
        model="m",
        layer=3,
        hidden_size=8,
        token_selection="all",
        training_set="synthetic",
        n_train_dialogues=10,
        n_val_dialogues=2,
        n_train_tokens=40,
        regularization_C=0.1,
        validation_auroc=0.9,
        threshold=1.25,
        control_set="none",
        n_control=5,
        versions=ProbeCard.current_versions(),
        created=ProbeCard.today(),
    )
    return ProbeCard(**{**fields, **changes})


def test_probe_card_round_trip_and_folded_weights(tmp_path) -> None:
    features = [RNG.normal(size=(5, 8)) + label for label in (0, 1) * 10]
    labels = [0, 1] * 10
    probe = Probe(pipeline=fit_pipeline(features, labels, C=0.1), card=_card())
    path = probe.save(tmp_path)
    loaded = load_probe(path)
    assert loaded.card == probe.card
    acts = RNG.normal(size=(7, 8)).astype(np.float32)
    np.testing.assert_allclose(loaded.token_scores(acts), probe.token_scores(acts), rtol=0, atol=0)
    weights, bias = loaded.folded()
    np.testing.assert_allclose(acts @ weights + bias, probe.token_scores(acts), rtol=1e-4, atol=1e-4)
    assert loaded.score(acts) == pytest.approx(probe.token_scores(acts).mean())
    with pytest.raises(FileNotFoundError, match="lens-evals probes train"):
        load_probe(tmp_path / "missing.safetensors")


def test_scored_span_drops_the_last_words() -> None:
    text = "Cells are the basic units of all living things."
    start, end = scored_char_span(text, 0, 5)
    assert text[start:end] == "Cells are the basic"
    prefix = "Employee: "
    start, end = scored_char_span(prefix + "I was at the game.", len(prefix), 0)
    assert (prefix + "I was at the game.")[start:end] == "I was at the game."


def test_tokens_selected_are_the_scored_text(smollm2_path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(smollm2_path)
    dialogue = datasets.load_roleplaying()[0].dialogue("deceptive")
    tokenized = tokenize_dialogue(tokenizer, dialogue)
    text = tokenizer.decode([tokenized.token_ids[i] for i in tokenized.scored_positions]).strip()
    assert text == dialogue.messages[-1]["content"][dialogue.score_from :].strip()
    assert tokenized.scored_positions[-1] == len(tokenized.token_ids) - 1
    fact = datasets.instructed_pairs()[0]
    kept = tokenizer.decode([tokenize_dialogue(tokenizer, fact).token_ids[i] for i in tokenize_dialogue(tokenizer, fact).scored_positions])
    assert kept.strip() == " ".join(fact.messages[-1]["content"].split()[:-5])
    last = tokenize_dialogue(tokenizer, fact, "last")
    assert len(last.scored_positions) == 1


def test_datasets_shapes_and_labels() -> None:
    pairs = datasets.instructed_pairs()
    assert len(pairs) % 2 == 0 and {d.label for d in pairs} == {0, 1}
    assert all(a.group == b.group and a.messages[-1] == b.messages[-1] for a, b in zip(pairs[::2], pairs[1::2]))
    scenarios = datasets.load_roleplaying()
    assert len(scenarios) >= 120
    assert len(datasets.control_requests()) >= 200
    with pytest.raises(ValueError, match="schema"):
        bad = datasets.data_file("control", "benign_requests.yaml")  # a list of strings, not scenarios
        datasets.load_roleplaying(bad)
    with pytest.raises(ValueError, match="unknown"):
        datasets.training_dialogues("nope")


def test_dialogue_must_end_with_assistant() -> None:
    with pytest.raises(ValueError, match="assistant"):
        Dialogue(messages=[{"role": "user", "content": "hi"}], label=0)
