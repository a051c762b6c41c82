"""A request's lens results are its own on a shared server: requests that share a client-chosen
request id (the ``X-Request-Id`` header or the ``request_id`` field; vLLM accepts repeats, and
gateways and retries make them) each get their own activations, and a streamed response whose
text holds ``data: [DONE]`` gets its activations after its chunks, not inside one."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import requests
import torch

from lens_evals.client import activations_from_response, lens_xargs
from lens_evals.wire.formats import decode_array
from tests.conftest import TINY_PROMPTS, capture, greedy, lens_server, make_llm
from tests.tolerance import assert_stream_close

LAYERS = [1, 3]
MAX_TOKENS = 12
PAIRS = 6
ECHOED = "the cat data: [DONE] reads a book."


@pytest.fixture(scope="module")
def server(tiny_path):
    with lens_server(tiny_path) as proc:
        yield proc


@pytest.fixture(scope="module")
def solo(tiny_path) -> dict[str, tuple[str, torch.Tensor]]:
    """Each prompt run alone offline: its text and its capture."""
    with make_llm(tiny_path) as llm:
        outputs = llm.generate(TINY_PROMPTS, greedy(MAX_TOKENS, output_residual_stream=LAYERS))
        echoed = llm.generate([ECHOED], greedy(1, output_residual_stream=LAYERS))[0]
    runs = {prompt: (out.outputs[0].text, capture(out)) for prompt, out in zip(TINY_PROMPTS, outputs, strict=True)}
    runs[ECHOED] = (echoed.outputs[0].text, capture(echoed))
    return runs


def post(server, prompt: str, request_id: str, in_header: bool) -> requests.Response:
    body = {"model": "test", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    body["vllm_xargs"] = lens_xargs(LAYERS)
    headers = {"X-Request-Id": request_id} if in_header else {}
    if not in_header:
        body["request_id"] = request_id
    return requests.post(f"{server.url}/v1/completions", json=body, headers=headers, timeout=300)


@pytest.mark.parametrize("in_header", [True, False], ids=["X-Request-Id", "request_id-field"])
def test_requests_sharing_a_client_id_each_get_their_own_activations(server, solo, in_header) -> None:
    """Before: lens state was keyed by the client's id, and in 6 of 6 concurrent pairs one
    response came back 200 with no activations (or with the other's rows)."""
    jobs = [(TINY_PROMPTS[i % len(TINY_PROMPTS)], TINY_PROMPTS[(i + 3) % len(TINY_PROMPTS)], f"shared-{i}") for i in range(PAIRS)]
    with ThreadPoolExecutor(max_workers=2 * PAIRS) as pool:
        futures = [(prompt, pool.submit(post, server, prompt, rid, in_header)) for a, b, rid in jobs for prompt in (a, b)]
        answered = [(prompt, future.result()) for prompt, future in futures]
    for prompt, resp in answered:
        assert resp.status_code == 200, resp.text
        data = resp.json()
        assert "activations" in data, f"{prompt!r}: a 200 response without activations"
        text, expected = solo[prompt]
        assert data["choices"][0]["text"] == text, f"{prompt!r}: tokens differ from the prompt run alone"
        got = torch.from_numpy(np.asarray(activations_from_response(data)["residual_stream"]))
        assert got.shape == expected.shape, f"{prompt!r}: {tuple(got.shape)} rows, alone {tuple(expected.shape)}"
        assert_stream_close(got, expected, f"{prompt!r} sharing its request id vs alone")


def test_a_repeated_id_after_completion_gets_fresh_rows(server, solo) -> None:
    """An id reused after its first request finished (a client's retry) gets that request's rows."""
    for prompt in TINY_PROMPTS[:3]:
        resp = post(server, prompt, "reused-id", in_header=True)
        assert resp.status_code == 200, resp.text
        got = torch.from_numpy(np.asarray(activations_from_response(resp.json())["residual_stream"]))
        assert_stream_close(got, solo[prompt][1], f"{prompt!r} under a reused id")


def test_a_stream_whose_text_holds_the_done_marker_keeps_its_chunks_whole(server, solo) -> None:
    """The echoed prompt holds ``data: [DONE]``; with one token the chunk carrying it is sent
    after the request's results are ready. Before: the activations event was spliced into that
    chunk's JSON, breaking it, and the real end of the stream got none."""
    body = {"model": "test", "prompt": ECHOED, "max_tokens": 1, "temperature": 0, "ignore_eos": True, "echo": True, "stream": True}
    body["vllm_xargs"] = lens_xargs(LAYERS)
    resp = requests.post(f"{server.url}/v1/completions", json=body, timeout=300)
    assert resp.status_code == 200, resp.text
    events = [chunk.removeprefix("data: ") for chunk in resp.text.split("\n\n") if chunk.strip()]
    assert events[-1] == "[DONE]", events[-3:]
    decoded = [json.loads(event) for event in events[:-1]]  # every event is whole JSON
    text = "".join(choice["text"] for event in decoded for choice in event.get("choices", []))
    assert text == ECHOED + solo[ECHOED][0]
    lens_events = [event for event in decoded if "activations" in event]
    assert len(lens_events) == 1 and lens_events[0] is decoded[-1], "the activations event must come last, once"
    got = torch.from_numpy(np.asarray(decode_array(lens_events[0]["activations"]["residual_stream"])))
    assert_stream_close(got, solo[ECHOED][1], "streamed capture vs offline")
