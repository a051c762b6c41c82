"""Probe recipes (several layers, token aggregation, a follow-up question, varied training data):
a planted direction is recovered, aggregations and the layer ensemble match hand-computed values,
the follow-up answer is the scored span, cards round-trip, and on tiny-llama a recipe trained on
known-answer dialogues separates held-out ones and scores the same on the worker, in one request,
as on the host."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lens_evals.probing.dialogues import Dialogue, render, tokenize_dialogue
from lens_evals.probing.metrics import auroc
from lens_evals.probing.recipe_study import auroc_interval, is_dev
from lens_evals.probing.recipe_train import capture_recipe_view, relative_layers, stacked
from lens_evals.probing.recipes import FollowUp, RecipeProbe, aggregate, fit_recipe, load_recipe, recipe_files, with_follow_up
from lens_evals.probing.varied_pairs import DISHONEST_INSTRUCTIONS, HONEST_INSTRUCTIONS, varied_pairs
from tests.conftest import make_llm
from tests.tolerance import score_bound

HIDDEN = 32


def planted(n: int, n_layers: int, direction: np.ndarray, seed: int, tokens: int = 4) -> tuple[list[np.ndarray], np.ndarray]:
    """Unit noise at every layer, plus 3 x ``direction`` on every token of the label-1 dialogues (one
    token alone then separates the classes at AUROC ~0.98: ``last`` is held to the same bound)."""
    rng = np.random.default_rng(seed)
    labels = np.arange(n) % 2
    features = [(rng.normal(size=(n_layers, tokens, HIDDEN)) + 3.0 * label * direction).astype(np.float32) for label in labels]
    return features, labels


@pytest.mark.parametrize("layers", [[3], [2, 5, 7]])
@pytest.mark.parametrize("aggregation", ["mean", "max", "last"])
def test_a_planted_direction_is_recovered_at_every_layer_and_aggregation(layers, aggregation):
    direction = np.zeros(HIDDEN)
    direction[[1, 4]] = 1 / np.sqrt(2)
    features, labels = planted(200, len(layers), direction, seed=0)
    recipe = fit_recipe("r", "m", layers, features, labels, aggregation)  # type: ignore[arg-type]
    for weights in recipe.weights:
        cosine = weights @ direction / np.linalg.norm(weights)
        assert cosine > 0.8, f"readout points {cosine:.2f} along the planted direction"
    held_out, held_labels = planted(100, len(layers), direction, seed=1)
    assert auroc(held_labels, recipe.scores(held_out)) > 0.97
    flipped, _ = planted(100, len(layers), -direction, seed=1)  # the sign is learned, not just the axis
    assert auroc(held_labels, recipe.scores(flipped)) < 0.03


def test_aggregations_and_the_layer_mean_hand_computed():
    assert aggregate(np.array([1.0, 3.0, 2.0]), "mean") == pytest.approx(2.0)
    assert aggregate(np.array([1.0, 3.0, 2.0]), "max") == 3.0
    assert aggregate(np.array([1.0, 3.0, 2.0]), "last") == 2.0
    with pytest.raises(ValueError, match="non-empty"):
        aggregate(np.array([]), "mean")
    # two layers, unit weights on feature 0 and 1, biases 1 and -1; two tokens
    from lens_evals.probing.recipes import RecipeCard

    card = RecipeCard(name="r", model="m", layers=[4, 9], hidden_size=2, biases=[1.0, -1.0], training_set="t", aggregation="max")
    recipe = RecipeProbe(card, [np.array([1.0, 0.0], np.float32), np.array([0.0, 1.0], np.float32)])
    features = np.array([[[2.0, 0.0], [0.0, 0.0]], [[0.0, 4.0], [0.0, 8.0]]])  # (layers, tokens, hidden)
    # token scores: layer 4 -> [3, 1], layer 9 -> [3, 7]; mean over layers -> [3, 4]; max -> 4
    np.testing.assert_allclose(recipe.token_scores(features), [3.0, 4.0])
    assert recipe.score(features) == pytest.approx(4.0)
    assert [p.name for p in recipe.linear_probes()] == ["r/L4", "r/L9"] and [p.layer for p in recipe.linear_probes()] == [4, 9]


def test_recipe_card_round_trips_and_refuses_a_foreign_weights_file(tmp_path):
    direction = np.eye(HIDDEN)[0]
    features, labels = planted(40, 2, direction, seed=2)
    recipe = fit_recipe("qwen2.5-coder-0.5b__ip__L3-5", "m", [3, 5], features, labels, "last", FollowUp(), "varied-pairs")
    recipe.calibrate(planted(50, 2, direction, seed=3)[0])
    saved = recipe.save(tmp_path)
    assert saved.name == "qwen2.5-coder-0.5b__ip__L3-5.recipe.json"
    loaded = load_recipe(tmp_path / "qwen2.5-coder-0.5b__ip__L3-5")
    assert loaded.card.model_dump_json() == recipe.card.model_dump_json() and loaded.card.follow_up == FollowUp()
    np.testing.assert_array_equal(loaded.scores(features), recipe.scores(features))
    assert recipe_files(saved) == recipe_files(saved.with_name(saved.name.replace(".json", ".npz")))
    np.savez(recipe_files(saved)[1], layer3=recipe.weights[0])  # layer 5's weights gone
    with pytest.raises(ValueError, match=r"no weights for layers \[5\]"):
        load_recipe(saved)


def test_the_follow_up_answer_is_the_scored_span(tiny_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_path)
    follow_up = FollowUp(question="Did you lie just now?", answer="No, I did not.")
    original = Dialogue(
        messages=[{"role": "user", "content": "Where is Paris?"}, {"role": "assistant", "content": "Employee: In Italy."}],
        label=1,
        score_from=9,
    )
    dialogue = with_follow_up(original, follow_up)
    tokenized = tokenize_dialogue(tokenizer, dialogue)
    text = render(tokenizer, dialogue.messages)
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    spans = [encoded["offset_mapping"][i] for i in tokenized.scored_positions]
    assert text[spans[0][0] : spans[-1][1]].strip() == "No, I did not."
    assert spans[0][0] > text.rindex("Did you lie just now?")  # after the question, not in the first answer
    assert (dialogue.label, dialogue.score_from, dialogue.messages[:2]) == (1, 0, original.messages)
    assert with_follow_up(original, None) is original


def test_varied_pairs_pair_one_style_and_vary_the_instruction():
    dialogues = varied_pairs()
    assert len(dialogues) % 2 == 0 and {d.label for d in dialogues} == {0, 1}
    for honest, dishonest in zip(dialogues[::2], dialogues[1::2]):
        assert honest.group == dishonest.group and honest.metadata == dishonest.metadata
        assert honest.messages[-1] == dishonest.messages[-1]  # the same fact
    instructions = {m["content"] for d in dialogues for m in d.messages[:-1]}
    used = {i for i in HONEST_INSTRUCTIONS + DISHONEST_INSTRUCTIONS if any(i in text for text in instructions)}
    assert len(used) == len(HONEST_INSTRUCTIONS + DISHONEST_INSTRUCTIONS)
    assert len({d.metadata["style"] for d in dialogues}) == 4
    assert [d.messages for d in varied_pairs()] == [d.messages for d in dialogues]  # the same set every run


def test_relative_layers_and_the_bootstrap_interval():
    assert relative_layers(30) == [7, 11, 14, 17, 20]  # round(29 x [0.25, 0.3625, 0.475, 0.5875, 0.70])
    assert relative_layers(2) == [0, 1]
    rng = np.random.default_rng(0)
    labels = np.tile([0, 1], 100)
    scores = rng.normal(size=200) + labels
    low, high = auroc_interval(labels, scores, [str(i // 2) for i in range(200)], n=400)
    assert low < auroc(labels, scores) < high and high - low < 0.2


def known_answer_dialogues(n: int) -> list[Dialogue]:
    """Label 1 answers name a zebra, label 0 an apple: the stream of a random model separates them."""
    dialogues = []
    for i in range(n):
        word = ("apple", "zebra")[i % 2]
        answer = f"Answer {i}: the {word} is {('red', 'big', 'old', 'new')[i % 4]} today."
        dialogues.append(
            Dialogue(messages=[{"role": "user", "content": f"Question {i}?"}, {"role": "assistant", "content": answer}], label=i % 2)
        )
    return dialogues


@pytest.mark.parametrize("follow_up", [None, FollowUp()])
def test_a_recipe_trained_on_tiny_llama_separates_held_out_dialogues_and_scores_the_same_on_the_worker(tiny_path, follow_up):
    from vllm import SamplingParams

    from lens_evals.request.spec import CAPTURE_KEY, PROBE_KEY

    layers = [0, 1]
    dialogues = known_answer_dialogues(48)
    with make_llm(tiny_path, enable_prefix_caching=False) as llm:
        data = capture_recipe_view(llm, dialogues, layers, follow_up, desc="known answers")
        features = stacked(data, layers)
        recipe = fit_recipe("tiny", "tiny-llama", layers, features[:32], data.labels[:32], "mean", follow_up)
        assert auroc(data.labels[32:], recipe.scores(features[32:])) > 0.95
        tokenizer = llm.get_tokenizer()
        # one request carries every layer's readout (and a capture, for the host's reference)
        params = SamplingParams(max_tokens=1, temperature=0.0, extra_args={PROBE_KEY: recipe.linear_probes(), CAPTURE_KEY: layers})
        for dialogue in dialogues[32:36]:
            tokenized = tokenize_dialogue(tokenizer, recipe.dialogue(dialogue))
            out = llm.generate([{"prompt_token_ids": tokenized.token_ids}], params, use_tqdm=False)[0].activations
            per_layer = {
                layer: out["probe_scores"][recipe.readout_name(layer)].double().numpy()[tokenized.scored_positions] for layer in layers
            }
            got = float(recipe.combine(per_layer).mean())
            rows = out["residual_stream"][:, tokenized.scored_positions].float()
            bound = max(
                score_bound(torch.from_numpy(w), rows[i], same_rows=True, bias=b).mean().item()
                for i, (w, b) in enumerate(zip(recipe.weights, recipe.card.biases))
            )
            assert got == pytest.approx(recipe.score(rows.numpy()), rel=0, abs=bound), f"bound {bound:.2e}"


def test_roleplaying_dev_split_is_fixed_by_the_scenario_and_about_a_third():
    from lens_evals.probing import datasets

    dialogues = datasets.roleplaying_dialogues()
    dev = [is_dev(d) for d in dialogues]
    assert dev[::2] == dev[1::2]  # a scenario's two completions stay together
    assert 0.2 < np.mean(dev) < 0.45


@pytest.mark.slow
@pytest.mark.parametrize("follow_up", [None, FollowUp(question="Did you lie?", answer="No, I did not.")])
def test_roleplaying_recipe_task_on_a_tiny_llama_server_equals_the_recipe_on_an_offline_capture(tiny_path, tmp_path, follow_up):
    """The Inspect task sends each sample once (the follow-up appended when the card has one) with
    every layer's readout; its scores equal the recipe applied on the host to an offline capture."""
    from inspect_ai import eval as inspect_eval
    from inspect_ai.model import get_model

    from lens_evals.evals.roleplaying.recipe_probe import roleplaying_recipe_task
    from lens_evals.inspect_kit.provider.server import LensServer
    from lens_evals.probing import datasets
    from tests.tolerance import assert_dialogue_scores_close

    dialogues = datasets.roleplaying_dialogues()[:6]
    rng = np.random.default_rng(11)
    card_features = [rng.normal(size=(2, 3, 128)).astype(np.float32) for _ in range(8)]
    recipe = fit_recipe("tiny-recipe", "tiny-llama", [0, 2], card_features, [0, 1] * 4, "max", follow_up)
    recipe.calibrate([rng.normal(size=(2, 3, 128)).astype(np.float32) for _ in range(20)])
    path = recipe.save(tmp_path / "probes")
    server = LensServer(str(tiny_path), served_name="tiny-llama", server_args={"dtype": "float32", "max_model_len": 1024, "seed": 0})
    server.start()
    try:
        log = inspect_eval(
            roleplaying_recipe_task(path, tokenizer=str(tiny_path)),
            model=get_model("vllm-lens/tiny-llama", base_url=f"{server.url}/v1"),
            limit=len(dialogues),
            log_dir=str(tmp_path / "logs"),
            display="none",
        )[0]
    finally:
        server.stop()
    assert log.status == "success", log.error
    with make_llm(tiny_path, enable_prefix_caching=False) as llm:
        features = stacked(capture_recipe_view(llm, dialogues, [0, 2], follow_up, desc="offline"), [0, 2])
    by_id = {s.id: s.metadata["probes"]["recipe"] for s in log.samples}
    for index, feature in enumerate(features):
        reading = by_id[f"{index // 2}-{'honest' if index % 2 == 0 else 'deceptive'}"]
        assert reading["layer"] == [0, 2] and reading["aggregation"] == "max"
        assert reading["n_tokens"] == feature.shape[1]  # the follow-up answer's tokens when there is one
        assert_dialogue_scores_close([reading["score"]], [recipe.score(feature)], f"sample {index}")
        assert reading["flagged"] == (reading["score"] > recipe.card.threshold)


