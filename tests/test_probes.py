"""Linear probes on the worker (tiny Llama): scores equal the capture of the same request
projected on the host, across prefill chunks and decode, with steering; a mixed batch equals
each request alone; bad probes are clear errors and the engine goes on."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lens_evals import LinearProbe, SteeringVector
from tests.conftest import capture, engine_tolerance, greedy, make_llm

HIDDEN = 128
LONG_PROMPT = " ".join(f"the probe reads {n} small data." for n in range(10))  # > 2 chunks of 32
PROMPTS = [LONG_PROMPT, "the cat reads a book.", "a model finds the truth.", "1 2 3 4 5 6 7 8", "my friend", "the truth"]
TOL = engine_tolerance()
# float32 dot products of 128 values, scores up to 69 in magnitude: measured max |diff| 1.9e-5
# against the host projection of the same request's capture (CPU, 2026-12-02)
SCORE_TOL = 1e-4 if TOL <= 1e-4 else TOL


def probe(name: str, layer: int, seed: int, bias: float = 0.0) -> LinearProbe:
    weights = np.random.default_rng(seed).normal(size=HIDDEN).astype(np.float32)
    return LinearProbe(name=name, layer=layer, weights=weights, bias=bias)


PROBES = [probe("honest", 1, 1, bias=0.5), probe("deceptive", 1, 2, bias=-2.0), probe("late", 3, 3), probe("first", 0, 4)]
SHARED = probe("shared", 2, 5, bias=0.25)  # the same probe in several requests of one step
STEER = SteeringVector(activations=np.random.default_rng(6).normal(size=(1, HIDDEN)).astype(np.float32), layer_indices=[0], scale=4.0)


def scores(output) -> dict[str, torch.Tensor]:
    assert output.activations is not None and "probe_scores" in output.activations, "no probe scores attached"
    return output.activations["probe_scores"]


def expected_scores(output, capture_layers: list[int], probes: list[LinearProbe]) -> dict[str, torch.Tensor]:
    stream = capture(output)
    return {
        p.name: stream[capture_layers.index(p.layer)] @ torch.from_numpy(p.weights) + p.bias
        for p in probes
    }


@pytest.fixture(scope="module")
def llm(tiny_path):
    with make_llm(tiny_path, max_num_batched_tokens=32, enable_chunked_prefill=True) as engine:
        yield engine


@pytest.mark.parametrize("steer", [False, True])
def test_scores_equal_capture_projected_on_the_host(llm, steer: bool) -> None:
    layers = [0, 1, 3]
    extra = {"output_residual_stream": layers, "output_probe_scores": PROBES[:3] + [PROBES[3].to_json()]}
    if steer:
        extra["apply_steering_vectors"] = [STEER]
    out = llm.generate([LONG_PROMPT], greedy(8, **extra))[0]
    n_tokens = len(out.prompt_token_ids) + 7
    assert len(out.prompt_token_ids) > 2 * 32  # prefill spans several chunks
    got = scores(out)
    assert list(got) == [p.name for p in PROBES]
    for name, reference in expected_scores(out, layers, PROBES).items():
        assert got[name].dtype == torch.float32 and got[name].shape == (n_tokens,)
        torch.testing.assert_close(got[name], reference, atol=SCORE_TOL, rtol=SCORE_TOL)
    assert (got["honest"] - got["deceptive"]).abs().max() > 1.0  # different probes, different scores


def test_steered_scores_differ_and_probes_alone_match_with_capture(llm) -> None:
    alone = llm.generate([PROMPTS[1]], greedy(6, output_probe_scores=PROBES))[0]
    assert set(alone.activations) == {"probe_scores"}  # only scores leave the worker
    with_capture = llm.generate([PROMPTS[1]], greedy(6, output_probe_scores=PROBES, output_residual_stream=[1]))[0]
    steered = llm.generate([PROMPTS[1]], greedy(6, output_probe_scores=PROBES, apply_steering_vectors=[STEER]))[0]
    for p in PROBES:
        torch.testing.assert_close(scores(alone)[p.name], scores(with_capture)[p.name], atol=TOL, rtol=TOL)
    assert (scores(steered)["late"] - scores(alone)["late"]).abs().max() > 1.0


def mixed_params(i: int):
    kind = i % 5
    if kind == 0:
        return greedy(6, output_probe_scores=[PROBES[i % 4], SHARED])
    if kind == 1:
        return greedy(6, output_residual_stream=[1, 2])
    if kind == 2:
        return greedy(6)
    if kind == 3:
        return greedy(6, output_probe_scores=[SHARED, PROBES[1]], output_residual_stream=[2], apply_steering_vectors=[STEER])
    return greedy(6, output_probe_scores=[SHARED])


def test_mixed_batch_equals_each_request_alone(llm) -> None:
    prompts = PROMPTS + PROMPTS[1:5]
    together = llm.generate(prompts, [mixed_params(i) for i in range(len(prompts))])
    for i, prompt in enumerate(prompts):
        alone = llm.generate([prompt], mixed_params(i))[0]
        assert together[i].outputs[0].token_ids == alone.outputs[0].token_ids, f"request {i} tokens differ"
        kind = i % 5
        if kind == 2:
            assert getattr(together[i], "activations", None) in (None, {})
            continue
        if kind in (1, 3):
            torch.testing.assert_close(capture(together[i]), capture(alone), atol=TOL, rtol=TOL)
        if kind != 1:
            assert list(scores(together[i])) == list(scores(alone))
            for name, value in scores(alone).items():
                torch.testing.assert_close(scores(together[i])[name], value, atol=SCORE_TOL, rtol=SCORE_TOL)
        else:
            assert "probe_scores" not in together[i].activations


@pytest.mark.parametrize(
    "probes, message",
    [
        ([LinearProbe(name="p", layer=0, weights=np.ones(64))], "weights length 64 does not match the model's hidden size 128"),
        ([LinearProbe(name="p", layer=4, weights=np.ones(HIDDEN))], "layer 4 out of range"),
        ([{"name": "p", "layer": 0, "weights": [float("nan")] * HIDDEN}], "NaN or inf"),
        ([PROBES[0], probe("honest", 2, 9)], "unique per request"),
        (["{broken"], "not valid JSON"),
        ([{"name": "p", "layer": 0, "weights": [1.0] * HIDDEN, "code": "x"}], "unknown probe fields"),
        ([{"name": "", "layer": 0, "weights": [1.0] * HIDDEN}], "name must not be empty"),
        ("not a list", "not valid JSON"),
    ],
)
def test_bad_probes_are_clear_errors_and_the_engine_goes_on(llm, probes, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        llm.generate([PROMPTS[1]], greedy(4, output_probe_scores=probes))
    good = llm.generate([PROMPTS[1]], greedy(4, output_probe_scores=[PROBES[0]]))[0]
    assert scores(good)["honest"].shape == (len(good.prompt_token_ids) + 3,)
