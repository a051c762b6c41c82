"""The built-in hooks' cost is bounded: ``add`` / ``patch`` are vectorised and equal the per-row
loop they replace, ``logit_lens`` converts the weights to float32 once per worker, and their args
are bounded at admission (the HTTP 400 / offline ValueError cases are in
tests/engine/test_hardening_inputs.py's table); on the tiny Llama ``add`` at positions equals a steering
vector at the same positions and ``patch`` puts states back."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from lens_evals import SteeringVector
from lens_evals.request import hook_library
from lens_evals.request.hooks import Hook
from tests.conftest import TINY_PROMPTS, capture, greedy
from tests.tolerance import assert_stream_close

HIDDEN = 128


def loop_add(positions: list[int], hidden: torch.Tensor, wanted: list[int], vector: torch.Tensor, scale: float) -> torch.Tensor:
    """The reference: each row whose position is wanted gets scale x its vector, row by row."""
    out = hidden.clone()
    for row in range(hidden.shape[0]):
        if positions[row] in wanted:
            delta = vector if vector.dim() == 1 else vector[wanted.index(positions[row])]
            out[row] = out[row] + scale * delta
    return out


def loop_patch(positions: list[int], hidden: torch.Tensor, wanted: list[int], values: torch.Tensor) -> torch.Tensor:
    out = hidden.clone()
    for row in range(hidden.shape[0]):
        if positions[row] in wanted:
            out[row] = values[wanted.index(positions[row])]
    return out


def context(positions: list[int], args: dict[str, Any]) -> Any:
    return SimpleNamespace(positions=torch.tensor(positions), args=args)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seed", range(6))
def test_add_and_patch_equal_the_per_row_loop(dtype: torch.dtype, seed: int) -> None:
    """Random rows (positions repeated among them, some wanted, some not) and random wanted
    positions in random order (some matching no row): bit-equal to the loop."""
    rng = np.random.default_rng(seed)
    rows = int(rng.integers(1, 64))
    positions = rng.integers(0, 40, size=rows).tolist()  # duplicates among the rows' positions
    wanted = rng.permutation(50)[: int(rng.integers(1, 30))].tolist()
    hidden = torch.from_numpy(rng.normal(size=(rows, 16)).astype(np.float32)).to(dtype)
    per_position = torch.from_numpy(rng.normal(size=(len(wanted), 16)).astype(np.float32))
    one = torch.from_numpy(rng.normal(size=16).astype(np.float32))
    scale = float(rng.normal() * 3)
    for vector in (per_position, one):
        got = hook_library.add(context(positions, {"vector": vector, "positions": wanted, "scale": scale}), hidden)
        expected = loop_add(positions, hidden, wanted, vector.to(dtype), scale)
        torch.testing.assert_close(hidden if got is None else got, expected, atol=0, rtol=0)
    got = hook_library.patch(context(positions, {"values": per_position, "positions": wanted}), hidden)
    torch.testing.assert_close(
        hidden if got is None else got, loop_patch(positions, hidden, wanted, per_position.to(dtype)), atol=0, rtol=0
    )


def test_a_module_hook_is_bounded_by_positions_not_by_the_hidden_size() -> None:
    """A ``module`` hook sees the module's rows (e.g. MLP neurons): their width is not the
    model's hidden size, so only its positions and structure are checked."""
    from lens_evals.request.hooks import HookBounds, check_hook_args

    check_hook_args(Hook("ablate", [0], pre=True, module="mlp.down_proj", args={"indices": [300]}), HIDDEN, 10, 512)
    with pytest.raises(ValueError, match="index 300 out of range: the rows have 128 columns"):
        check_hook_args(Hook("ablate", [0], args={"indices": [300]}), HIDDEN, 10, 512)
    with pytest.raises(ValueError, match=r"position 10 out of range: this request has at most 10 positions \(0..9\)"):
        check_hook_args(Hook("add", [0], module="mlp", args={"vector": [1.0] * 300, "positions": [10]}), HIDDEN, 10, 512)
    bounds = HookBounds(None, 10, 512)
    assert hook_library.check_rows("vector", [[1.0] * 300] * 2, bounds, 2).shape == (2, 300)


class CopyCounter(TorchDispatchMode):
    """Counts the ops that make a float32 tensor of ``shape`` from another dtype."""

    def __init__(self, shape: tuple[int, ...]) -> None:
        super().__init__()
        self.shape, self.count = shape, 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        source = args[0] if args and isinstance(args[0], torch.Tensor) else None
        converted = source is not None and source.dtype != torch.float32 and isinstance(out, torch.Tensor)
        if converted and out.dtype == torch.float32 and tuple(out.shape) == self.shape:
            self.count += 1
        return out


