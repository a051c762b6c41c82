"""Wrong `-T` arguments of the activation-oracle tasks: a ValueError naming the argument and what
it takes, when the task is built. A misspelt family used to be dropped silently (the task ran on
the others), nothing at all gave Inspect's "The specified dataset is empty", an unknown prompt
set an Errno message, and num_tokens=0 failed every sample once the engine ran. No engine: the
oracle's card is all the tasks read."""

from __future__ import annotations

import json

import pytest

from lens_evals.evals.activation_oracle.activation_oracle import oracle_heldout_task, secret_word_task


@pytest.fixture
def oracle_dir(tmp_path):
    """An oracle directory with the card fields the tasks read (no adapter weights needed)."""
    (tmp_path / "adapter_config.json").write_text(json.dumps({"r": 8}))
    card = {
        "config": {"seed": 0},
        "oracle": {"target_layer": 1, "injection_layer": 1, "placeholder": " ?", "coefficient": 1.0, "num_tokens": 12},
    }
    (tmp_path / "card.json").write_text(json.dumps(card))
    return str(tmp_path)


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"families": "sentiment,topc"}, "families: unknown family 'topc'; expected some of truth, sentiment, topic, language, word"),
        ({"families": ","}, "families: no family given"),
        ({"per_family": 0}, "per_family must be 1 or more, got 0"),
    ],
)
def test_heldout_task_arguments(oracle_dir, arguments, message) -> None:
    with pytest.raises(ValueError, match=message):
        oracle_heldout_task(oracle_dir, **arguments)


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (
            {"prompts": "nosuch"},
            "prompts: unknown prompt set 'nosuch'; expected one of taboo_direct_test, taboo_direct_val, taboo_standard_test",
        ),
        ({"per_word": -1}, "per_word must be 1 or more, got -1"),
        ({"num_tokens": 0}, "num_tokens must be 1 or more, or None for every position, got 0"),
    ],
)
def test_secret_word_task_arguments(oracle_dir, arguments, message) -> None:
    with pytest.raises(ValueError, match=message):
        secret_word_task(oracle_dir, **arguments)


def test_good_arguments_build_the_tasks(oracle_dir) -> None:
    # two families of 5 each; 20 Taboo words x 3 prompts each
    heldout = oracle_heldout_task(oracle_dir, families="sentiment,topic", per_family=5)
    assert sorted({sample.metadata["family"] for sample in heldout.dataset}) == ["sentiment", "topic"] and len(heldout.dataset) == 10
    assert len(secret_word_task(oracle_dir, prompts="taboo_direct_val", per_word=3, num_tokens=4).dataset) == 60


def test_an_oracle_card_of_another_base_model_is_refused_by_the_eval(oracle_dir, tmp_path) -> None:
    """The task takes its settings (target layer, placeholder, coefficient) from the card; on a
    model the oracle was not trained on they mean nothing, and with -M base_url no server flag
    check sees the adapter. Refused at the first sample, before any request, naming both models."""
    from inspect_ai import eval as inspect_eval

    card_file = tmp_path / "card.json"
    card_file.write_text(json.dumps({**json.loads(card_file.read_text()), "base_model": "smollm2-135m-instruct"}))
    log = inspect_eval(
        oracle_heldout_task(oracle_dir, per_family=1), model="mockllm/model", limit=1, log_dir=str(tmp_path / "logs"), display="none"
    )[0]
    assert log.status == "error" and log.error is not None
    assert "oracle trained on smollm2-135m-instruct, not on the evaluated model model" in log.error.message
    # the right base model on a provider without activations: a clear error, not
    # AttributeError("'MockLLM' object has no attribute 'served_models'")
    card_file.write_text(json.dumps({**json.loads(card_file.read_text()), "base_model": "model"}))
    log = inspect_eval(
        oracle_heldout_task(oracle_dir, per_family=1), model="mockllm/model", limit=1, log_dir=str(tmp_path / "logs"), display="none"
    )[0]
    assert log.error is not None and "activation_oracle needs a vllm-lens/<model> model, got mockllm/model" in log.error.message
