"""Graph mode (tiny Llama, torch.compile on; CUDA graphs too on a GPU): the tapped layers are
captured, steered and probed by a fixed op inside the compiled graph. Reference: the same
mixed batch on an eager engine (whose captures are tested against HF elsewhere) — tokens equal,
captures and probe scores within the engine tolerance. Requests that need eager mode are clear
errors for that request alone; steering never leaks into later plain requests."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from lens_evals import LinearProbe, SteeringVector
from lens_evals.engine.transport.graph_layers import parse_layer_spec, resolve_layers
from tests.conftest import TINY_PROMPTS, capture, greedy, make_llm
from tests.tolerance import assert_scores_close, assert_stream_close

HIDDEN = 128
TAPPED = [1, 2]
LONG_PROMPT = " ".join(f"the probe reads {n} small data." for n in range(10))
PROMPTS = [LONG_PROMPT, *TINY_PROMPTS[:5]]
VECTOR = np.random.default_rng(3).normal(size=(1, HIDDEN)).astype(np.float32)
PROBE = LinearProbe(name="p", layer=2, weights=np.random.default_rng(4).normal(size=HIDDEN).astype(np.float32), bias=0.5)
AT_POSITIONS = SteeringVector(
    activations=np.random.default_rng(5).normal(size=(1, 2, HIDDEN)).astype(np.float32),
    layer_indices=[2],
    scale=3.0,
    position_indices=[2, 4],
)


def mixed_requests() -> list[dict[str, Any]]:
    """One request per feature, batched together."""
    steer = SteeringVector(activations=VECTOR, layer_indices=[1], scale=4.0)
    return [
        {"output_residual_stream": [1, 2]},
        {"apply_steering_vectors": [steer], "output_residual_stream": [2]},
        {},
        {"output_probe_scores": [PROBE], "output_residual_stream": [2]},
        {"apply_steering_vectors": [AT_POSITIONS], "output_residual_stream": [2]},
        {"apply_steering_vectors": [steer, steer]},  # the same rows steered twice: the deltas add up
    ]


def run_scenario(llm: Any) -> dict[str, Any]:
    params = [greedy(8, **extra) for extra in mixed_requests()]
    mixed = llm.generate(PROMPTS, params, use_tqdm=False)
    plain_after = llm.generate(PROMPTS[:3], greedy(8), use_tqdm=False)  # after steered steps
    return {
        "tokens": [list(o.outputs[0].token_ids) for o in mixed],
        "captures": {i: capture(o) for i, o in enumerate(mixed) if "output_residual_stream" in mixed_requests()[i]},
        "scores": mixed[3].activations["probe_scores"]["p"],
        "plain_after": [list(o.outputs[0].token_ids) for o in plain_after],
    }


@pytest.fixture(scope="module")
def eager_reference(tiny_path) -> dict[str, Any]:
    with make_llm(tiny_path, enable_prefix_caching=False) as llm:
        return run_scenario(llm)


@pytest.fixture(scope="module")
def graph_llm(tiny_path, eager_reference):  # after the eager engine is gone (one engine per process)
    with make_llm(
        tiny_path, enable_prefix_caching=False, enforce_eager=False, additional_config={"lens_evals": {"graph_layers": TAPPED}}
    ) as llm:
        yield llm


def test_graph_mode_equals_eager_mode_on_a_mixed_batch(graph_llm, eager_reference) -> None:
    got = run_scenario(graph_llm)
    assert got["tokens"] == eager_reference["tokens"]
    assert got["plain_after"] == eager_reference["plain_after"]
    # steering moved the stream (else the comparison below would prove little)
    assert eager_reference["tokens"][1] != eager_reference["plain_after"][1]  # same prompt, steered and not
    for index, want in eager_reference["captures"].items():
        assert got["captures"][index].shape == want.shape
        assert_stream_close(got["captures"][index], want, f"graph vs eager, request {index}")
    weights = torch.from_numpy(PROBE.weights)
    assert_scores_close(got["scores"], eager_reference["scores"], weights, eager_reference["captures"][3][0], "graph vs eager scores")
    stream = got["captures"][3][0].float()
    expected = stream @ weights + PROBE.bias  # the probe on the host
    assert_scores_close(got["scores"], expected, weights, stream, "graph scores vs the host projection")


@pytest.mark.parametrize(
    "extra, message",
    [
        ({"output_residual_stream": [0]}, r"layers \[0\] are not tapped"),
        ({"apply_steering_vectors": [SteeringVector(activations=VECTOR, layer_indices=[3])]}, r"layers \[3\] are not tapped"),
        (
            {"apply_steering_vectors": [SteeringVector(activations=VECTOR, layer_indices=[1], norm_match=True)]},
            "norm_match steering needs eager mode",
        ),
    ],
)
def test_requests_that_need_eager_mode_are_refused_alone(graph_llm, extra, message) -> None:
    with pytest.raises(ValueError, match=message):
        graph_llm.generate([PROMPTS[1]], greedy(4, **extra), use_tqdm=False)
    after = graph_llm.generate([PROMPTS[1]], greedy(4, output_residual_stream=[1]), use_tqdm=False)[0]
    assert capture(after).shape == (1, len(after.prompt_token_ids) + 3, HIDDEN)


def test_layer_spec_parsing() -> None:
    assert parse_layer_spec("all") == "all" and resolve_layers("all", 4) == [0, 1, 2, 3]
    assert parse_layer_spec(" 2,1 ,2") == [1, 2] and parse_layer_spec("0") == [0]
    assert parse_layer_spec(None) is None and parse_layer_spec("off") is None
    with pytest.raises(ValueError, match="comma-separated"):
        parse_layer_spec("1;2")
    with pytest.raises(ValueError, match="out of range"):
        resolve_layers([7], 4)
