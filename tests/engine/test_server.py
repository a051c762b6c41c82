"""The OpenAI-compatible server: activations in JSON equal offline capture; bad input -> 400
with the reason while a good request in flight completes."""

from __future__ import annotations

import json
import threading

import numpy as np
import pytest
import requests
import torch

from lens_evals import LinearProbe, SteeringVector
from lens_evals.client import activations_from_response, hook_results_from_response, hook_set_body, lens_xargs
from lens_evals.request.hooks import Hook
from tests.conftest import capture, greedy, lens_server, make_llm
from tests.tolerance import assert_scores_close, assert_stream_close, assert_values_close

PROMPT = "the cat reads a book."
MESSAGES = [{"role": "user", "content": "a model finds the truth."}]
LAYERS = [0, 3]
PROBES = [
    LinearProbe(name=f"probe{i}", layer=layer, weights=np.random.default_rng(10 + i).normal(size=128).astype(np.float32), bias=0.1 * i)
    for i, layer in enumerate([0, 3, 3])
]
HOOKS = [Hook("record_norm", [1, 2]), Hook("ablate", [0], args={"indices": [5]})]
STEER = SteeringVector(activations=np.random.default_rng(2).normal(size=(1, 128)).astype(np.float32), layer_indices=[1], scale=6.0)


@pytest.fixture(scope="module")
def server(tiny_path):
    with lens_server(tiny_path) as proc:
        yield proc


@pytest.fixture(scope="module")
def offline(tiny_path):
    with make_llm(tiny_path) as llm:
        completion = llm.generate([PROMPT], greedy(6, output_residual_stream=LAYERS))[0]
        chat = llm.chat(MESSAGES, greedy(6, output_residual_stream=LAYERS))[0]
        steered = llm.generate([PROMPT], greedy(6, apply_steering_vectors=[STEER]))[0]
        plain = llm.generate([PROMPT], greedy(6))[0]
        probed = llm.generate(
            [PROMPT], greedy(6, output_probe_scores=PROBES, apply_steering_vectors=[STEER], output_residual_stream=LAYERS)
        )[0]
        hooked = llm.generate([PROMPT], greedy(6, apply_hooks=HOOKS))[0]
    return {"completion": completion, "chat": chat, "steered": steered, "plain": plain, "probed": probed, "hooked": hooked}


def complete(server, **body):
    payload = {"model": "test", "prompt": PROMPT, "max_tokens": 6, "temperature": 0, "ignore_eos": True, **body}
    return requests.post(f"{server.url}/v1/completions", json=payload, timeout=120)


def test_completion_activations_equal_offline(server, offline) -> None:
    resp = complete(server, vllm_xargs=lens_xargs(LAYERS))
    assert resp.status_code == 200, resp.text
    got = activations_from_response(resp.json())["residual_stream"]
    assert_stream_close(torch.from_numpy(got), capture(offline["completion"]), "completion over HTTP vs offline")


def test_chat_activations_equal_offline(server, offline) -> None:
    payload = {
        "model": "test",
        "messages": MESSAGES,
        "max_tokens": 6,
        "temperature": 0,
        "ignore_eos": True,
        "vllm_xargs": lens_xargs(LAYERS),
    }
    resp = requests.post(f"{server.url}/v1/chat/completions", json=payload, timeout=120)
    assert resp.status_code == 200, resp.text
    got = activations_from_response(resp.json())["residual_stream"]
    assert_stream_close(torch.from_numpy(got), capture(offline["chat"]), "chat over HTTP vs offline")


def test_steering_over_http_matches_offline(server, offline) -> None:
    steered = complete(server, vllm_xargs=lens_xargs(steering=[STEER]), return_token_ids=True).json()
    plain = complete(server, return_token_ids=True).json()
    assert "activations" not in plain
    assert steered["choices"][0]["token_ids"] == list(offline["steered"].outputs[0].token_ids)
    assert plain["choices"][0]["token_ids"] == list(offline["plain"].outputs[0].token_ids)
    assert steered["choices"][0]["token_ids"] != plain["choices"][0]["token_ids"]


def test_probe_scores_over_http_equal_offline(server, offline) -> None:
    resp = complete(server, vllm_xargs=lens_xargs(steering=[STEER], probes=PROBES))
    assert resp.status_code == 200, resp.text
    activations = activations_from_response(resp.json())
    assert set(activations) == {"probe_scores"}  # scores only, no hidden states
    expected = offline["probed"].activations["probe_scores"]
    stream = capture(offline["probed"])
    assert list(activations["probe_scores"]) == [p.name for p in PROBES]
    for probe in PROBES:
        scores = activations["probe_scores"][probe.name]
        assert scores.dtype == np.float32
        assert_scores_close(
            torch.from_numpy(scores),
            expected[probe.name],
            torch.from_numpy(probe.weights),
            stream[LAYERS.index(probe.layer)],
            f"{probe.name} over HTTP vs offline",
        )


def probe_json(**fields) -> str:
    return json.dumps({"name": "p", "layer": 0, "weights": PROBES[0].to_wire()["weights"], **fields})


