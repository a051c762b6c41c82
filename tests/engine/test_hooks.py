"""Generic hooks on the tiny Llama: identity hooks change nothing, ablation equals HF
transformers, ``saved`` is per request in a batch, a pre-hook sees the previous layer's stream,
a failing hook fails only its request, bad hooks are clear errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lens_evals.engine.frontend.attach import LensRequestError
from lens_evals.request.hook_library import append_rows
from lens_evals.request.hooks import Hook
from tests.conftest import TINY_PROMPTS, capture, greedy
from tests.hf_reference import HFReference
from tests.tolerance import assert_stream_close, stream_bound, token_relative_error

PROMPTS = TINY_PROMPTS[:6]
ALL_LAYERS = [0, 1, 2, 3]


def count_call(ctx) -> None:
    site = f"{ctx.module_path or 'layer'}.{'pre' if ctx.pre else 'post'}"
    ctx.saved[site] = ctx.saved.get(site, 0) + 1


def same_rows(ctx, hidden):
    count_call(ctx)
    return hidden.clone()


def same_rows_in_place(ctx, hidden):
    count_call(ctx)
    hidden.mul_(1.0)
    return hidden


def look_only(ctx, hidden):
    return None


def record_rows(ctx, hidden):
    """Per request: positions, input token ids and the stream seen at each layer."""
    append_rows(ctx.saved, f"positions.{ctx.layer_idx}", ctx.positions)
    append_rows(ctx.saved, f"tokens.{ctx.layer_idx}", ctx.token_ids)
    append_rows(ctx.saved, f"rows.{ctx.layer_idx}", hidden)
    ctx.saved["calls"] = ctx.saved.get("calls", 0) + 1


def record_input(ctx, hidden):
    append_rows(ctx.saved, f"input.{ctx.layer_idx}", hidden)


def explode(ctx, hidden):
    raise RuntimeError(f"exploded at layer {ctx.layer_idx}")


def wrong_shape(ctx, hidden):
    return hidden[:, :3]


def tokens(output) -> list[int]:
    return list(output.outputs[0].token_ids)


def test_identity_hooks_leave_outputs_unchanged(llm) -> None:
    base = llm.generate(PROMPTS, greedy(8, output_residual_stream=ALL_LAYERS))
    hooks = [
        Hook(same_rows, ALL_LAYERS),
        Hook(same_rows_in_place, ALL_LAYERS, pre=True),
        Hook(same_rows, [1, 2], pre=True, module="mlp.down_proj"),
        Hook(same_rows, [2], module="self_attn.o_proj"),
        Hook(look_only, ALL_LAYERS),
    ]
    hooked = llm.generate(PROMPTS, greedy(8, output_residual_stream=ALL_LAYERS, apply_hooks=hooks))
    for n, (b, h) in enumerate(zip(base, hooked)):
        assert tokens(b) == tokens(h)
        assert_stream_close(capture(h), capture(b), f"prompt {n}: identity hooks vs no hooks")
        steps = 8  # one prefill and seven decode steps: every hook ran at each of its layers
        expected = {"layer.post": 4 * steps, "layer.pre": 4 * steps, "mlp.down_proj.pre": 2 * steps, "self_attn.o_proj.post": steps}
        assert h.activations["saved"] == expected


@pytest.mark.parametrize("site", ["mlp_neuron", "residual_dimension"])
def test_ablation_equals_hf_transformers(llm, tiny_path, site: str) -> None:
    columns, layer = list(range(3, 128, 4)), 1  # 32 of 128 dimensions, of 256 neurons
    if site == "mlp_neuron":
        hook = Hook("ablate", [layer], pre=True, module="mlp.down_proj", args={"indices": columns})
    else:
        hook = Hook("ablate", [layer], args={"indices": columns})
    plain = llm.generate(PROMPTS[:2], greedy(6, output_residual_stream=[3]))
    outs = llm.generate(PROMPTS[:2], greedy(6, output_residual_stream=ALL_LAYERS, apply_hooks=[hook]))
    hf = HFReference(tiny_path)
    target = hf.layers[layer].mlp.down_proj if site == "mlp_neuron" else hf.layers[layer]

    def zero_pre(module, args):
        x = args[0].clone()
        x[..., columns] = 0
        return (x,)

    def zero_post(module, args, output):
        hidden = (output[0] if isinstance(output, tuple) else output).clone()
        hidden[..., columns] = 0
        return (hidden,) + tuple(output[1:]) if isinstance(output, tuple) else hidden

    handle = target.register_forward_pre_hook(zero_pre) if site == "mlp_neuron" else target.register_forward_hook(zero_post)
    try:
        for n, (out, base) in enumerate(zip(outs, plain)):
            ids = list(out.prompt_token_ids) + tokens(out)[:-1]
            reference = hf.residual_stream(ids, ALL_LAYERS)
            assert_stream_close(capture(out), reference, f"prompt {n}: ablated capture vs HF with the same ablation")
            # the ablation did something: it moved the stream ten times as far as the comparison with
            # HF above allows, so that comparison tells an ablated stream from a plain one
            rows = min(capture(out).shape[1], capture(base).shape[1])
            moved = float(token_relative_error(capture(out)[3, :rows], capture(base)[0, :rows]).max())
            print(f"ablation at {site}: largest per-token change at layer 3 {moved:.2e}")
            assert moved > 10 * stream_bound(), f"the ablation moved layer 3 by {moved:.2e} only"
    finally:
        handle.remove()
    if site == "residual_dimension":
        assert all(float(capture(out)[layer][:, columns].abs().max()) == 0.0 for out in outs)


def test_saved_is_per_request_under_concurrency(llm) -> None:
    params = [greedy(5 + i % 3, output_residual_stream=[0, 2], apply_hooks=[Hook(record_rows, [0, 2])]) for i in range(len(PROMPTS))]
    together = llm.generate(PROMPTS, params)
    for i, (prompt, out) in enumerate(zip(PROMPTS, together)):
        alone = llm.generate([prompt], params[i])[0]
        saved = out.activations["saved"]
        n_rows = len(out.prompt_token_ids) + len(tokens(out)) - 1
        fed = torch.tensor(list(out.prompt_token_ids) + tokens(out)[:-1])
        for layer_slot, layer in enumerate([0, 2]):
            assert torch.equal(saved[f"positions.{layer}"], torch.arange(n_rows))
            assert torch.equal(saved[f"tokens.{layer}"], fed)  # this request's own tokens
            torch.testing.assert_close(saved[f"rows.{layer}"], capture(out)[layer_slot], atol=0, rtol=0)
            assert_stream_close(
                saved[f"rows.{layer}"], alone.activations["saved"][f"rows.{layer}"], f"request {i}: hook rows at layer {layer} vs alone"
            )
        assert saved["calls"] == alone.activations["saved"]["calls"]


def test_pre_hook_input_equals_previous_layer_capture(llm) -> None:
    outs = llm.generate(PROMPTS[:3], greedy(5, output_residual_stream=ALL_LAYERS, apply_hooks=[Hook(record_input, ALL_LAYERS, pre=True)]))
    embeddings = None
    for out in outs:
        saved = out.activations["saved"]
        for layer in (1, 2, 3):
            assert torch.equal(saved[f"input.{layer}"], capture(out)[layer - 1])
        if embeddings is None:
            from transformers import AutoModelForCausalLM

            embeddings = AutoModelForCausalLM.from_pretrained(str(llm.llm_engine.model_config.model)).get_input_embeddings().weight
        fed = list(out.prompt_token_ids) + tokens(out)[:-1]
        torch.testing.assert_close(saved["input.0"], embeddings[fed].detach(), atol=0, rtol=0)


def test_failing_hook_fails_only_its_request(llm) -> None:
    params = [
        greedy(4, apply_hooks=[Hook(explode, [2])]),
        greedy(4, output_residual_stream=[3], apply_hooks=[Hook(record_rows, [1])]),
        greedy(4, apply_hooks=[Hook(wrong_shape, [0])]),
        greedy(4),
    ]
    with pytest.raises(LensRequestError) as info:
        llm.generate(PROMPTS[:4], params)
    message = str(info.value)
    assert "RuntimeError: exploded at layer 2" in message and "explode" in message
    assert "returned (" in message and "wrong_shape" in message
    outputs = info.value.outputs
    assert outputs[0].activations is None and outputs[2].activations is None
    alone = llm.generate([PROMPTS[1]], params[1])[0]
    assert tokens(outputs[1]) == tokens(alone)
    assert_stream_close(capture(outputs[1]), capture(alone), "the good neighbour of failing hooks vs alone")
    assert tokens(outputs[3]) == tokens(llm.generate([PROMPTS[3]], greedy(4))[0])


@pytest.mark.parametrize(
    "hook, message",
    [
        (Hook("no_such_hook", [1]), "unknown hook 'no_such_hook'"),
        (Hook("ablate", [1], args={"indices": "x"}), "hook 'ablate' args"),
        (Hook("ablate", [1], args={"indices": [1], "extra": 2}), "Extra inputs are not permitted"),
        (Hook(record_rows, [4]), r"layers \[4\] out of range"),
        ({"name": "record_norm", "layer_indices": [1], "code": "import os"}, "unknown hook fields"),
        ({"name": "record_norm", "layer_indices": []}, "must not be empty"),
        ('{"name": "record_norm"', "not valid JSON"),
        ({"layer_indices": [1]}, "needs 'name'"),
    ],
)
def test_bad_hooks_are_clear_errors_and_the_engine_goes_on(llm, hook, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        llm.generate([PROMPTS[0]], greedy(3, apply_hooks=[hook]))
    good = llm.generate([PROMPTS[0]], greedy(3, apply_hooks=[Hook("record_norm", [1])]))[0]
    assert good.activations["saved"]["norm.1"].shape == (len(good.prompt_token_ids) + 2,)


def test_request_side_validation() -> None:
    with pytest.raises(ValueError, match="not a dotted attribute path"):
        Hook("ablate", [1], module="mlp/../x")
    with pytest.raises(ValueError, match="unsupported type"):
        Hook("ablate", [1], args={"indices": [1], "bad": object()})
    with pytest.raises(ValueError, match="Python callable, which has no JSON form.*LENS_EVALS_HOOKS="):
        Hook(record_rows, [1]).to_wire()
    wired = Hook.from_wire(Hook("patch", [2], args={"positions": [1], "values": np.ones((1, 4), np.float32)}).to_json())
    assert wired.fn == "patch" and wired.args["values"].dtype == np.float32


def test_hooks_per_request_are_bounded() -> None:
    """Each hook runs in Python per layer and step, holding up the whole batch: a request (one
    HTTP body of ~60 bytes per hook) may carry at most 256 of them."""
    from lens_evals.request.args import parse_lens_args

    one = {"name": "record_norm", "layer_indices": [0, 1, 2, 3]}
    assert len(parse_lens_args({"apply_hooks": [one] * 256}).hooks) == 256
    with pytest.raises(ValueError, match=r"too many hooks \(257\), at most 256"):
        parse_lens_args({"apply_hooks": [one] * 257})


def test_a_call_refused_part_way_leaves_nothing_behind(llm) -> None:
    """vLLM aborts the requests an LLM.generate had added when a later one is refused: their
    pending fetches and hook callables (a closure may hold anything) are forgotten."""
    from lens_evals.engine import compat
    from lens_evals.engine.frontend.state import frontend_state
    from lens_evals.engine.transport import hook_refs

    processor = compat.frontend.input_processor(llm.llm_engine)
    before = (len(frontend_state(processor).pending), len(hook_refs._LOCAL_CALLABLES))
    for _ in range(2):
        with pytest.raises(ValueError, match="unknown hook 'nope'"):
            params = [greedy(3, apply_hooks=[Hook(lambda ctx, hidden: None, [1])]), greedy(3, apply_hooks=[Hook("nope", [1])])]
            llm.generate(PROMPTS[:2], params)
    assert (len(frontend_state(processor).pending), len(hook_refs._LOCAL_CALLABLES)) == before
    out = llm.generate([PROMPTS[0]], greedy(3, apply_hooks=[Hook("record_norm", [1])]))[0]
    assert out.activations["saved"]["norm.1"].shape == (len(out.prompt_token_ids) + 2,)


def test_saved_over_the_limit_fails_its_request_while_it_runs(monkeypatch) -> None:
    """The hooks' arrays stay on the device until the fetch: past LENS_EVALS_MAX_SAVED_MIB (their
    encoded form is larger still) the request fails at the next step and they are let go, so a
    request cannot fill the device before the limit is looked at; another request goes on."""
    from lens_evals.engine.compat.worker import BatchLayout
    from lens_evals.engine.worker.core import WorkerCore
    from lens_evals.engine.worker.hooks import WorkerHook
    from lens_evals.engine.worker.requests import WorkerLensRequest

    monkeypatch.setenv("LENS_EVALS_MAX_SAVED_MIB", "1")
    core = WorkerCore(torch.device("cpu"), torch.float32, {0, 1})
    hook = WorkerHook("record", record_rows, [1], False, None, {})
    big = WorkerLensRequest("big", [], hooks=[hook], saved={"0": {"rows.1": [torch.zeros(2**18 + 1)]}})  # 1 MiB + 4 B
    small = WorkerLensRequest("small", [], hooks=[hook], set_saved={"0": {"rows.1": torch.zeros(2**18)}})  # 1 MiB
    core.ledger.track("a", big)
    core.ledger.track("b", small)
    plan = core.plan_step(BatchLayout(["a", "b"], [1, 1], [4, 4]), None)
    assert core.ledger.errors == {"big": core.ledger.errors.get("big")} and "LENS_EVALS_MAX_SAVED_MIB" in core.ledger.errors["big"]
    assert big.saved == {} and small.set_saved["0"]["rows.1"].numel() == 2**18
    assert plan is not None and [call.key for call in plan.hook_calls[(1, None, False)]] == ["small"]


def test_bad_module_path_fails_the_request(llm) -> None:
    with pytest.raises(LensRequestError, match="has no submodule 'mlp.nope'"):
        llm.generate([PROMPTS[0]], greedy(3, apply_hooks=[Hook(look_only, [1], module="mlp.nope")]))


def test_logit_lens_at_the_last_layer_equals_the_engines_logprobs(llm) -> None:
    from vllm import SamplingParams

    params = SamplingParams(
        max_tokens=4,
        temperature=0.0,
        ignore_eos=True,
        logprobs=3,
        extra_args={"apply_hooks": [Hook("logit_lens", [3], args={"top_k": 3, "token_ids": list(range(512))})]},
    )
    out = llm.generate([PROMPTS[2]], params)[0]
    saved = out.activations["saved"]
    assert saved["token_logprobs.3"].shape == (len(out.prompt_token_ids) + 3, 512)  # the whole vocabulary
    torch.testing.assert_close(saved["token_logprobs.3"].logsumexp(-1), torch.zeros(len(out.prompt_token_ids) + 3), atol=1e-5, rtol=0)
    start = len(out.prompt_token_ids) - 1  # the row whose next token is the first generated one
    for step, token in enumerate(tokens(out)):
        row = start + step
        if row >= saved["top_ids.3"].shape[0]:
            break
        assert int(saved["top_ids.3"][row, 0]) == token
        engine = out.outputs[0].logprobs[step]
        for rank in range(3):
            token_id = int(saved["top_ids.3"][row, rank])
            assert abs(engine[token_id].logprob - float(saved["top_logprobs.3"][row, rank])) < 1e-4
            assert abs(engine[token_id].logprob - float(saved["token_logprobs.3"][row, token_id])) < 1e-4


def read_parameters(ctx, hidden):
    if "down" not in ctx.saved:
        ctx.saved["down"] = ctx.get_parameter("model.layers.1.mlp.down_proj.weight")
        ctx.saved["norm"] = ctx.get_parameter("model.norm.weight")
        ctx.saved["head"] = ctx.get_parameter("lm_head.weight")


def test_get_parameter_returns_whole_weights(llm, tiny_path) -> None:
    out = llm.generate([PROMPTS[0]], greedy(2, apply_hooks=[Hook(read_parameters, [0])]))[0]
    saved = out.activations["saved"]
    hf = HFReference(tiny_path).model
    torch.testing.assert_close(saved["down"], hf.model.layers[1].mlp.down_proj.weight.detach(), atol=0, rtol=0)
    torch.testing.assert_close(saved["norm"], hf.model.norm.weight.detach(), atol=0, rtol=0)
    torch.testing.assert_close(saved["head"], hf.lm_head.weight.detach(), atol=0, rtol=0)
    with pytest.raises(LensRequestError, match="no parameter 'model.nope.weight'"):
        llm.generate([PROMPTS[0]], greedy(2, apply_hooks=[Hook(lambda ctx, h: ctx.get_parameter("model.nope.weight"), [0])]))
