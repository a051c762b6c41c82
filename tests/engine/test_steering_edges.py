"""Steering edge cases a researcher hits, on the tiny Llama. References: HF transformers on the
same weights with the same additions by a forward hook (tests/hf_reference.py), and each
request run alone on the engine."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lens_evals import SteeringVector
from tests.conftest import TINY_PROMPTS, capture, greedy, make_llm
from tests.hf_reference import HFReference
from tests.tolerance import assert_stream_close

HIDDEN = 128
LAYERS = [1, 3]


@pytest.fixture(scope="module")
def hf(tiny_path):
    return HFReference(tiny_path)


def tokens_of(out) -> list[int]:
    return list(out.prompt_token_ids) + list(out.outputs[0].token_ids)


def test_a_2d_vector_at_positions_is_added_at_each_position(llm, hf) -> None:
    """A (n_layers, hidden) vector with ``position_indices`` (the ``steer`` solver's ``(hidden,)``
    vector with positions) is that vector at each position. Before: the worker indexed a
    per-position table of one row with two positions, the IndexError came out of
    ``llm.generate`` for the whole batch and the engine hung on the next call."""
    acts = np.random.default_rng(21).normal(size=(1, HIDDEN)).astype(np.float32)
    positions = [5, 2]
    vec = SteeringVector(activations=acts, layer_indices=[1], scale=4.0, position_indices=positions)
    plain = greedy(4, output_residual_stream=LAYERS)
    steered, neighbour = llm.generate(TINY_PROMPTS[:2], [greedy(4, output_residual_stream=LAYERS, apply_steering_vectors=[vec]), plain])
    added = torch.from_numpy(acts[0] * 4.0)
    reference = hf.residual_stream(tokens_of(steered)[:-1], LAYERS, additions={1: {p: added for p in positions}})
    assert_stream_close(capture(steered), reference, "2-D vector at positions [5, 2] vs HF with the same additions")
    alone = llm.generate([TINY_PROMPTS[1]], plain)[0]
    assert neighbour.outputs[0].token_ids == alone.outputs[0].token_ids
    assert_stream_close(capture(neighbour), capture(alone), "unsteered neighbour vs alone")


@pytest.mark.parametrize("magnitude", [1e20, 1e-25])
def test_norm_match_uses_the_direction_whatever_the_vector_norm(llm, magnitude: float) -> None:
    """With ``norm_match`` only v's direction counts: v * 1e20 and v * 1e-25 steer as v does.
    Before: ||v|| was taken in float32, whose squares overflow past ~1e19 (v / inf = 0: the
    request ran unsteered, change 0.0 against 0.5 * ||h|| ~ 5.9) and underflow below ~1e-19
    (a valid direction refused as a zero vector)."""
    unit = np.random.default_rng(22).normal(size=(1, HIDDEN)).astype(np.float32)

    def steered(acts: np.ndarray):
        vec = SteeringVector(activations=acts, layer_indices=[1], scale=0.5, norm_match=True)
        return llm.generate([TINY_PROMPTS[0]], greedy(3, output_residual_stream=LAYERS, apply_steering_vectors=[vec]))[0]

    reference = steered(unit)
    out = steered(unit * np.float32(magnitude))
    assert out.outputs[0].token_ids == reference.outputs[0].token_ids
    assert_stream_close(capture(out), capture(reference), f"norm-matched v * {magnitude:g} vs v")


@pytest.mark.parametrize("source", ["numpy", "torch"])
def test_a_vector_keeps_its_values_when_the_caller_reuses_the_array(llm, source: str) -> None:
    """A sweep that refills one buffer (or normalises a tensor in place) after building each
    request's vector: every request steers with the values it was built with. Before: a float32
    array or tensor was held without a copy, so all requests steered with the buffer's last
    values (request 0 got request 1's tokens)."""
    rng = np.random.default_rng(23)
    values = [rng.normal(size=(1, HIDDEN)).astype(np.float32) * 3 for _ in range(2)]
    buffer = np.zeros((1, HIDDEN), dtype=np.float32)
    held = buffer if source == "numpy" else torch.from_numpy(buffer)
    params = []
    for value in values:
        buffer[:] = value
        vec = SteeringVector(activations=held, layer_indices=[1], scale=2.0)
        params.append(greedy(4, output_residual_stream=LAYERS, apply_steering_vectors=[vec]))
    buffer[:] = np.nan  # what the caller does with its buffer afterwards is its own business
    got = llm.generate(TINY_PROMPTS[:2], params)
    for i, value in enumerate(values):
        own = SteeringVector(activations=value.copy(), layer_indices=[1], scale=2.0)
        alone = llm.generate([TINY_PROMPTS[i]], greedy(4, output_residual_stream=LAYERS, apply_steering_vectors=[own]))[0]
        assert got[i].outputs[0].token_ids == alone.outputs[0].token_ids, f"request {i} steered with other values"
        assert_stream_close(capture(got[i]), capture(alone), f"request {i} vs its own vector alone")


def test_a_vector_changed_in_place_after_a_request_is_a_new_vector(llm, hf) -> None:
    """The frontend encodes a vector once and each worker decodes it once per content (issue #47):
    the same object, changed in place after a first request, steers the next request with its
    new values. Reference: HF with each request's own additions at every position."""
    acts = np.random.default_rng(25).normal(size=(1, HIDDEN)).astype(np.float32)
    vec = SteeringVector(activations=acts, layer_indices=[1], scale=2.0)
    params = greedy(3, output_residual_stream=LAYERS, apply_steering_vectors=[vec])
    first = llm.generate([TINY_PROMPTS[0]], params)[0]
    vec.activations.mul_(-1.5)  # ``activations`` is a torch tensor the caller may change
    second = llm.generate([TINY_PROMPTS[0]], params)[0]
    for out, values, what in ((first, acts, "first"), (second, acts * -1.5, "after the change")):
        tokens = tokens_of(out)[:-1]
        added = torch.from_numpy(values[0] * 2.0)
        reference = hf.residual_stream(tokens, LAYERS, additions={1: {p: added for p in range(len(tokens))}})
        assert_stream_close(capture(out), reference, f"vector {what} vs HF with its values added")


@pytest.mark.parametrize("make", [np.asarray, torch.tensor], ids=["numpy", "torch"])
def test_complex_activations_with_imaginary_parts_are_refused(make) -> None:
    """np.linalg.eig of a non-symmetric matrix gives complex eigenvectors: a vector with non-zero
    imaginary parts is refused with the reason (before: accepted, the imaginary part dropped with
    a warning only); all-zero imaginary parts are the real vector."""
    real = np.random.default_rng(24).normal(size=(1, HIDDEN))
    with pytest.raises(ValueError, match="imaginary"):
        SteeringVector(activations=make(real + 0.5j), layer_indices=[1])
    vec = SteeringVector(activations=make(real + 0j), layer_indices=[1])
    np.testing.assert_array_equal(vec.array, real.astype(np.float32))


def test_a_vector_failing_on_the_worker_fails_its_request_only(llm, monkeypatch) -> None:
    """An error while the worker puts a vector on the device (here a simulated out-of-memory
    RuntimeError) fails that request with the reason; its neighbour completes and the engine
    serves the next call. Before: only ValueError and four other types were caught, the
    RuntimeError came out of ``llm.generate`` for the whole batch and the next call hung."""
    from lens_evals.engine.frontend.attach import LensRequestError
    from lens_evals.engine.worker import requests as worker_requests

    real = worker_requests._decode_steering

    def out_of_memory(vec, device, dtype):
        if vec.scale == 7.0:
            raise RuntimeError("device out of memory (simulated)")
        return real(vec, device, dtype)

    monkeypatch.setattr(worker_requests, "_decode_steering", out_of_memory)
    bad = SteeringVector(activations=np.ones((1, HIDDEN), dtype=np.float32), layer_indices=[1], scale=7.0)
    with pytest.raises(LensRequestError, match="could not decode.*RuntimeError: device out of memory") as info:
        llm.generate(TINY_PROMPTS[:2], [greedy(4, apply_steering_vectors=[bad]), greedy(4)])
    assert len(info.value.outputs[1].outputs[0].token_ids) == 4
    monkeypatch.undo()
    plain = llm.generate([TINY_PROMPTS[1]], greedy(4, output_residual_stream=LAYERS))[0]
    assert capture(plain).shape[:2] == (len(LAYERS), len(plain.prompt_token_ids) + 3)


def test_a_bf16_engine_steers_by_the_scale_asked_not_its_bf16_rounding(tiny_path) -> None:
    """Scales 4.0, 4.01 and 4.02 (bf16, spacing 1/32 at 4, rounds them to 4.0, 4.0 and 4.03125)
    steer by 4.0, 4.01 and 4.02: the step h' - h at the steered layer, projected on v and averaged
    over the prompt tokens (bf16 noise: 4.0 measured as 4.0004). Before: the scale was rounded to
    bf16 first (4.01 measured 4.0004, a sweep over close scales got identical runs)."""
    v = np.random.default_rng(25).normal(size=(1, HIDDEN)).astype(np.float32)
    with make_llm(tiny_path, dtype="bfloat16") as engine:
        base = capture(engine.generate([TINY_PROMPTS[0]], greedy(1, output_residual_stream=[1]))[0])[0].float()
        for scale in (4.0, 4.01, 4.02):
            vec = SteeringVector(activations=v, layer_indices=[1], scale=scale)
            out = engine.generate([TINY_PROMPTS[0]], greedy(1, output_residual_stream=[1], apply_steering_vectors=[vec]))[0]
            step = capture(out)[0].float() - base
            unit = torch.from_numpy(v[0]).to(torch.bfloat16).float()
            got = float((step @ unit).mean() / (unit @ unit))
            rounded = float(torch.tensor(scale).to(torch.bfloat16))
            # bf16 noise of the projection: 4e-4 on one machine, 3.6e-3 on another (its CPU's
            # bf16 kernels); the scale rounded to bf16 first would be 1e-2 off at 4.01 and 4.02
            assert abs(got - scale) < 5e-3, f"scale {scale}: the stream moved by {got:.5f} v"
            if rounded != scale:
                assert abs(got - scale) < abs(got - rounded), f"scale {scale}: moved {got:.5f} v, nearer its bf16 rounding {rounded}"
