"""Issue #19: the lens routes sit behind the server's API keys like vLLM's /v1 routes (401
without the key or with a wrong one; vLLM's own check guards only /v1-like prefixes), and the
live hook sets are bounded in number and size (429 naming the bound and how to free one).

One server (two keys, LENS_EVALS_MAX_HOOK_SETS=3, a 64 KiB hook-set bound) serves every
over-HTTP check; the no-key behaviour of the middleware is checked in-process here, and over HTTP
by tests/test_server.py::test_hook_set_endpoints (a server without --api-key)."""

from __future__ import annotations

import asyncio
import os
from argparse import Namespace
from types import SimpleNamespace
from typing import Any

import pytest
import requests

from lens_evals.client import hook_results_from_response, hook_set_body, lens_xargs
from lens_evals.engine.hook_routes import authorized
from lens_evals.engine.http_middleware import LensResponseMiddleware
from lens_evals.hooks import Hook
from tests.conftest import engine_options

KEYS = ["lens-test-key", "second-key"]
WRONG = [
    {},
    {"Authorization": "Bearer not-the-key"},
    {"Authorization": "Bearer "},
    {"Authorization": f"Basic {KEYS[0]}"},
    {"Authorization": KEYS[0]},
    {"Authorization": f"Bearer {KEYS[0]}x"},
    {"X-API-Key": KEYS[0]},
]
SMALL = [Hook("record_norm", [1])]
BIG = [Hook("ablate", [0], args={"indices": [5], "positions": list(range(1000))})] * 20  # ~100 KB of JSON args


def auth(key: str = KEYS[0]) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def server(tiny_path):
    from lens_evals.provider.server import LensServer

    args = engine_options(api_key=KEYS)
    env = {"LENS_EVALS_MAX_HOOK_SETS": "3", "LENS_EVALS_MAX_HOOK_SET_MIB": str(64 / 2**10)}
    proc = LensServer(str(tiny_path), served_name="test", server_args=args, env=env).start()
    try:
        yield proc
    finally:
        proc.stop()


def complete(server, headers: dict[str, str], **body: Any) -> requests.Response:
    payload = {"model": "test", "prompt": "the cat reads a book.", "max_tokens": 4, "temperature": 0, "ignore_eos": True, **body}
    return requests.post(f"{server.url}/v1/completions", json=payload, headers=headers, timeout=120)


def create(server, hooks: list[Hook], headers: dict[str, str]) -> requests.Response:
    return requests.post(f"{server.url}/lens/hook_sets", json=hook_set_body(hooks), headers=headers, timeout=60)


def test_every_route_needs_the_key(server) -> None:
    url = f"{server.url}/lens/hook_sets"
    made = create(server, SMALL, auth())
    assert made.status_code == 200, made.text
    set_id = made.json()["id"]
    vllm_401 = complete(server, {})
    assert vllm_401.status_code == 401
    for headers in WRONG:
        for resp in [
            complete(server, headers),
            create(server, SMALL, headers),
            requests.post(f"{url}/{set_id}/collect", headers=headers, timeout=60),
            requests.delete(f"{url}/{set_id}", headers=headers, timeout=60),
            requests.delete(f"{url}/no-such-set", headers=headers, timeout=60),
        ]:
            assert resp.status_code == 401, (headers, resp.request.method, resp.request.url, resp.text)
            assert resp.json() == vllm_401.json()  # the same body as vLLM's own 401
    for _ in range(10):  # unauthenticated creates make nothing: the bound of 3 is not reached
        assert create(server, SMALL, {}).status_code == 401
    # With either key every route works, and the set survived the refused DELETEs.
    for key in KEYS:
        resp = complete(server, auth(key), vllm_xargs=lens_xargs(hook_set=set_id))
        assert resp.status_code == 200, resp.text
    collected = requests.post(f"{url}/{set_id}/collect", headers=auth(KEYS[1]), timeout=60)
    assert collected.status_code == 200, collected.text
    assert len(hook_results_from_response(collected.json())) == 2
    assert requests.delete(f"{url}/{set_id}", headers=auth(), timeout=60).json() == {"id": set_id, "dropped_results": 0}
    assert requests.delete(f"{url}/{set_id}", headers=auth(), timeout=60).status_code == 404
    assert requests.get(f"{server.url}/health", timeout=10).status_code == 200  # unguarded, as in vLLM


