"""Persistent hook sets offline: register once, requests opt in, one bulk collect equals the
same hooks run per request, the memory bound fails the request that does not fit, clear."""

from __future__ import annotations

import pytest
import torch

from lens_evals.engine.frontend.attach import LensRequestError
from lens_evals.engine.frontend.hook_sets import register_hook_set
from lens_evals.request.hook_library import append_rows
from lens_evals.request.hooks import Hook
from tests.conftest import greedy
from tests.engine.test_hooks import record_rows
from tests.tolerance import assert_values_close

PROMPTS = ["the cat reads a book.", "a model finds the truth.", "1 2 3 4 5 6 7 8", "my friend"]
HOOKS = [Hook("record_norm", [1, 3]), Hook(record_rows, [2])]


def test_register_run_collect_clear(llm) -> None:
    hook_set = register_hook_set(llm, HOOKS)
    params = [
        greedy(4, **hook_set.extra_args),
        greedy(4),
        greedy(5, output_residual_stream=[0], **hook_set.extra_args),
        greedy(4, apply_hooks=[Hook("record_norm", [0])], **hook_set.extra_args),
    ]
    outs = llm.generate(PROMPTS, params)
    assert outs[3].activations["saved"].keys() == {"norm.0", "positions.0"}  # its own hooks' results
    collected = hook_set.collect()
    assert collected["refused"] == 0
    by_id = {r["request_id"]: r["saved"] for r in collected["results"]}
    assert set(by_id) == {outs[i].request_id for i in (0, 2, 3)}  # only requests that opted in
    for i in (0, 2, 3):
        reference = llm.generate([PROMPTS[i]], greedy(len(outs[i].outputs[0].token_ids), apply_hooks=HOOKS))[0]
        expected = reference.activations["saved"]
        assert by_id[outs[i].request_id].keys() == expected.keys()
        for key, value in expected.items():
            if isinstance(value, torch.Tensor):
                assert_values_close(by_id[outs[i].request_id][key], value, f"request {i} saved {key!r}")
            else:
                assert by_id[outs[i].request_id][key] == value
    assert hook_set.collect()["results"] == []  # collecting empties the set
    llm.generate(PROMPTS[:1], greedy(3, **hook_set.extra_args))
    assert hook_set.clear() == 1  # one uncollected result dropped
    with pytest.raises(ValueError, match="not registered"):
        llm.generate(PROMPTS[:1], greedy(3, **hook_set.extra_args))


def test_results_bound_fails_the_request_that_does_not_fit(llm, monkeypatch) -> None:
    hook_set = register_hook_set(llm, [Hook(lambda ctx, hidden: append_rows(ctx.saved, "rows", hidden), [1])])  # in-process: lambdas work
    monkeypatch.setenv("LENS_EVALS_MAX_HOOK_RESULTS_MIB", str(8 / 2**10))  # 8 KiB: one result (~5.6 KiB encoded) fits, not two
    outs = llm.generate(PROMPTS[:1], greedy(3, **hook_set.extra_args))
    with pytest.raises(LensRequestError, match="LENS_EVALS_MAX_HOOK_RESULTS_MIB") as info:
        llm.generate(PROMPTS[1:2], greedy(3, **hook_set.extra_args))
    assert len(info.value.outputs[0].outputs[0].token_ids) == 3  # the generation itself completed
    collected = hook_set.collect()
    assert collected["refused"] == 1 and [r["request_id"] for r in collected["results"]] == [outs[0].request_id]
    assert collected["results"][0]["saved"]["rows"].shape == (len(outs[0].prompt_token_ids) + 2, 128)
    llm.generate(PROMPTS[1:2], greedy(3, **hook_set.extra_args))  # room again after collecting
    hook_set.clear()


@pytest.mark.parametrize(
    "hooks, message",
    [
        ([], "non-empty list"),
        ([Hook("nope", [0])], "unknown hook 'nope'"),
        ([Hook("record_norm", [9])], "out of range"),
        ([{"name": "ablate", "layer_indices": [0], "args": {"indices": "all"}}], "hook 'ablate' args"),
    ],
)
def test_bad_hook_sets_are_refused(llm, hooks, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        register_hook_set(llm, hooks)


def test_the_frontend_keeps_its_engine_state_in_one_object(llm) -> None:
    """Pending requests, hook sets, the engine's facts, the fetch batcher and the self-check's
    result hang on vLLM's input processor as one attribute: the LensFrontendState."""
    from lens_evals.engine import compat
    from lens_evals.engine.frontend.state import LensFrontendState, frontend_state

    processor = compat.frontend.input_processor(llm.llm_engine)
    hook_set = register_hook_set(llm, HOOKS)
    out = llm.generate(PROMPTS[:1], greedy(3, output_residual_stream=[0], **hook_set.extra_args))[0]
    assert out.activations["residual_stream"].shape[0] == 1
    state = frontend_state(processor)
    assert isinstance(state, LensFrontendState) and list(state.hook_sets.sets) == [hook_set.id]
    assert len(state.pending) == 0 and state.self_check is not None and state.facts.shape.num_layers > 0
    hook_set.clear()
    assert [name for name in vars(processor) if "lens_evals" in name] == [compat.frontend.LENS_STATE_ATTR]
