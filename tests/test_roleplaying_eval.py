"""End to end on SmolLM2: train a probe on a small Instructed-Pairs subset with the offline
engine, run the Roleplaying task through the vllm-lens provider (a real server), and check each
sample's score against the same probe applied to an offline capture of the same dialogue."""

from __future__ import annotations

import math

import numpy as np
import pytest
from inspect_ai import eval as inspect_eval
from inspect_ai.event import InfoEvent
from inspect_ai.model import ModelOutput, ModelUsage, get_model

from lens_evals.evals.roleplaying import roleplaying_task
from lens_evals.inspect_kit.probe_reading import INFO_SOURCE
from lens_evals.probing import datasets
from lens_evals.probing.extract import extract_features
from lens_evals.probing.metrics import auroc
from lens_evals.probing.train import dialogue_scores, fit_pipeline, split_groups, train_probe
from tests.conftest import make_llm
from tests.tolerance import assert_dialogue_scores_close

N_SAMPLES = 8


def test_roleplaying_eval_scores_equal_offline(smollm2_path, tmp_path) -> None:
    with make_llm(smollm2_path, enable_prefix_caching=False) as llm:
        probe = train_probe(
            str(smollm2_path), layer=15, llm=llm, limit=60, control_limit=20, control_max_tokens=24, out_dir=tmp_path, name="subset"
        )
        dialogues = datasets.roleplaying_dialogues()[:N_SAMPLES]
        expected = [probe.score(f[0]) for f in extract_features(llm, dialogues, [15])]
    card = probe.card
    assert card.n_control == 20 and card.layer == 15 and card.n_train_dialogues + card.n_val_dialogues <= 62
    assert math.isfinite(card.threshold) and 0.0 <= card.validation_auroc <= 1.0

    tasks = [
        roleplaying_task(tmp_path / "subset.safetensors", tokenizer=str(smollm2_path), on_worker=on_worker) for on_worker in (True, False)
    ]  # probe-on-worker, and capture + score here
    verdicts = ["DECEPTIVE", "HONEST", "AMBIGUOUS", "I think HONEST."] * 2
    grader = get_model(
        "mockllm/model",
        custom_outputs=[
            ModelOutput.from_content("mockllm/model", v).model_copy(
                update={"usage": ModelUsage(input_tokens=1, output_tokens=1, total_tokens=2)}
            )
            for v in verdicts
        ],
    )
    tasks.append(
        roleplaying_task(tmp_path / "subset.safetensors", mode="on_policy", grader=grader, tokenizer=str(smollm2_path), max_tokens=8)
    )
    logs = inspect_eval(
        tasks, model="vllm-lens/smollm2-135m-instruct", limit=N_SAMPLES, log_dir=str(tmp_path / "logs"), display="none", max_tasks=1
    )
    assert [log.status for log in logs] == ["success"] * 3, [log.error for log in logs]
    for log in logs[:2]:
        check_log(log, expected)
    check_on_policy(logs[2], verdicts)


def check_on_policy(log, verdicts) -> None:
    """The model answers after the prefix; its generated tokens (all but the last) are scored."""
    samples = sorted(log.samples, key=lambda s: int(s.id))
    labels = [s.scores["probe_scorer"].metadata["label"] for s in samples]
    # Inspect scores samples in completion order, so grader verdicts land in some order: count them.
    assert sorted(labels, key=str) == sorted([{"DECEPTIVE": 1, "HONEST": 0}.get(v.split()[-1].strip(".")) for v in verdicts], key=str)
    for sample in samples:
        (probe,) = sample.metadata["probe"].values()
        answer = sample.messages[-1]
        assert answer.role == "assistant" and answer.text.startswith(sample.metadata["answer_prefix"].strip())
        reading = probe_reading(sample)
        first, end = reading["scored"]
        assert 1 <= probe["n_tokens"] == end - first <= 7
        # The prefix's tokens are shown but not scored; the scored tokens are the model's answer.
        assert "".join(row[0] for row in reading["rows"][:first]).strip() == sample.metadata["answer_prefix"].strip()
        scored_text = "".join(row[0] for row in reading["rows"][first:end])
        assert answer.text[probe["answer_from"] :].startswith(scored_text)
        assert sample.scores["probe_scorer"].value["score"] == pytest.approx(
            np.mean([row[1] for row in reading["rows"][first:end]]), abs=1e-3
        )


def probe_reading(sample) -> dict:
    return next(e.data for e in sample.events if isinstance(e, InfoEvent) and e.source == INFO_SOURCE)


def check_log(log, expected) -> None:
    samples = sorted(log.samples, key=lambda s: (int(str(s.id).split("-")[0]), str(s.id).endswith("deceptive")))
    got = [s.scores["probe_scorer"].value["score"] for s in samples]
    assert_dialogue_scores_close(got, expected, "served Roleplaying scores vs offline")
    labels = [s.scores["probe_scorer"].metadata["label"] for s in samples]
    assert labels == [0, 1] * (N_SAMPLES // 2)
    metrics = {name: m.value for s in log.results.scores for name, m in s.metrics.items()}
    assert metrics["AUROC"] == pytest.approx(auroc(labels, got))
    for sample in samples:  # every token of the response, the answer prefix not scored
        reading = probe_reading(sample)
        assert "".join(row[0] for row in reading["rows"]) == sample.messages[-1].text
        assert "".join(row[0] for row in reading["rows"][reading["scored"][0] :]).strip() == sample.scores["probe_scorer"].answer
    assert samples[0].messages[-1].role == "assistant" and samples[0].metadata["kind"] == "honest"


def test_geometry_of_truth_probe_beats_chance_on_held_out(smollm2_path) -> None:
    """cities, last token, layer 15, 400 statements (200 cities), 80/20 split by city."""
    dialogues = [d for d in datasets.geometry_of_truth(["cities"])][:400]
    with make_llm(smollm2_path, enable_prefix_caching=False) as llm:
        features = [f[0] for f in extract_features(llm, dialogues, [15], "last")]
    labels = np.array([d.label for d in dialogues])
    train, val = split_groups(dialogues, seed=0)
    pipeline = fit_pipeline([features[i] for i in train], labels[train], C=0.1)
    held_out = auroc(labels[val], dialogue_scores(pipeline, [features[i] for i in val]))
    print(f"Geometry of Truth cities held-out AUROC {held_out:.3f} on {len(val)} statements")
    assert held_out >= 0.75
