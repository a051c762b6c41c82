"""The trained SmolLM2 oracle beats its zero-vector baseline on held-out items (slow: it
trains the oracle first if the cache has none, which takes minutes on a quiet 2-core CPU).

Bounds, from the measurement in docs/oracles.md (`lens-evals oracle train`, 40 held-out items per
family): the oracle gets the answer from the activations on sentiment, topic and word, where the
zero-vector baseline is at chance or below, so each of those must beat the baseline by at least
MIN_FAMILY_GAIN and the whole mix by MIN_OVERALL_GAIN. Truth (Geometry of Truth) stays near
chance for a 135M model and is not bounded."""

from __future__ import annotations

import pytest

from lens_evals.oracle.adapters import DEFAULT_ORACLE, RECIPES, oracle_path

MIN_OVERALL_GAIN = 0.25
MIN_FAMILY_GAIN = 0.4
STRONG_FAMILIES = ("sentiment", "topic", "word")


@pytest.mark.slow
def test_trained_oracle_beats_zero_vector_on_heldout(smollm2_path) -> None:
    from transformers import AutoTokenizer
    from vllm.lora.request import LoRARequest

    from lens_evals.engine.frontend.offline import close_offline_engine
    from lens_evals.oracle.adapters import adapter_rank, read_card
    from lens_evals.oracle.build import build_oracle, start_engine
    from lens_evals.oracle.evaluate import evaluate_offline
    from lens_evals.oracle.lora_training import OracleTrainConfig
    from lens_evals.oracle.qa_items import all_items, sample_mix

    try:
        directory = oracle_path(DEFAULT_ORACLE)
    except FileNotFoundError:
        directory, _ = build_oracle(DEFAULT_ORACLE, RECIPES[DEFAULT_ORACLE])
    config = OracleTrainConfig(**read_card(str(directory))["config"])
    items = sample_mix(all_items(), "heldout", config.eval_per_family, config.seed + 1, config.families)
    assert all(item.split == "heldout" for item in items)
    llm = start_engine(str(smollm2_path), adapter_rank(directory))
    try:
        result = evaluate_offline(
            llm, AutoTokenizer.from_pretrained(str(smollm2_path)), LoRARequest("oracle", 1, str(directory)), config.settings(), items
        )
    finally:
        close_offline_engine(llm)
    oracle, zero = result["oracle"], result["zero_vector"]
    print("oracle", oracle, "zero vector", zero)
    assert oracle["all"] >= zero["all"] + MIN_OVERALL_GAIN
    for family in STRONG_FAMILIES:
        assert oracle[family] >= zero[family] + MIN_FAMILY_GAIN, family