def test_recipe_table_marks_the_dev_choice_and_the_cli_reads_recipe_options(tmp_path, capsys):
    import argparse
    import json

    from lens_evals.cli.app import main as cli
    from lens_evals.cli.probe_recipes import layer_list
    from lens_evals.probing.recipe_report import recipes_table

    row = {"layers": [7, 11], "aggregation": "max", "dev_auroc": 0.61, "test_auroc": 0.55, "test_auroc_95": [0.5, 0.6]}
    run = {"model": "m", "best_by_dev": "b", "recipes": [{**row, "recipe": "a", "recall_at_1pct_fpr": 0.1, "flagged_honest": 0.0}]}
    run["recipes"].append({**row, "recipe": "b", "recall_at_1pct_fpr": 0.25, "flagged_honest": 0.02})
    path = tmp_path / "recipes-m-float32.json"
    path.write_text(json.dumps(run))
    lines = recipes_table([path]).splitlines()
    assert lines[2] == "| m | a | 7,11 | max | 0.610 | 0.550 [0.500, 0.600] | 0.100 | 0.000 |"
    assert "b **(best on dev)**" in lines[3] and len(lines) == 4
    # the command's stdout is that table alone (a script writes it to a .md file); the plot's path on stderr
    capsys.readouterr()
    assert cli(["probes", "recipes-report", str(path), "--out", str(tmp_path / "plot.png")]) == 0
    printed = capsys.readouterr()
    assert printed.out == recipes_table([path]) + "\n" and printed.err == f"plot: {tmp_path / 'plot.png'}\n"
    assert (tmp_path / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert layer_list("7, 11,14") == [7, 11, 14]
    for bad in ("7,7", "", "-1"):
        with pytest.raises(argparse.ArgumentTypeError):
            layer_list(bad)


def test_the_main_jobs_context_line_names_the_samples_it_scored():
    from lens_evals.probing.recipe_defaults import context_line

    chosen = "(varied-pairs, ensemble of layers 7-20, last token, chosen on the dev split; 0.655 on the test split)"
    assert context_line("smollm2-135m-instruct", 0.7, 288, 288).startswith(f"AUROC 0.700 on all 288 samples {chosen}: chance 0.5")
    assert context_line("smollm2-135m-instruct", 0.7, 10, 288).startswith(f"AUROC 0.700 on 10 of the 288 samples (--limit) {chosen}")
    assert "144 scenarios" not in context_line("smollm2-135m-instruct", 0.7, 10, 288)
