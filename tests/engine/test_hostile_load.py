"""Issue #40's hostile load: one server with two API keys, 64 good requests in flight (plain,
capture, steering, probes, steering + capture; pairs of them share a client request id) mixed
with every hostile request of the issue (zstd bombs for a probe, a steering vector and a hook
argument; a hook with 100k positions; a steering scale that overflows float32; a request whose
probes alone pass the device budget; a text/plain route call; another key reading, deleting and
using a hook set; one key past its hook-set quota). Every good response equals its request run
alone offline; each hostile one gets its own 4xx/429; the good requests' median latency stays
within 1.5x of the same load without the hostile requests (two paired rounds); the frontend's
RSS does not grow by what the bombs declare; at the end the worker holds 0 bytes and the engine
serves a plain request. Also: a good key's hook set works throughout, and a streamed capture
ends with its activations."""

from __future__ import annotations

import base64
import json
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import psutil
import pytest
import requests
import torch
import zstandard

from lens_evals import LinearProbe
from lens_evals.client import activations_from_response, hook_set_body, lens_xargs
from lens_evals.inspect_kit.provider.server import LensServer
from lens_evals.request.hooks import Hook
from lens_evals.request.spec import HOOK_SET_KEY, HOOKS_KEY, PROBE_KEY, STEERING_KEY
from lens_evals.wire import formats as wire
from tests.conftest import engine_options
from tests.engine.test_hardening_load import SPECS, completion_body, solo  # noqa: F401  (solo: the module's fixture, each request run alone)
from tests.tolerance import assert_scores_close, assert_stream_close

pytestmark = pytest.mark.slow

GOOD_KEY, EVIL_KEY = "good-key", "evil-key"
BUDGET_MIB = 8  # the good load's charges stay well under it (a step's 2,048 rows x 2 layers x 512 B = 2 MiB)
BOMB = 256 * 2**20


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def server(tiny_path):
    env = {
        "VLLM_SERVER_DEV_MODE": "1",  # /collective_rpc: the worker's held bytes
        "LENS_EVALS_DEVICE_BUDGET_MIB": str(BUDGET_MIB),
        "LENS_EVALS_MAX_HOOK_SETS_PER_KEY": "3",
    }
    proc = LensServer(str(tiny_path), served_name="test", server_args=engine_options(api_key=[GOOD_KEY, EVIL_KEY]), env=env).start()
    try:
        yield proc
    finally:
        proc.stop()


def completion(server: LensServer, key: str, prompt: str, max_tokens: int, xargs: dict[str, Any] | None, **extra: Any) -> requests.Response:
    body: dict[str, Any] = {"model": "test", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, **extra}
    if xargs:
        body["vllm_xargs"] = xargs
    return requests.post(f"{server.url}/v1/completions", json=body, headers=auth(key), timeout=600)


def good(server: LensServer, index: int) -> tuple[float, requests.Response]:
    """The index-th good request, its client id shared with its pair; (latency, response)."""
    start = time.monotonic()
    resp = requests.post(
        f"{server.url}/v1/completions",
        json=completion_body(SPECS[index]),
        headers={**auth(GOOD_KEY), "X-Request-Id": f"pair-{index // 2}"},
        timeout=600,
    )
    return time.monotonic() - start, resp


def bomb() -> dict[str, Any]:
    frame = zstandard.ZstdCompressor().compress(bytes(BOMB))  # ~11 KiB, honestly declaring 256 MiB
    return {"encoding": wire.ENCODING, "data": base64.b64encode(frame).decode(), "compression": "zstd", "nbytes": BOMB}