def test_logit_lens_converts_the_weights_once() -> None:
    """bfloat16 weights: two calls (two layers or steps) make one float32 copy of the unembedding,
    and the same log-probabilities, equal to the hand-computed float64 read-out; a weight updated
    in place gets a fresh copy."""
    generator = torch.Generator().manual_seed(0)
    head = torch.randn(512, 64, generator=generator).to(torch.bfloat16)
    norm = (1 + 0.1 * torch.randn(64, generator=generator)).to(torch.bfloat16)
    rows = torch.randn(5, 64, generator=generator)
    parameters = {"model.norm.weight": norm, "lm_head.weight": head}

    def call(layer: int, saved: dict[str, Any]) -> None:
        ctx = SimpleNamespace(
            args={"top_k": 3, "token_ids": [7, 300]},
            positions=torch.arange(5),
            layer_idx=layer,
            saved=saved,
            hf_config=SimpleNamespace(rms_norm_eps=1e-6),
            get_parameter=parameters.__getitem__,
        )
        hook_library.logit_lens(ctx, rows)

    saved: dict[str, Any] = {}
    with CopyCounter(tuple(head.shape)) as counter:
        call(1, saved)
        call(2, saved)
    assert counter.count == 1
    assert hook_library.float32_weight(head) is hook_library.float32_weight(head)
    wide = rows.double()
    normed = wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + 1e-6) * norm.double()
    expected = torch.log_softmax(normed @ head.double().T, dim=-1)
    for layer in (1, 2):
        torch.testing.assert_close(saved[f"token_logprobs.{layer}"].double(), expected[:, [7, 300]], atol=1e-4, rtol=0)
        assert saved[f"top_ids.{layer}"].tolist() == expected.topk(3, dim=-1).indices.tolist()
    assert torch.equal(saved["top_logprobs.1"], saved["top_logprobs.2"])
    head.mul_(2)
    assert torch.equal(hook_library.float32_weight(head), head.float())


def test_add_at_positions_equals_steering_and_patch_restores_states(llm) -> None:
    """On the engine, over prefill and decode steps: ``add`` of one vector per position equals
    the steering vector at the same positions; ``patch`` of that run's layer-1 states at every
    position into a plain run makes its later layers (and tokens) those of the steered run."""
    prompt = TINY_PROMPTS[2]
    n_prompt = len(llm.get_tokenizer()(prompt).input_ids)
    positions = [1, n_prompt - 1, n_prompt + 1]  # in the prompt, its last token, a generated one
    vectors = np.random.default_rng(0).normal(size=(len(positions), HIDDEN)).astype(np.float32)
    hook = Hook("add", [1], args={"vector": vectors, "positions": positions, "scale": 2.0})
    steering = SteeringVector(activations=vectors[None], layer_indices=[1], scale=2.0, position_indices=positions)
    added, steered = llm.generate(
        [prompt, prompt],
        [
            greedy(4, output_residual_stream=[1, 3], apply_hooks=[hook]),
            greedy(4, output_residual_stream=[1, 3], apply_steering_vectors=[steering]),
        ],
    )
    assert added.outputs[0].token_ids == steered.outputs[0].token_ids
    assert_stream_close(capture(added), capture(steered), "add at positions vs steering at positions")
    states = capture(added)[0].numpy()  # layer 1, every position the model saw
    every = list(range(states.shape[0]))
    patched = llm.generate(
        [prompt], greedy(4, output_residual_stream=[3], apply_hooks=[Hook("patch", [1], args={"positions": every, "values": states})])
    )[0]
    assert patched.outputs[0].token_ids == added.outputs[0].token_ids
    assert_stream_close(capture(patched)[0], capture(added)[1], "patched with the added run's states vs that run")


def test_a_hook_set_is_bounded_by_the_context_length(llm) -> None:
    from lens_evals import register_hook_set

    with pytest.raises(ValueError, match="100000 positions, more than the 1024"):
        register_hook_set(llm, [Hook("record", [1], args={"positions": list(range(100_000))})])
    with pytest.raises(ValueError, match="vector must be"):
        register_hook_set(llm, [Hook("add", [1], args={"vector": [1.0] * 64})])
    hook_set = register_hook_set(llm, [Hook("record", [1], args={"positions": [0, 1023]})])
    try:
        out = llm.generate([TINY_PROMPTS[0]], greedy(3, **hook_set.extra_args))[0]
        assert out.outputs[0].token_ids
        (result,) = hook_set.collect()["results"]
        assert result["saved"]["positions.1"].tolist() == [0]
    finally:
        hook_set.clear()
