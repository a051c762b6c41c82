"""Absolute positions: chunked prefill, steering at a position in a later prefill chunk and in
decode (against HF with the same addition), and preemption under a tiny KV cache."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lens_evals import SteeringVector
from lens_evals.engine.worker.requests import WorkerLensRequest
from lens_evals.request.hook_library import append_rows
from lens_evals.request.hooks import Hook
from tests.conftest import capture, greedy, make_llm, on_gpu
from tests.hf_reference import HFReference
from tests.tolerance import assert_stream_close, stream_bound

LONG_PROMPT = " ".join(f"the probe reads {n} small data." for n in range(12))  # > 3 chunks of 16
LAYERS = [0, 1, 2, 3]
STEER_LAYER = 1
MAX_TOKENS = 6


def record_positions(ctx, hidden) -> None:
    append_rows(ctx.saved, "positions", ctx.positions)


@pytest.fixture(scope="module")
def unchunked(tiny_path):
    with make_llm(tiny_path) as llm:
        yield llm.generate([LONG_PROMPT], greedy(MAX_TOKENS, output_residual_stream=LAYERS))[0]


@pytest.fixture(scope="module")
def chunked_engine(tiny_path):
    with make_llm(tiny_path, max_num_batched_tokens=16, enable_chunked_prefill=True) as llm:
        yield llm


def test_chunked_prefill_equals_unchunked(chunked_engine, unchunked) -> None:
    out = chunked_engine.generate([LONG_PROMPT], greedy(MAX_TOKENS, output_residual_stream=LAYERS))[0]
    assert len(out.prompt_token_ids) > 3 * 16
    assert out.outputs[0].token_ids == unchunked.outputs[0].token_ids
    assert_stream_close(capture(out), capture(unchunked), "chunked vs unchunked prefill")


def test_position_steering_in_later_chunk_and_decode_matches_hf(tiny_path, chunked_engine) -> None:
    prompt_len = len(chunked_engine.get_tokenizer()(LONG_PROMPT).input_ids)
    positions = [3, 37, prompt_len + 2]  # first chunk, third chunk, a decode step
    rng = np.random.default_rng(11)
    acts = rng.normal(size=(1, len(positions), 128)).astype(np.float32)
    vec = SteeringVector(activations=acts, layer_indices=[STEER_LAYER], scale=4.0, position_indices=positions)
    out = chunked_engine.generate([LONG_PROMPT], greedy(MAX_TOKENS, output_residual_stream=LAYERS, apply_steering_vectors=[vec]))[0]
    tokens = list(out.prompt_token_ids) + list(out.outputs[0].token_ids)
    additions = {STEER_LAYER: {p: torch.from_numpy(acts[0, i] * 4.0) for i, p in enumerate(positions)}}
    hf = HFReference(tiny_path)
    reference = hf.residual_stream(tokens[:-1], LAYERS, additions=additions)
    got = capture(out)
    assert_stream_close(got, reference, "position-steered capture vs HF with the same additions")
    # and the steering acted at exactly those positions: at the steered layer the stream moves by
    # the addition there (norm ~45) and elsewhere only by the numeric noise, at most
    # stream_bound() * ||h_t|| (below 0.5 on the GPU, ~2e-3 on CPU): a threshold of half the
    # smallest addition separates the two on every backend.
    plain = hf.residual_stream(tokens[:-1], [STEER_LAYER])[0]
    added = min(float(addition.norm()) for addition in additions[STEER_LAYER].values())
    noise = stream_bound() * float(plain.norm(dim=-1).max())
    assert added > 10 * noise, f"additions of norm {added:.3g} do not stand out of the noise {noise:.3g}"
    change = (got[STEER_LAYER] - plain).norm(dim=-1)
    moved = (change > added / 2).nonzero().flatten().tolist()
    assert moved == positions, (
        f"stream moved at {moved}, steered at {positions}; largest change elsewhere "
        f"{float(change[[p for p in range(len(change)) if p not in positions]].max()):.3g}"
    )


def test_preemption_recompute_places_rows_by_position(tiny_path) -> None:
    """A KV cache of 384 tokens for 6 requests of ~150 tokens forces preemption and recompute;
    a hook's ``saved`` is as if each request ran alone (each position seen once, in order)."""
    prompts = [LONG_PROMPT[i * 7 :] for i in range(6)]
    block_size = 16 if on_gpu() else 128  # vLLM's default KV block size per platform
    with make_llm(
        tiny_path,
        num_gpu_blocks_override=384 // block_size,
        block_size=block_size,
        max_model_len=256,
        max_num_seqs=6,
        disable_log_stats=False,
    ) as llm:
        hooks = [Hook(record_positions, [3])]
        outs = llm.generate(prompts, greedy(60, output_residual_stream=[0, 3], apply_hooks=hooks))
        preemptions = sum(m.value for m in llm.get_metrics() if m.name == "vllm:num_preemptions")
    assert preemptions > 0, "the test did not cause preemption"
    hf = HFReference(tiny_path)
    for out in outs:
        tokens = list(out.prompt_token_ids) + list(out.outputs[0].token_ids)
        got = capture(out)
        assert got.shape[1] == len(tokens) - 1
        seen = out.hook_results["0"]["positions"].tolist()
        assert seen == list(range(len(tokens) - 1)), f"request {out.request_id}: the hook saw {len(seen)} rows"
        assert_stream_close(got, hf.residual_stream(tokens[:-1], [0, 3]), f"request {out.request_id} after preemption vs HF")


def test_a_recompute_restarts_hooks_from_position_0_only() -> None:
    """Recompute from 0 empties ``saved``; from a later position (prefix KV read back) the
    hooks would see positions twice: an error, not a silent duplicate."""
    req = WorkerLensRequest("k", [], saved={"0": {"rows": 1}}, set_saved={"0": {"rows": 2}})
    assert req.hook_rows(0, 16) is None and req.hook_rows(16, 4) is None and req.saved
    assert req.hook_rows(0, 16) is None
    assert req.saved == {} and req.set_saved == {}
    req.hook_rows(16, 8)
    error = req.hook_rows(16, 8)
    assert error is not None and "from position 16" in error and "below 24" in error
