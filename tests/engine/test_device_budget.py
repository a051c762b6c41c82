"""The lens device budget (``LENS_EVALS_DEVICE_BUDGET_MIB``): what lens requests in flight may
hold on the device. A request that alone passes it is a 400 saying what to lower; one that does
not fit beside those in flight is a 429 (retry), never reaching a step; the charges go when the
requests end, so the same request is served afterwards. What hooks save grows as requests run:
the worker bounds its total over the requests in flight by the same budget, failing the requests
admitted last with a clear error while the others finish. Plain requests are never charged."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest
import requests
import torch

from lens_evals.client import activations_from_response, lens_xargs
from lens_evals.engine import compat
from lens_evals.engine.frontend.budget import Ledger, StepFacts, charge_of
from lens_evals.engine.frontend.state import frontend_state
from lens_evals.engine.worker.readouts import DeviceWeights
from lens_evals.request.hooks import Hook
from lens_evals.request.readouts import SaeEncoder, SaeReadout
from lens_evals.request.spec import LensRequest
from tests.conftest import TINY_PROMPTS, capture, greedy, lens_server
from tests.tolerance import assert_stream_close

HIDDEN, ACT = 128, 4  # the tiny Llama in fp32
LAYERS = [0, 1, 2, 3]
MAX_TOKENS = 48
PROMPT = TINY_PROMPTS[2]


def capture_bytes(positions: int, layers: int) -> int:
    return positions * layers * HIDDEN * ACT


def prompt_tokens(tiny_path: Any) -> int:
    from transformers import AutoTokenizer

    return len(AutoTokenizer.from_pretrained(str(tiny_path))(PROMPT)["input_ids"])


def test_a_request_over_the_whole_budget_is_refused_saying_what_to_lower(llm, monkeypatch) -> None:
    n_prompt = len(llm.get_tokenizer()(PROMPT)["input_ids"])
    need = capture_bytes(n_prompt + MAX_TOKENS - 1, len(LAYERS))
    monkeypatch.setenv("LENS_EVALS_DEVICE_BUDGET_MIB", str((need - 1) / 2**20))
    with pytest.raises(ValueError, match=r"over the lens budget of .* MiB \(LENS_EVALS_DEVICE_BUDGET_MIB\): capture fewer layers"):
        llm.generate([PROMPT], greedy(MAX_TOKENS, output_residual_stream=LAYERS))
    monkeypatch.setenv("LENS_EVALS_DEVICE_BUDGET_MIB", str((need + 1) / 2**20))
    out = llm.generate([PROMPT], greedy(MAX_TOKENS, output_residual_stream=LAYERS))[0]
    assert capture(out).shape == (len(LAYERS), n_prompt + MAX_TOKENS - 1, HIDDEN)
    assert frontend_state(compat.frontend.input_processor(llm.llm_engine)).pending.budget.in_use() == 0, "the charge outlived its request"


def test_requests_past_the_budget_together_get_429_the_rest_equal_their_solo_runs(tiny_path) -> None:
    """Eight captures at once against a budget that holds about two: at least one 429 naming the
    budget, every 200 equal to the request run alone, plain requests all served; afterwards the
    budget is free again (the same capture served alone)."""
    n_prompt = prompt_tokens(tiny_path)
    one = capture_bytes(n_prompt + MAX_TOKENS - 1, len(LAYERS))
    env = {"LENS_EVALS_DEVICE_BUDGET_MIB": str(2.5 * one / 2**20)}
    body = {"model": "test", "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    with lens_server(tiny_path, env=env) as server:

        def post(lens: bool) -> requests.Response:
            payload = {**body, "vllm_xargs": lens_xargs(LAYERS)} if lens else body
            return requests.post(f"{server.url}/v1/completions", json=payload, timeout=300)

        alone = post(True)
        assert alone.status_code == 200, alone.text
        reference = torch.from_numpy(np.asarray(activations_from_response(alone.json())["residual_stream"]))
        assert reference.shape[1] == n_prompt + MAX_TOKENS - 1
        with ThreadPoolExecutor(max_workers=12) as pool:
            answers = list(pool.map(post, [True] * 8 + [False] * 4))
        lens_answers, plain = answers[:8], answers[8:]
        assert all(resp.status_code == 200 for resp in plain), [resp.text for resp in plain]
        refused = [resp for resp in lens_answers if resp.status_code == 429]
        assert refused, "no request was refused though eight captures of ~2.5 budgets' worth came at once"
        assert all("LENS_EVALS_DEVICE_BUDGET_MIB" in resp.json()["error"]["message"] for resp in refused)
        served = [resp for resp in lens_answers if resp.status_code == 200]
        assert served and len(served) + len(refused) == 8, [resp.status_code for resp in lens_answers]
        for resp in served:
            got = torch.from_numpy(np.asarray(activations_from_response(resp.json())["residual_stream"]))
            assert_stream_close(got, reference, "a capture served beside refused ones vs alone")
        again = post(True)
        assert again.status_code == 200, "the charges of finished requests were not given back: " + again.text


def test_hook_results_past_the_budget_fail_the_requests_admitted_last(tiny_path) -> None:
    """``record`` keeps every hooked row on the device until the fetch. With a budget for about
    three requests' rows, six at once: the first ones finish with their rows, the later ones fail
    with the budget's message, and a request afterwards is served (nothing left held)."""
    n_prompt = prompt_tokens(tiny_path)
    rows = (n_prompt + MAX_TOKENS - 1) * HIDDEN * ACT  # one request's recorded rows (their positions' ids beside them)
    env = {"LENS_EVALS_DEVICE_BUDGET_MIB": str(3 * rows / 2**20)}
    payload: dict[str, Any] = {"model": "test", "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    payload["vllm_xargs"] = lens_xargs(hooks=[Hook("record", [1])])
    with lens_server(tiny_path, env=env) as server:

        def post(_: int) -> requests.Response:
            return requests.post(f"{server.url}/v1/completions", json=payload, timeout=300)

        with ThreadPoolExecutor(max_workers=6) as pool:
            answers = list(pool.map(post, range(6)))
        codes = [resp.status_code for resp in answers]
        failed = [resp for resp in answers if resp.status_code != 200]
        assert failed and len(failed) < 6, codes
        assert all("LENS_EVALS_DEVICE_BUDGET_MIB" in resp.text for resp in failed), [resp.text[:300] for resp in failed]
        assert post(0).status_code == 200


def big_sae(latents: int, seed: int = 0) -> SaeEncoder:
    rng = np.random.default_rng(seed)
    return SaeEncoder(W_enc=rng.normal(size=(HIDDEN, latents)).astype(np.float32), b_enc=np.zeros(latents, np.float32))


def test_a_readout_is_charged_its_weights_and_what_it_makes(llm, monkeypatch) -> None:
    """An SAE readout's weights (float32 on the device), its results and the latents it makes
    count against the budget: one whose weights alone pass the budget is refused naming it,
    before the engine decodes anything; with room for them it is served and its charge goes
    when it ends."""
    sae = big_sae(4096)
    weights = (HIDDEN * 4096 + 4096) * 4  # W_enc and b_enc, hand-counted
    readout = SaeReadout(name="big", layer=1, top_k=4, sae=sae).to_json()
    monkeypatch.setenv("LENS_EVALS_DEVICE_BUDGET_MIB", str(0.9 * weights / 2**20))
    with pytest.raises(ValueError, match=r"over the lens budget .*\(LENS_EVALS_DEVICE_BUDGET_MIB\).* readouts"):
        llm.generate([PROMPT], greedy(4, output_readouts=[readout]), use_tqdm=False)
    monkeypatch.setenv("LENS_EVALS_DEVICE_BUDGET_MIB", str(3 * weights / 2**20))
    out = llm.generate([PROMPT], greedy(4, output_readouts=[readout]), use_tqdm=False)[0]
    assert out.activations["readouts"]["big"]["latent_ids"].shape[-1] == 4
    assert frontend_state(compat.frontend.input_processor(llm.llm_engine)).pending.budget.in_use() == 0, "the charge outlived its request"


def test_shared_readout_weights_count_once_and_the_largest_chunk_once() -> None:
    """Requests naming the same weights share one copy on the device: the ledger counts them once
    while any of them runs; readouts run one at a time, so only the largest chunk they make
    counts; both go when the last user ends."""
    facts = StepFacts(hidden_size=HIDDEN, activation_bytes=ACT, max_step_rows=512, vocab_size=1000)
    small, other = big_sae(64), big_sae(96, seed=1)
    pair = [(SaeReadout(name="a", layer=1, top_k=2, sae=small), {"layer": 1})]
    lens = LensRequest()
    one = charge_of(lens, 10, facts, pair)
    weights = (HIDDEN * 64 + 64) * 4
    results = 10 * 1 * 2 * 2 * 4  # positions x layers x (ids, values) x top_k x float32
    made = (3 * 10 * 64 + 10 * HIDDEN) * 4  # pre-activations, activations and top-k of 10 rows, their float32 copy
    assert (one.held, one.weights, one.transient) == (results, ((small.content_digest(), weights),), made)
    ledger = Ledger(facts)
    ledger.admit(one)
    ledger.admit(one)
    assert ledger.in_use() == 2 * results + weights + made
    third = charge_of(lens, 10, facts, [(SaeReadout(name="b", layer=1, top_k=2, sae=other), {"layer": 1})])
    ledger.admit(third)
    assert ledger.in_use() == 3 * results + weights + (HIDDEN * 96 + 96) * 4 + third.transient
    for charge in (one, one, third):
        ledger.release(charge)
    assert ledger.in_use() == 0 and not ledger.weight_bytes


def test_the_worker_keeps_no_weights_past_its_cache() -> None:
    """Weights past ``LENS_EVALS_READOUT_CACHE_MIB`` are not kept between requests (the cache
    is reserved beside the lens budget, so what it keeps must fit it), the newest included."""
    cache = DeviceWeights(max_bytes=100)
    cache.put(("a", "cpu"), object(), 60)
    cache.put(("b", "cpu"), object(), 30)
    assert cache.held == 90 and cache.get(("a", "cpu")) is not None
    cache.put(("c", "cpu"), object(), 200)
    assert cache.held == 0 and cache.get(("c", "cpu")) is None
