"""The stream-contract self-check at engine start (lens_evals.engine.frontend.self_check) refuses lens
requests when a decoder layer's contract is wrong, with the measured numbers, and serves plain
requests. Each of the three contracts is swapped for another on a tiny zoo model of that
contract (tests/arch_zoo.py); that it passes on every contract's zoo model is asserted by the
architecture matrix (tests/engine/test_architectures.py, same engines), on SmolLM2 by
tests/capture/test_capture_hf.py. Without the check (LENS_EVALS_SELF_CHECK=0, as before it existed) the
same engines serve the lens requests, silently wrong."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from lens_evals.engine.compat import architectures
from lens_evals.engine.frontend import self_check, self_check_run
from tests.arch_zoo import build
from tests.conftest import greedy, make_llm

CONTRACTS = {"fused": architectures.FUSED, "stream": architectures.STREAM, "stream_first": architectures.STREAM_FIRST}
# (architecture of that contract, the contract swapped in, the check that must catch it)
SWAPS = [
    ("Qwen3ForCausalLM", "stream_first", "steer"),  # reads hidden without its residual: only the final norm sees it
    ("StableLmForCausalLM", "fused", "identity"),  # adds the stream before the MLP to the stream
    ("GPT2LMHeadModel", "fused", "error"),  # a tensor where a (hidden, residual) tuple is expected
]


@pytest.mark.parametrize("arch,swapped,caught_by", SWAPS)
def test_a_wrong_contract_refuses_lens_requests_and_serves_plain_ones(arch: str, swapped: str, caught_by: str, monkeypatch) -> None:
    entry = architectures.VERIFIED[arch]
    assert entry.contract.kind != swapped
    monkeypatch.setitem(architectures.VERIFIED, arch, dataclasses.replace(entry, contract=CONTRACTS[swapped]))
    monkeypatch.setenv("LENS_EVALS_SELF_CHECK", "1")
    with make_llm(build(arch), max_model_len=512) as llm:
        plain = llm.generate(["the cat reads a book."], greedy(4))
        assert len(plain[0].outputs[0].token_ids) == 4  # plain requests are served
        checked = self_check_run.result_of(llm.llm_engine.input_processor)
        assert checked is not None and not checked.passed, checked and checked.table()
        identity_floor, handoff_floor = self_check.bounds("float32")
        if caught_by == "error":
            assert "decoder layer returned Tensor" in str(checked.error)
        elif caught_by == "steer":  # orders of magnitude over the bound (measured 0.56 against 1e-2)
            assert checked.layers[-1].steer > 10 * self_check.STEER_BOUND, checked.table()
        else:
            assert min(c.identity for c in checked.layers) > 1e3 * identity_floor, checked.table()
            assert min(c.handoff for c in checked.layers) > 1e3 * handoff_floor, checked.table()
        with pytest.raises(ValueError, match="self-check at engine start failed") as refused:
            llm.generate(["the cat reads a book."], greedy(2, output_residual_stream=[0]))
        assert arch in str(refused.value) and ("layer" in str(refused.value))
        again = llm.generate(["the cat reads a book."], greedy(4))
        assert again[0].outputs[0].token_ids == plain[0].outputs[0].token_ids


def test_a_wrong_contract_in_bfloat16_is_still_caught_by_identity(monkeypatch) -> None:
    """In half precision the identity's bound follows the rounding control, which is added by
    steering and so does not go through the (wrong) write-back: the swapped contract's identity
    is measured far over it (0.59-0.90 against controls of 0.02), as handoff and steer are."""
    arch = "StableLmForCausalLM"
    monkeypatch.setitem(architectures.VERIFIED, arch, dataclasses.replace(architectures.VERIFIED[arch], contract=architectures.FUSED))
    monkeypatch.setenv("LENS_EVALS_SELF_CHECK", "1")
    with make_llm(build(arch), max_model_len=512, dtype="bfloat16") as llm:
        llm.generate(["the cat reads a book."], greedy(2))
        checked = self_check_run.result_of(llm.llm_engine.input_processor)
        assert checked is not None and not checked.passed, checked and checked.table()
        for layer in checked.layers:
            assert layer.rounding > 0 and layer.identity > 2 * layer.identity_bound("bfloat16"), checked.table()


def test_without_the_check_a_wrong_contract_goes_unnoticed(monkeypatch) -> None:
    """What the check guards against (the code before it): the swapped contract serves a capture."""
    arch = "Qwen3ForCausalLM"
    monkeypatch.setitem(
        architectures.VERIFIED, arch, dataclasses.replace(architectures.VERIFIED[arch], contract=architectures.STREAM_FIRST)
    )
    with make_llm(build(arch), max_model_len=512) as llm:
        out = llm.generate(["the cat reads a book."], greedy(2, output_residual_stream=[1]))
        assert out[0].activations["residual_stream"].shape[0] == 1
        assert self_check_run.result_of(llm.llm_engine.input_processor).skipped == "LENS_EVALS_SELF_CHECK=0"


def test_async_engine_checks_at_its_first_lens_request(tiny_path, monkeypatch) -> None:
    """AsyncLLM: no check at start; the first lens request waits for it (run once, however many
    lens requests come at once); the numbers are kept on the engine."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    from tests.conftest import engine_options

    monkeypatch.setenv("LENS_EVALS_SELF_CHECK", "1")

    async def main() -> tuple[self_check.SelfCheck | None, self_check.SelfCheck | None, list[int]]:
        engine = AsyncLLM.from_engine_args(AsyncEngineArgs(model=str(tiny_path), **engine_options()))
        try:

            async def one(request_id: str, **extra: object) -> object:
                final = None
                async for out in engine.generate("the cat reads a book.", greedy(3, **extra), request_id):
                    final = out
                return final

            await one("plain")
            before = self_check_run.result_of(engine.input_processor)
            outs = await asyncio.gather(*(one(f"lens{i}", output_residual_stream=[1]) for i in range(3)))
            return before, self_check_run.result_of(engine.input_processor), [o.activations["residual_stream"].shape[0] for o in outs]
        finally:
            engine.shutdown()

    before, after, layers = asyncio.run(main())
    assert before is None  # a plain request does not start it
    assert after is not None and after.passed and after.skipped is None, after and after.table()
    assert [c.layer for c in after.layers] == [0, 2, 3] and layers == [1, 1, 1]