def hostile_requests(server: LensServer, good_set: str) -> list[tuple[str, Any, set[int]]]:
    """(name, a call making the request, the statuses it may get)."""
    url = server.url
    small = np.ones(128, dtype=np.float32)
    overflowing = {"activations": wire.encode_array(np.full((1, 128), 2.0, dtype=np.float32)), "layer_indices": [1], "scale": 3e38}
    many_probes = [LinearProbe(name=f"p{i}", layer=1, weights=small).to_json() for i in range(4000)]
    return [
        (
            "probe zip bomb",
            lambda: completion(server, EVIL_KEY, "the cat", 4, {PROBE_KEY: [json.dumps({"name": "p", "layer": 0, "weights": bomb()})]}),
            {400},
        ),
        (
            "steering zip bomb",
            lambda: completion(server, EVIL_KEY, "the cat", 4, {STEERING_KEY: [json.dumps({"activations": bomb(), "layer_indices": [0]})]}),
            {400},
        ),
        (
            "hook argument zip bomb",
            lambda: completion(
                server, EVIL_KEY, "the cat", 4, {HOOKS_KEY: [json.dumps({"name": "add", "layer_indices": [0], "args": {"vector": bomb()}})]}
            ),
            {400},
        ),
        (
            "hook with 100k positions",
            lambda: completion(
                server,
                EVIL_KEY,
                "the cat",
                4,
                lens_xargs(hooks=[Hook("add", [1], args={"vector": small, "positions": list(range(100_000))})]),
            ),
            {400},
        ),
        (
            "steering scale overflows float32",
            lambda: completion(server, EVIL_KEY, "the cat", 4, {STEERING_KEY: [json.dumps(overflowing)]}),
            {400},
        ),
        ("probes alone past the device budget", lambda: completion(server, EVIL_KEY, "the cat", 900, {PROBE_KEY: many_probes}), {400}),
        (
            "text/plain hook-set create",
            lambda: requests.post(
                f"{url}/lens/hook_sets",
                data=json.dumps(hook_set_body([Hook("record_norm", [1])])),
                headers={**auth(EVIL_KEY), "Content-Type": "text/plain"},
                timeout=60,
            ),
            {415},
        ),
        (
            "another key collects a set",
            lambda: requests.post(f"{url}/lens/hook_sets/{good_set}/collect", json={}, headers=auth(EVIL_KEY), timeout=60),
            {404},
        ),
        (
            "another key deletes a set",
            lambda: requests.delete(f"{url}/lens/hook_sets/{good_set}", headers=auth(EVIL_KEY), timeout=60),
            {404},
        ),
        ("another key uses a set", lambda: completion(server, EVIL_KEY, "the cat", 4, {HOOK_SET_KEY: good_set}), {400}),
        *[
            (
                f"hook set {n} of one key",
                lambda: requests.post(
                    f"{url}/lens/hook_sets", json=hook_set_body([Hook("record_norm", [1])]), headers=auth(EVIL_KEY), timeout=60
                ),
                {200, 429},
            )
            for n in range(6)
        ],
    ]


