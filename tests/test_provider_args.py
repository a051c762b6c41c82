"""Wrong `-M` model args and model names of the `vllm-lens` provider: a ValueError naming the
value and what was expected, before a server starts. `vllm-lens/nosuch` used to start a vLLM
server that asked the HF hub for "nosuch" (no network here: a server-log error after its start);
`-M server_timeout=abc` was Python's "could not convert string to float: 'abc'"; 0, -1 or nan a
server given no time at all to start."""

from __future__ import annotations

import pytest
from inspect_ai.model import get_model


def test_an_unknown_model_is_refused_before_a_server_starts() -> None:
    with pytest.raises(ValueError, match="vllm-lens/nosuch: unknown model 'nosuch'; expected one of .*tiny-llama.*, a model directory"):
        get_model("vllm-lens/nosuch", memoize=False, server_timeout=60)


@pytest.mark.parametrize("value", ["abc", 0, -1, "nan"])
def test_a_bad_server_timeout_is_refused_naming_it(value: object) -> None:
    with pytest.raises(ValueError, match=r"-M server_timeout=.*: expected a number of seconds above 0"):
        get_model("vllm-lens/tiny-llama", memoize=False, server_timeout=value)


def test_a_model_directory_passes_the_name_check(tiny_path) -> None:
    from lens_evals.inspect_kit.provider.api import _own_server_spec

    path, served, _, _ = _own_server_spec(str(tiny_path), {}, 60.0)
    assert (path, served) == (str(tiny_path), str(tiny_path))


def test_an_adapter_trained_on_another_base_model_is_refused(tmp_path) -> None:
    """An oracle's card names its base model; served on another, its answers read nothing it learned
    (a model of the same shape would load it)."""
    (tmp_path / "adapter_config.json").write_text('{"r": 8}')
    (tmp_path / "card.json").write_text('{"base_model": "smollm2-135m-instruct"}')
    with pytest.raises(ValueError, match=r"-M lora_modules: adapter oracle \(.*\) was trained on smollm2-135m-instruct, not tiny-llama"):
        get_model("vllm-lens/tiny-llama", memoize=False, server_timeout=60, lora_modules=f"oracle={tmp_path}")


def test_server_flags_say_false_with_no_rather_than_dropping_it() -> None:
    """``-M enable_prefix_caching=false`` used to vanish (a False flag was left out, and vLLM's
    default is on); vLLM's boolean engine arguments take ``--no-`` (tests/test_petri_inspectors.py
    starts a server with one)."""
    from lens_evals.inspect_kit.provider.server import server_flags

    flags = server_flags({"enforce_eager": True, "enable_prefix_caching": False, "max_model_len": 512, "seed": None, "api_key": ["a", "b"]})
    assert flags == ["--enforce-eager", "--no-enable-prefix-caching", "--max-model-len", "512", "--api-key", "a", "b"]