def test_the_server_serves_the_check_at_lens_info(tiny_path) -> None:
    """``GET /lens/info`` runs the check if no lens request has, and serves its numbers: three
    layers of the tiny Llama, identity and handoff within their bounds, the steer ratio measured."""
    import numpy as np
    import requests

    from lens_evals import LinearProbe
    from lens_evals.client import activations_from_response, lens_xargs
    from tests.conftest import lens_server

    with lens_server(tiny_path, env={"LENS_EVALS_SELF_CHECK": "1"}) as server:
        # the server's first lens request starts the check: its response holds its own results
        # only (before: the check's outputs landed in that response's results, and the provider
        # found no probe scores in the main job's first sample)
        probe = LinearProbe(name="p", layer=1, weights=np.ones(128, dtype=np.float32))
        body = {"model": "test", "prompt": "the cat reads a book.", "max_tokens": 3, "temperature": 0, "ignore_eos": True}
        first = requests.post(f"{server.url}/v1/completions", json={**body, "vllm_xargs": lens_xargs([2], probes=[probe])}, timeout=300)
        assert first.status_code == 200, first.text
        got = activations_from_response(first.json())
        assert isinstance(got, dict) and set(got) == {"residual_stream", "probe_scores"}, got
        assert got["residual_stream"].shape[0] == 1 and list(got["probe_scores"]) == ["p"]
        resp = requests.get(f"{server.url}/lens/info", timeout=300)
        assert resp.status_code == 200, resp.text
        check = resp.json()["self_check"]
        assert check["passed"] is True and check["skipped"] is None and check["error"] is None, check
        assert [layer["layer"] for layer in check["layers"]] == [0, 2, 3]
        for layer in check["layers"]:
            assert layer["identity"] <= check["bounds"]["identity"] and layer["handoff"] <= check["bounds"]["handoff"], layer
        assert check["layers"][-1]["steer"] is not None and check["layers"][-1]["control"] > check["bounds"]["control_min"]
        assert requests.post(f"{server.url}/lens/info", json={}, timeout=60).status_code == 405


def test_verify_prints_the_check_and_exits_by_its_outcome(tiny_path) -> None:
    """``lens-evals verify`` on the tiny Llama: exit 0 and the same numbers as the JSON it prints,
    the self-check's and HF's."""
    import json
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-m", "lens_evals.cli", "verify", str(tiny_path), "--json", "--engine-arg", "dtype=float32"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = "\n" + done.stdout
    check = json.loads(out[out.rindex("\n{\n") + 1 :])  # vLLM may log to stdout before it
    assert check["passed"] is True and len(check["layers"]) == 3
    # and every layer against HF (tests/cli/test_verify_hf.py)
    assert check["hf"]["passed"] is True and [row["layer"] for row in check["hf"]["rows"]] == [0, 1, 2, 3], check["hf"]


def test_an_engine_without_a_tokenizer_is_checked_on_token_ids(tiny_path, monkeypatch) -> None:
    """``lens-evals capture`` starts its engine with ``skip_tokenizer_init``: the check runs on a
    prompt of token ids and passes (before: ``ValueError: Tokenizer not available`` ended the call
    the check ran in, so every such capture failed)."""
    monkeypatch.setenv("LENS_EVALS_SELF_CHECK", "1")
    with make_llm(tiny_path, skip_tokenizer_init=True) as llm:
        out = llm.generate([{"prompt_token_ids": [5, 6, 7, 8]}], greedy(2, output_residual_stream=[1]))[0]
        result = self_check_run.result_of(llm.llm_engine.input_processor)
        assert result is not None and result.passed and result.skipped is None, result
        assert out.activations["residual_stream"].shape[:2] == (1, 5)