def test_count_bound_refuses_the_fourth_set_until_one_is_deleted(server) -> None:
    url = f"{server.url}/lens/hook_sets"
    ids = []
    for _ in range(3):
        resp = create(server, SMALL, auth())
        assert resp.status_code == 200, resp.text
        ids.append(resp.json()["id"])
    refused = create(server, SMALL, auth())
    assert refused.status_code == 429, refused.text
    message = refused.json()["error"]["message"]
    assert "LENS_EVALS_MAX_HOOK_SETS" in message and "3 live" in message and "DELETE /lens/hook_sets/{id}" in message, message
    assert complete(server, auth()).status_code == 200  # plain completions go on
    assert complete(server, auth(), vllm_xargs=lens_xargs(hook_set=ids[0])).status_code == 200  # and the sets work
    assert requests.delete(f"{url}/{ids.pop(0)}", headers=auth(), timeout=60).status_code == 200
    again = create(server, SMALL, auth())
    assert again.status_code == 200, again.text
    ids.append(again.json()["id"])
    assert create(server, SMALL, auth()).status_code == 429
    for set_id in ids:
        assert requests.delete(f"{url}/{set_id}", headers=auth(), timeout=60).status_code == 200


def test_size_bound_refuses_a_set_over_the_mib_bound(server) -> None:
    refused = create(server, BIG, auth())
    assert refused.status_code == 429, refused.text
    message = refused.json()["error"]["message"]
    assert "LENS_EVALS_MAX_HOOK_SET_MIB" in message and "DELETE /lens/hook_sets/{id}" in message, message
    made = create(server, SMALL, auth())  # a small one still fits, and nothing was left behind
    assert made.status_code == 200, made.text
    assert requests.delete(f"{server.url}/lens/hook_sets/{made.json()['id']}", headers=auth(), timeout=60).status_code == 200
    assert complete(server, auth()).status_code == 200


# --------------------------------------------------------------------------- in-process
def scope_for(
    api_key: list[str] | None, headers: dict[str, str] | None = None, method: str = "DELETE", path: str = "/lens/hook_sets/unknown"
) -> dict[str, Any]:
    """An ASGI scope of a vLLM-like app: ``state.args`` (the parsed CLI) and an engine whose
    input processor has no hook sets yet."""
    state = SimpleNamespace(args=Namespace(api_key=api_key), engine_client=SimpleNamespace(input_processor=SimpleNamespace()))
    raw = [(name.lower().encode("latin-1"), value.encode("latin-1")) for name, value in (headers or {}).items()]
    return {"type": "http", "method": method, "path": path, "headers": raw, "app": SimpleNamespace(state=state)}


def call(scope: dict[str, Any]) -> int:
    sent: list[dict[str, Any]] = []

    async def inner(scope, receive, send) -> None:
        raise AssertionError("lens routes never reach the inner app")

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    asyncio.run(LensResponseMiddleware(inner)(scope, receive, send))
    return sent[0]["status"]


def set_vllm_api_key(value: str | None) -> None:
    """Set VLLM_API_KEY and drop vLLM's env cache (an in-process engine turns it on)."""
    from vllm import envs

    if value is None:
        os.environ.pop("VLLM_API_KEY", None)
    else:
        os.environ["VLLM_API_KEY"] = value
    clear = getattr(envs.__getattr__, "cache_clear", None)
    if clear is not None:
        clear()


def test_without_a_key_the_routes_are_open_and_keys_are_read_as_vllm_reads_them() -> None:
    saved = os.environ.get("VLLM_API_KEY")
    try:
        set_vllm_api_key(None)
        assert call(scope_for(None)) == 404  # no key configured: the route answers (unknown id)
        assert call(scope_for([""])) == 404  # empty keys are ignored, as in vLLM
        assert call(scope_for(["k"])) == 401
        assert call(scope_for(["k"], {"Authorization": "bearer k"})) == 404  # the scheme is case-insensitive
        assert call(scope_for(["a", "k"], {"Authorization": "Bearer k"})) == 404
        set_vllm_api_key("env-key")  # without --api-key, VLLM_API_KEY
        assert call(scope_for(None)) == 401
        assert authorized(scope_for(None, {"Authorization": "Bearer env-key"}))
        assert not authorized(scope_for(["cli-key"], {"Authorization": "Bearer env-key"}))  # --api-key takes precedence
        assert authorized(scope_for(["cli-key"], {"Authorization": "Bearer cli-key"}))
    finally:
        set_vllm_api_key(saved)


def test_the_middleware_import_path_names_the_middleware() -> None:
    """vLLM 0.26 adds the middleware by this import path (``--middleware``); it must name the class."""
    import importlib

    from lens_evals.engine.http_middleware import MIDDLEWARE_PATH

    module, _, name = MIDDLEWARE_PATH.rpartition(".")
    assert getattr(importlib.import_module(module), name) is LensResponseMiddleware
