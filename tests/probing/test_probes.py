"""Linear probes on the worker (tiny Llama): scores equal the capture of the same request
projected on the host, across prefill chunks and decode, with steering; a mixed batch equals
each request alone; bad probes are clear errors and the engine goes on."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lens_evals import LinearProbe, SteeringVector
from tests.conftest import capture, greedy, make_llm
from tests.tolerance import assert_scores_close, assert_stream_close

HIDDEN = 128
LONG_PROMPT = " ".join(f"the probe reads {n} small data." for n in range(10))  # > 2 chunks of 32
PROMPTS = [LONG_PROMPT, "the cat reads a book.", "a model finds the truth.", "1 2 3 4 5 6 7 8", "my friend", "the truth"]
ALL_LAYERS = [0, 1, 2, 3]


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
    return {p.name: stream[capture_layers.index(p.layer)] @ torch.from_numpy(p.weights) + p.bias for p in probes}


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
    reference = expected_scores(out, layers, PROBES)
    for p in PROBES:
        assert got[p.name].dtype == torch.float32 and got[p.name].shape == (n_tokens,)
        # the worker's scores and the capture are the same request's rows: only rounding between them
        rows = capture(out)[layers.index(p.layer)]
        ratio = assert_scores_close(got[p.name], reference[p.name], torch.from_numpy(p.weights), rows, p.name, same_rows=True, bias=p.bias)
        print(f"{p.name}: largest |score - host projection| is {ratio:.3f} of its bound")
    assert (got["honest"] - got["deceptive"]).abs().max() > 1.0  # different probes, different scores


def test_steered_scores_differ_and_probes_alone_match_with_capture(llm) -> None:
    alone = llm.generate([PROMPTS[1]], greedy(6, output_probe_scores=PROBES))[0]
    assert set(alone.activations) == {"probe_scores"}  # only scores leave the worker
    with_capture = llm.generate([PROMPTS[1]], greedy(6, output_probe_scores=PROBES, output_residual_stream=ALL_LAYERS))[0]
    steered = llm.generate([PROMPTS[1]], greedy(6, output_probe_scores=PROBES, apply_steering_vectors=[STEER]))[0]
    for p in PROBES:
        assert_scores_close(
            scores(alone)[p.name],
            scores(with_capture)[p.name],
            torch.from_numpy(p.weights),
            capture(with_capture)[p.layer],
            f"{p.name} alone vs with capture",
        )
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


def with_all_layers(params):
    extra = dict(params.extra_args)
    extra["output_residual_stream"] = ALL_LAYERS
    return greedy(params.max_tokens, **extra)


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
            assert_stream_close(capture(together[i]), capture(alone), f"request {i} in the batch vs alone")
        if kind != 1:
            assert list(scores(together[i])) == list(scores(alone))
            # the same request capturing every layer: the reference rows that size the score bound
            rows = capture(llm.generate([prompt], with_all_layers(mixed_params(i)))[0])
            for p in {**{p.name: p for p in PROBES}, SHARED.name: SHARED}.values():
                if p.name in scores(alone):
                    assert_scores_close(
                        scores(together[i])[p.name],
                        scores(alone)[p.name],
                        torch.from_numpy(p.weights),
                        rows[p.layer],
                        f"request {i} {p.name} in the batch vs alone",
                    )
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
