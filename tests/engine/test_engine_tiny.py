"""Capture and steering on the tiny Llama: batch invariance, steering semantics, prefix
caching, bad input. References: each request run alone, and hand-computed invariants."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lens_evals import SteeringVector
from tests.conftest import TINY_PROMPTS, capture, greedy, on_gpu
from tests.tolerance import assert_stream_close, stream_bound

PROMPTS = TINY_PROMPTS
HIDDEN = 128


def vector(seed: int, layers: list[int], scale: float = 2.0, **kw) -> SteeringVector:
    acts = np.random.default_rng(seed).normal(size=(len(layers), HIDDEN)).astype(np.float32)
    return SteeringVector(activations=acts, layer_indices=layers, scale=scale, **kw)


def mixed_params(i: int):
    """Request i of the mixed batch: plain, capture, steer, or both; 6, 6, 5, 5, ... 3 tokens
    (so the batch's requests finish at different steps)."""
    kind, tokens = i % 4, 6 - i // 2
    if kind == 0:
        return greedy(tokens)
    if kind == 1:
        return greedy(tokens, output_residual_stream=[i % 4, 3])
    if kind == 2:
        return greedy(tokens, apply_steering_vectors=[vector(i, [1])])
    return greedy(tokens, output_residual_stream=[0, 2], apply_steering_vectors=[vector(i, [2], norm_match=True, scale=0.5)])


def test_mixed_batch_equals_each_request_alone(llm) -> None:
    """In the batch, the capture requests that finish before the last step (3, 5 and 7) have
    their rows written while the others still run (``early_write``: inline bytes, the frontend
    being in this process); alone, each finishes at the last step and is written at the fetch."""
    from lens_evals.engine.transport.protocol import MEMORY_METHOD

    (before,) = llm.collective_rpc(MEMORY_METHOD)
    together = llm.generate(PROMPTS, [mixed_params(i) for i in range(8)])
    (after,) = llm.collective_rpc(MEMORY_METHOD)
    assert after["early_written"] - before["early_written"] == 3
    assert after["early_unfetched"] == 0 and after["held_bytes"] == 0
    for i, prompt in enumerate(PROMPTS):
        alone = llm.generate([prompt], mixed_params(i))[0]
        assert together[i].outputs[0].token_ids == alone.outputs[0].token_ids, f"request {i} tokens differ"
        if i % 4 in (1, 3):
            assert_stream_close(capture(together[i]), capture(alone), f"request {i} in the batch vs alone")
        else:
            assert getattr(together[i], "activations", None) in (None, {})


def test_scale_zero_equals_baseline(llm) -> None:
    base = llm.generate(PROMPTS[:3], greedy(8, output_residual_stream=[1, 3]))
    zero = llm.generate(PROMPTS[:3], greedy(8, output_residual_stream=[1, 3], apply_steering_vectors=[vector(1, [0, 2], scale=0.0)]))
    for n, (b, z) in enumerate(zip(base, zero)):
        assert b.outputs[0].token_ids == z.outputs[0].token_ids
        assert_stream_close(capture(z), capture(b), f"prompt {n}: scale 0 vs no steering")


def test_steering_changes_only_the_steered_request(llm) -> None:
    plain_alone = llm.generate([PROMPTS[1]], greedy(8, output_residual_stream=[3]))[0]
    steer = greedy(8, output_residual_stream=[3], apply_steering_vectors=[vector(7, [1], scale=8.0)])
    steered, neighbour = llm.generate([PROMPTS[0], PROMPTS[1]], [steer, greedy(8, output_residual_stream=[3])])
    unsteered = llm.generate([PROMPTS[0]], greedy(8, output_residual_stream=[3]))[0]
    assert steered.outputs[0].token_ids != unsteered.outputs[0].token_ids
    assert (capture(steered)[:, : len(steered.prompt_token_ids)] - capture(unsteered)[:, : len(steered.prompt_token_ids)]).abs().max() > 1.0
    assert neighbour.outputs[0].token_ids == plain_alone.outputs[0].token_ids
    assert_stream_close(capture(neighbour), capture(plain_alone), "unsteered neighbour vs alone")


@pytest.mark.parametrize("scale", [0.25, 1.5])
def test_norm_match_invariant(llm, scale: float) -> None:
    """||h' - h|| / ||h|| == scale at the steered layer, for every prompt token (h and h' come from
    two runs, so up to their per-token noise, which moves the ratio by at most (1 + scale) times it)."""
    layer = 2
    base = llm.generate(PROMPTS[:4], greedy(1, output_residual_stream=[layer]))
    steered = llm.generate(
        PROMPTS[:4], greedy(1, output_residual_stream=[layer], apply_steering_vectors=[vector(3, [layer], scale=scale, norm_match=True)])
    )
    for b, s in zip(base, steered):
        h, h2 = capture(b)[0], capture(s)[0]
        ratio = (h2 - h).norm(dim=-1) / h.norm(dim=-1)
        torch.testing.assert_close(ratio, torch.full_like(ratio, scale), atol=(1 + scale) * stream_bound(), rtol=0)


def test_plain_addition_is_exact(llm) -> None:
    layer = 1
    vec = vector(5, [layer], scale=3.0)
    base = llm.generate([PROMPTS[2]], greedy(1, output_residual_stream=[layer]))[0]
    steered = llm.generate([PROMPTS[2]], greedy(1, output_residual_stream=[layer], apply_steering_vectors=[vec]))[0]
    added = vec.activations[0] * 3.0  # a torch tensor where torch is installed
    assert_stream_close(capture(steered)[0], capture(base)[0] + added, "steered stream vs unsteered + scale * v")


def test_prefix_cache_neither_shortens_capture_nor_leaks_steered_kv(llm) -> None:
    prompt = PROMPTS[5] * 20  # 240 tokens: more than one 128-token KV block on CPU
    plain_first = llm.generate([prompt], greedy(4))[0]  # fills the prefix cache
    assert llm.generate([prompt], greedy(4))[0].num_cached_tokens > 0, "prefix cache is not active"
    captured = llm.generate([prompt], greedy(4, output_residual_stream=[0, 3]))[0]
    assert captured.num_cached_tokens == 0
    assert capture(captured).shape[1] == len(captured.prompt_token_ids) + 3
    steered = llm.generate([prompt], greedy(4, apply_steering_vectors=[vector(9, [0, 1, 2], scale=20.0)]))[0]
    assert steered.num_cached_tokens == 0
    llm.reset_prefix_cache()  # now only a steered request's KV could be cached
    llm.generate([prompt], greedy(4, apply_steering_vectors=[vector(9, [0, 1, 2], scale=20.0)]))
    plain_after = llm.generate([prompt], greedy(4))[0]
    assert plain_after.num_cached_tokens == 0, "a plain request reused KV left by a steered one"
    assert plain_after.outputs[0].token_ids == plain_first.outputs[0].token_ids
    again = llm.generate([prompt], greedy(4, output_residual_stream=[0, 3]))[0]
    assert_stream_close(capture(again), capture(captured), "capture after the steered runs vs before")


@pytest.mark.parametrize(
    "extra, message",
    [
        ({"output_residual_stream": [4]}, "out of range"),
        ({"output_residual_stream": "all"}, "string is not valid JSON"),
        ({"apply_steering_vectors": [SteeringVector(activations=np.ones((1, 64)), layer_indices=[1])]}, "hidden size 64"),
        ({"apply_steering_vectors": [{"activations": [[float("nan")] * HIDDEN], "layer_indices": [1]}]}, "NaN or inf"),
        (
            {"apply_steering_vectors": [SteeringVector(activations=np.ones((1, 1, HIDDEN)), layer_indices=[1], position_indices=[500])]},
            "position 500 out of range",
        ),
        (
            {"apply_steering_vectors": [{"activations": {"encoding": "safetensors-base64", "data": "AAAA"}, "layer_indices": [1]}]},
            "truncated",
        ),
        ({"_lens_evals": {"key": "x"}}, "reserved"),
    ],
)
def test_bad_input_is_a_clear_error_and_the_engine_goes_on(llm, extra: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        llm.generate([PROMPTS[0]], greedy(4, **extra))
    good = llm.generate([PROMPTS[0]], greedy(4, output_residual_stream=[1]))[0]
    assert capture(good).shape == (1, len(good.prompt_token_ids) + 3, HIDDEN)


def test_capture_size_cap(llm, monkeypatch) -> None:
    monkeypatch.setenv("LENS_EVALS_MAX_CAPTURE_GIB", str(1e-6))
    with pytest.raises(ValueError, match="over the per-request limit"):
        llm.generate([PROMPTS[0]], greedy(4, output_residual_stream=[0, 1, 2, 3]))


def test_step_copies_are_counted_and_overlapped_only_on_a_gpu(llm) -> None:
    """``lens_evals_copy`` (the bench's paired rounds use it): one copy per forward pass. On CPU the
    step's rows are kept as they are, nothing is pinned, and asking for the overlap changes nothing;
    on a GPU each copy goes into pinned memory on the side stream once the overlap is asked for."""
    from lens_evals.engine.transport.protocol import COPY_METHOD

    (mode,) = llm.collective_rpc(COPY_METHOD, args=(None,))
    (before,) = llm.collective_rpc(COPY_METHOD, args=(True,))
    try:
        out = llm.generate([PROMPTS[0]], greedy(4, output_residual_stream=[1]))[0]
        (after,) = llm.collective_rpc(COPY_METHOD, args=(None,))
    finally:
        llm.collective_rpc(COPY_METHOD, args=(mode["overlap"],))  # the module's engine as it was
    assert capture(out).shape == (1, len(out.prompt_token_ids) + 3, HIDDEN)
    assert after["copies"] - before["copies"] == 4  # one per forward pass: the prompt, then 3 decode steps
    if on_gpu():
        assert before["overlap"] is True and after["overlap"] is True
        assert after["overlapped"] - before["overlapped"] == 4 and after["pinned_bytes"] > 0
    else:
        assert before["overlap"] is False and after["overlap"] is False
        assert after["overlapped"] == 0 and after["pinned_bytes"] == 0