BAD_XARGS = {
    "layer out of range": ({"output_residual_stream": [7]}, "out of range"),
    "wrong hidden size": (
        {"apply_steering_vectors": [SteeringVector(activations=np.ones((1, 64)), layer_indices=[0]).to_json()]},
        "hidden size 64",
    ),
    "NaN": ({"apply_steering_vectors": ['{"activations": [[NaN]], "layer_indices": [0]}']}, "NaN or inf"),
    "position out of range": (
        {"apply_steering_vectors": [SteeringVector(activations=np.ones((1, 1, 128)), layer_indices=[0], position_indices=[999]).to_json()]},
        "position 999 out of range",
    ),
    "malformed payload": (
        {"apply_steering_vectors": ['{"activations": {"encoding": "safetensors-base64", "data": "!!"}, "layer_indices": [0]}']},
        "not valid base64",
    ),
    "not JSON": ({"apply_steering_vectors": ["{oops"]}, "not valid JSON"),
    "probe hidden size": ({"output_probe_scores": [LinearProbe(name="p", layer=0, weights=np.ones(64)).to_json()]}, "weights length 64"),
    "probe layer out of range": ({"output_probe_scores": [probe_json(layer=4)]}, "layer 4 out of range"),
    "probe NaN": ({"output_probe_scores": [probe_json(weights=[float("nan")] * 128)]}, "NaN or inf"),
    "probe names duplicated": ({"output_probe_scores": [probe_json(), probe_json()]}, "unique per request"),
    "probe not JSON": ({"output_probe_scores": ["{oops"]}, "probe string is not valid JSON"),
    "probe unknown field": ({"output_probe_scores": [probe_json(code="import os")]}, "unknown probe fields"),
    "unregistered hook": ({"apply_hooks": ['{"name": "os.system", "layer_indices": [0]}']}, "unknown hook 'os.system'"),
    "hook as import path": ({"apply_hooks": ['{"name": "os:system", "layer_indices": [0]}']}, "not a valid name"),
    "hook bad args": ({"apply_hooks": [Hook("ablate", [0], args={"indices": "all"}).to_json()]}, "hook 'ablate' args"),
    "hook layer out of range": ({"apply_hooks": [Hook("record_norm", [4]).to_json()]}, "out of range"),
    "unknown hook set": ({"use_hook_set": "0123"}, "not registered"),
}


def test_bad_input_gives_400_while_good_request_completes(server, offline) -> None:
    result: dict = {}

    def good() -> None:
        result["resp"] = complete(server, max_tokens=200, vllm_xargs=lens_xargs(LAYERS))

    thread = threading.Thread(target=good)
    thread.start()
    for name, (xargs, message) in BAD_XARGS.items():
        resp = complete(server, vllm_xargs=xargs)
        assert resp.status_code == 400, f"{name}: {resp.status_code} {resp.text}"
        assert message in resp.json()["error"]["message"], f"{name}: {resp.text}"
    thread.join(timeout=300)
    resp = result["resp"]
    assert resp.status_code == 200, resp.text
    got = activations_from_response(resp.json())["residual_stream"]
    assert got.shape[1] == len(offline["completion"].prompt_token_ids) + 199
    assert_stream_close(torch.from_numpy(got[:, :10]), capture(offline["completion"])[:, :10], "good request beside bad ones")
    assert requests.get(f"{server.url}/health", timeout=5).status_code == 200


def assert_saved_close(got: dict, expected: dict) -> None:
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        assert_values_close(torch.from_numpy(np.asarray(got[key])), value, f"saved {key!r}")


def test_hooks_over_http_equal_offline_and_a_failing_hook_fails_alone(server, offline) -> None:
    resp = complete(server, vllm_xargs=lens_xargs(hooks=HOOKS), return_token_ids=True)
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["token_ids"] == list(offline["hooked"].outputs[0].token_ids)
    assert_saved_close(activations_from_response(resp.json())["saved"], offline["hooked"].activations["saved"])
    broken = Hook("logit_lens", [0], args={"norm": "model.nope.weight"})  # raises inside the hook
    resp = complete(server, vllm_xargs=lens_xargs(hooks=[broken]))
    assert resp.status_code == 500 and "hook logit_lens failed at layer 0: ValueError" in resp.json()["error"]["message"], resp.text
    assert complete(server, vllm_xargs=lens_xargs(hooks=HOOKS)).status_code == 200


def test_hook_set_endpoints(server, offline) -> None:
    url = f"{server.url}/lens/hook_sets"
    for body, message in [
        ({"hooks": [{"name": "nope", "layer_indices": [0]}]}, "unknown hook"),
        ({"hook": []}, "the body must be"),
        ({"hooks": []}, "non-empty"),
    ]:
        resp = requests.post(url, json=body, timeout=60)
        assert resp.status_code == 400 and message in resp.json()["error"]["message"], resp.text
    registered = requests.post(url, json=hook_set_body(HOOKS), timeout=60)
    assert registered.status_code == 200, registered.text
    set_id = registered.json()["id"]
    ids = []
    for _ in range(2):
        resp = complete(server, vllm_xargs=lens_xargs(hook_set=set_id))
        assert resp.status_code == 200, resp.text
        assert activations_from_response(resp.json()) == {}
        ids.append(resp.json()["id"])
    assert complete(server).status_code == 200  # a request that does not opt in adds nothing
    collected = requests.post(f"{url}/{set_id}/collect", json={}, timeout=60)
    assert collected.status_code == 200, collected.text
    results = hook_results_from_response(collected.json())
    assert [r["request_id"].rsplit("-", 1)[0] for r in results] == ids and collected.json()["refused"] == 0
    for result in results:
        assert_saved_close(result["saved"], offline["hooked"].activations["saved"])
    assert requests.post(f"{url}/{set_id}/collect", json={}, timeout=60).json()["results"] == []
    assert requests.delete(f"{url}/{set_id}", timeout=60).json() == {"id": set_id, "dropped_results": 0}
    assert requests.delete(f"{url}/{set_id}", timeout=60).status_code == 404
    assert requests.post(f"{url}/{set_id}/collect", json={}, timeout=60).status_code == 404
    assert complete(server, vllm_xargs=lens_xargs(hook_set=set_id)).status_code == 400
