"""What served lens responses hold on the frontend until they are written
(``LENS_EVALS_MAX_RESPONSE_HELD_MIB``): a client that asks for a large capture and does not read
its response pins the rows and their encoded copies; past the bound, new lens requests get 429
naming it, plain requests are served, and once the slow client has read its response the same
request is served again."""

from __future__ import annotations

import json
import socket
import time
from urllib.parse import urlsplit

import pytest
import requests

from lens_evals.client import lens_xargs
from tests.conftest import lens_server

BOUND_MIB = 16  # the slow response: 4 prompts x ~900 positions x 4 layers x 512 B = 7 MB of rows, 4x charged
LONG = " ".join(["the cat reads a book."] * 150)  # ~900 tokens of the tiny Llama: one prefill, no long decode


@pytest.fixture(scope="module")
def server(tiny_path):
    with lens_server(tiny_path, env={"LENS_EVALS_MAX_RESPONSE_HELD_MIB": str(BOUND_MIB)}) as proc:
        yield proc


def unread_request(url: str, body: dict) -> socket.socket:
    """Send ``body`` as a completion request on a socket with a small receive buffer that is not
    read: the server's writes stall once the kernel's buffers are full (the response is ~10 MB,
    over the 4 MiB a loopback socket buffers at most here)."""
    parts = urlsplit(url)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect((parts.hostname, parts.port))
    payload = json.dumps(body).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {parts.hostname}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n"
    )
    sock.sendall(head.encode() + payload)
    return sock


def read_all(sock: socket.socket) -> bytes:
    chunks = []
    while chunk := sock.recv(1 << 20):
        chunks.append(chunk)
    sock.close()
    return b"".join(chunks)


def test_an_unread_response_holds_lens_requests_back_until_it_is_read(server) -> None:
    capture = {"model": "test", "max_tokens": 4, "temperature": 0, "ignore_eos": True, "prompt": "the cat", "vllm_xargs": lens_xargs([1])}
    assert requests.post(f"{server.url}/v1/completions", json=capture, timeout=120).status_code == 200
    slow = unread_request(
        server.url,
        {"model": "test", "prompt": [LONG] * 4, "max_tokens": 2, "temperature": 0, "ignore_eos": True, "vllm_xargs": lens_xargs(True)},
    )
    refused = None
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:  # until the slow response is held: its rows are charged once fetched
        resp = requests.post(f"{server.url}/v1/completions", json=capture, timeout=120)
        if resp.status_code == 429:
            refused = resp
            break
        assert resp.status_code == 200, resp.text
        time.sleep(0.2)
    assert refused is not None, "no lens request was held back while a large response sat unread"
    assert "LENS_EVALS_MAX_RESPONSE_HELD_MIB" in refused.json()["error"]["message"]
    plain = {key: value for key, value in capture.items() if key != "vllm_xargs"}
    assert requests.post(f"{server.url}/v1/completions", json=plain, timeout=120).status_code == 200
    answer = read_all(slow)
    assert answer.startswith(b"HTTP/1.1 200") and b'"activations"' in answer
    deadline = time.monotonic() + 30
    while (resp := requests.post(f"{server.url}/v1/completions", json=capture, timeout=120)).status_code == 429:
        assert time.monotonic() < deadline, "the charge of a response read to its end was not given back"
        time.sleep(0.2)
    assert resp.status_code == 200, resp.text