def run_round(
    server: LensServer, hostile: list[tuple[str, Any, set[int]]]
) -> tuple[list[tuple[float, requests.Response]], list[tuple[str, requests.Response]]]:
    """The 64 good requests, and the hostile ones interleaved with them, all in flight at once."""
    with ThreadPoolExecutor(len(SPECS) + len(hostile)) as pool:
        hostile_futures = [(name, pool.submit(call)) for name, call, _ in hostile[: len(hostile) // 2]]
        good_futures = [pool.submit(good, server, i) for i in range(len(SPECS))]
        hostile_futures += [(name, pool.submit(call)) for name, call, _ in hostile[len(hostile) // 2 :]]
        return [f.result() for f in good_futures], [(name, f.result()) for name, f in hostile_futures]


def frontend_rss(server: LensServer) -> int:
    return psutil.Process(server.pid).memory_info().rss


def check_good(responses: list[tuple[float, requests.Response]], alone: list[Any]) -> None:
    for index, ((_, resp), spec, reference) in enumerate(zip(responses, SPECS, alone, strict=True)):
        assert resp.status_code == 200, f"good request {index} ({spec['kind']}): {resp.status_code} {resp.text[:300]}"
        body = resp.json()
        assert body["choices"][0]["token_ids"] == list(reference.outputs[0].token_ids), f"good request {index}: tokens differ from alone"
        if spec["kind"] == "plain":
            assert "activations" not in body
            continue
        got = activations_from_response(body)
        if "capture_layers" in spec["lens"]:
            assert_stream_close(torch.from_numpy(got["residual_stream"]), reference.activations["residual_stream"], f"good request {index}")
        for probe in spec["lens"].get("probes", []):
            layers = sorted({p.layer for p in spec["lens"]["probes"]})
            assert_scores_close(
                torch.from_numpy(got["probe_scores"][probe.name]),
                reference.activations["probe_scores"][probe.name],
                torch.from_numpy(probe.weights),
                reference.activations["residual_stream"][layers.index(probe.layer)],
                f"good request {index} probe {probe.name}",
            )


def test_good_requests_beside_hostile_ones_are_served_as_alone(server, solo) -> None:  # noqa: F811
    made = requests.post(f"{server.url}/lens/hook_sets", json=hook_set_body([Hook("record_norm", [1])]), headers=auth(GOOD_KEY), timeout=60)
    assert made.status_code == 200, made.text
    good_set = made.json()["id"]
    hostile = hostile_requests(server, good_set)
    run_round(server, [])  # warm-up: the first requests of a server are slower
    rss_before = frontend_rss(server)
    medians: dict[str, list[float]] = {"clean": [], "hostile": []}
    for _ in range(2):  # paired rounds on one server
        clean, _ = run_round(server, [])
        check_good(clean, solo)
        medians["clean"].append(statistics.median(latency for latency, _ in clean))
        mixed, answered = run_round(server, hostile)
        check_good(mixed, solo)
        medians["hostile"].append(statistics.median(latency for latency, _ in mixed))
        for (name, resp), (_, _, allowed) in zip(answered, hostile, strict=True):
            assert resp.status_code in allowed, f"{name}: {resp.status_code} {resp.text[:300]}"
        quota = [resp.status_code for name, resp in answered if name.startswith("hook set ")]
        assert quota.count(429) >= 3, f"one key created {quota.count(200)} sets past its quota of 3: {quota}"
        for resp in [resp for name, resp in answered if name.startswith("hook set ") and resp.status_code == 200]:
            requests.delete(f"{server.url}/lens/hook_sets/{resp.json()['id']}", headers=auth(EVIL_KEY), timeout=60)
    grown = frontend_rss(server) - rss_before
    ratio = statistics.median(medians["hostile"]) / statistics.median(medians["clean"])
    print(
        f"\ngood median latency: clean {medians['clean']} s, beside hostile {medians['hostile']} s: {ratio:.2f}x; frontend RSS +{grown / 2**20:.0f} MiB"
    )
    assert ratio <= 1.5, f"good requests slowed {ratio:.2f}x beside the hostile ones"
    assert grown < 128 * 2**20, f"the frontend grew {grown / 2**20:.0f} MiB (each round refuses three 256 MiB bombs)"

    # the good key's set still works, and is still its own
    used = completion(server, GOOD_KEY, "the cat reads", 4, {HOOK_SET_KEY: good_set})
    assert used.status_code == 200, used.text
    collected = requests.post(f"{server.url}/lens/hook_sets/{good_set}/collect", json={}, headers=auth(GOOD_KEY), timeout=60)
    assert collected.status_code == 200 and len(collected.json()["results"]) == 1, collected.text

    # a streamed capture ends with its activations; the engine is alive and holds nothing
    stream = completion(server, GOOD_KEY, "the cat reads a book.", 6, lens_xargs([1]), stream=True)
    events = [chunk.removeprefix("data: ") for chunk in stream.text.split("\n\n") if chunk.strip()]
    assert events[-1] == "[DONE]" and "activations" in json.loads(events[-2]), events[-2:]
    plain = completion(server, GOOD_KEY, "the cat reads a book.", 4, None)
    assert plain.status_code == 200, plain.text
    held = requests.post(f"{server.url}/collective_rpc", json={"method": "lens_evals_memory"}, headers=auth(GOOD_KEY), timeout=60)
    assert held.status_code == 200 and held.json()["results"][0]["held_bytes"] == 0, held.text
