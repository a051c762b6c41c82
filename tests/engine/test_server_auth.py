"""Issue #19: the lens routes sit behind the server's API keys like vLLM's /v1 routes (401
without the key or with a wrong one; vLLM's own check guards only /v1-like prefixes), and the
live hook sets are bounded in number and size (429 naming the bound and how to free one).
Issue #40: the lens routes run inside the operator's --middleware and CORS, take JSON bodies
only (415), and each hook set belongs to the key that made it (404 for another key), with a
per-key quota and an idle expiry that frees its worker half too.

One server (two keys, LENS_EVALS_MAX_HOOK_SETS=3 and 2 per key, sets idle for 10 s expire, a
64 KiB hook-set bound, an operator middleware (tests/operator_middleware.py), one allowed CORS
origin) serves every over-HTTP check; the no-key behaviour of the middleware is checked
in-process here, and over HTTP by tests/engine/test_server.py::test_hook_set_endpoints (a server
without --api-key)."""

from __future__ import annotations

import asyncio
import json
import os
import time
from argparse import Namespace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import requests

from lens_evals.client import hook_results_from_response, hook_set_body, lens_xargs
from lens_evals.engine.frontend.hook_routes import authorized
from lens_evals.engine.frontend.http_middleware import LensResponseMiddleware
from lens_evals.request.hooks import Hook
from tests.conftest import engine_options
from tests.operator_middleware import BLOCK_HEADER, SAW_HEADER

ROOT = Path(__file__).resolve().parents[2]
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
IDLE_S = 10.0
GOOD_ORIGIN, EVIL_ORIGIN = "http://good.example", "http://evil.example"


def auth(key: str = KEYS[0]) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def server(tiny_path):
    from lens_evals.inspect_kit.provider.server import LensServer

    args = engine_options(api_key=KEYS, middleware=["tests.operator_middleware.OperatorMiddleware"], allowed_origins=f'["{GOOD_ORIGIN}"]')
    env = {
        "LENS_EVALS_MAX_HOOK_SETS": "3",
        "LENS_EVALS_MAX_HOOK_SETS_PER_KEY": "2",
        "LENS_EVALS_HOOK_SET_IDLE_S": str(IDLE_S),
        "LENS_EVALS_MAX_HOOK_SET_MIB": str(64 / 2**10),
        "VLLM_SERVER_DEV_MODE": "1",  # /collective_rpc: ask the worker whether it still holds a set
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),  # the middleware's module
    }
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
    # Either key authenticates; the set (its maker's) survived the refused DELETEs.
    for key in KEYS:
        assert complete(server, auth(key)).status_code == 200
    for _ in range(2):
        resp = complete(server, auth(), vllm_xargs=lens_xargs(hook_set=set_id))
        assert resp.status_code == 200, resp.text
    collected = requests.post(f"{url}/{set_id}/collect", json={}, headers=auth(), timeout=60)
    assert collected.status_code == 200, collected.text
    assert len(hook_results_from_response(collected.json())) == 2
    assert requests.delete(f"{url}/{set_id}", headers=auth(), timeout=60).json() == {"id": set_id, "dropped_results": 0}
    assert requests.delete(f"{url}/{set_id}", headers=auth(), timeout=60).status_code == 404
    assert requests.get(f"{server.url}/health", timeout=10).status_code == 200  # unguarded, as in vLLM


def test_count_bound_refuses_the_fourth_set_until_one_is_deleted(server) -> None:
    url = f"{server.url}/lens/hook_sets"
    # whatever an earlier test left live (it failed before its DELETE, or keeps its set), idle
    # past LENS_EVALS_HOOK_SET_IDLE_S it is freed by the next lens route: this test starts from none
    time.sleep(IDLE_S + 1.0)
    ids = []  # (set id, its key): two for the first key, one for the second (2 per key)
    for key in (KEYS[0], KEYS[0], KEYS[1]):
        resp = create(server, SMALL, auth(key))
        assert resp.status_code == 200, resp.text
        ids.append((resp.json()["id"], key))
    refused = create(server, SMALL, auth(KEYS[1]))  # under its key's quota, over the server's
    assert refused.status_code == 429, refused.text
    message = refused.json()["error"]["message"]
    assert "(LENS_EVALS_MAX_HOOK_SETS)" in message and "3 live" in message and "DELETE /lens/hook_sets/{id}" in message, message
    assert complete(server, auth()).status_code == 200  # plain completions go on
    assert complete(server, auth(), vllm_xargs=lens_xargs(hook_set=ids[0][0])).status_code == 200  # and the sets work
    set_id, key = ids.pop(0)
    assert requests.delete(f"{url}/{set_id}", headers=auth(key), timeout=60).status_code == 200
    again = create(server, SMALL, auth(KEYS[1]))
    assert again.status_code == 200, again.text
    ids.append((again.json()["id"], KEYS[1]))
    assert create(server, SMALL, auth(KEYS[0])).status_code == 429
    for set_id, key in ids:
        assert requests.delete(f"{url}/{set_id}", headers=auth(key), timeout=60).status_code == 200


def test_size_bound_refuses_a_set_over_the_mib_bound(server) -> None:
    refused = create(server, BIG, auth())
    assert refused.status_code == 429, refused.text
    message = refused.json()["error"]["message"]
    assert "LENS_EVALS_MAX_HOOK_SET_MIB" in message and "DELETE /lens/hook_sets/{id}" in message, message
    made = create(server, SMALL, auth())  # a small one still fits, and nothing was left behind
    assert made.status_code == 200, made.text
    assert requests.delete(f"{server.url}/lens/hook_sets/{made.json()['id']}", headers=auth(), timeout=60).status_code == 200
    assert complete(server, auth()).status_code == 200


def delete(server, set_id: str, key: str = KEYS[0]) -> requests.Response:
    return requests.delete(f"{server.url}/lens/hook_sets/{set_id}", headers=auth(key), timeout=60)


def test_the_operators_middleware_and_cors_run_before_the_lens_routes(server) -> None:
    """Before #40 the lens middleware was outermost: it answered /lens and /v1/hooks before the
    operator's --middleware or CORS saw them (a blocked path still made sets; no CORS headers)."""
    made = create(server, SMALL, auth())
    assert made.status_code == 200 and made.headers.get(SAW_HEADER) == "/lens/hook_sets", (made.text, made.headers)
    blocked = requests.post(f"{server.url}/lens/hook_sets", json=hook_set_body(SMALL), headers={**auth(), BLOCK_HEADER: "1"}, timeout=60)
    assert blocked.status_code == 403 and blocked.json() == {"blocked_by_operator": "/lens/hook_sets"}, blocked.text
    hooks = requests.post(f"{server.url}/v1/hooks/register", json=hook_set_body(SMALL), headers=auth(), timeout=60)
    assert hooks.status_code == 200, hooks.text  # the blocked create made no set: this key's second slot was free
    assert hooks.headers.get(SAW_HEADER) == "/v1/hooks/register", hooks.headers
    preflight = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization,content-type"}
    good = requests.options(f"{server.url}/lens/hook_sets", headers={"Origin": GOOD_ORIGIN, **preflight}, timeout=60)
    assert good.status_code == 200 and good.headers.get("access-control-allow-origin") == GOOD_ORIGIN, (good.status_code, good.headers)
    evil = requests.options(f"{server.url}/lens/hook_sets", headers={"Origin": EVIL_ORIGIN, **preflight}, timeout=60)
    assert evil.status_code == 400 and "access-control-allow-origin" not in evil.headers, (evil.status_code, evil.headers)
    collected = requests.post(
        f"{server.url}/lens/hook_sets/{made.json()['id']}/collect", json={}, headers={**auth(), "Origin": GOOD_ORIGIN}, timeout=60
    )
    assert collected.status_code == 200 and collected.headers.get("access-control-allow-origin") == GOOD_ORIGIN, collected.headers
    assert delete(server, made.json()["id"]).status_code == 200
    cleared = requests.post(f"{server.url}/v1/hooks/clear", json={"id": hooks.json()["id"]}, headers=auth(), timeout=60)
    assert cleared.status_code == 200, cleared.text


def test_lens_routes_take_json_bodies_only(server) -> None:
    """A cross-origin "simple" request (text/plain, a form, no type) needs no CORS preflight: a
    browser sends it. Every lens POST refuses it with 415 and does nothing (before #40: 200)."""
    made = create(server, SMALL, auth())
    assert made.status_code == 200, made.text
    set_id = made.json()["id"]
    body = json.dumps(hook_set_body(SMALL))
    for content_type in [
        "text/plain",
        "text/plain;charset=UTF-8",
        "application/x-www-form-urlencoded",
        "multipart/form-data; boundary=x",
        None,
    ]:
        headers = {**auth(), **({"Content-Type": content_type} if content_type else {})}
        for path in ["/lens/hook_sets", f"/lens/hook_sets/{set_id}/collect", "/v1/hooks/register", "/v1/hooks/clear"]:
            resp = requests.post(
                f"{server.url}{path}",
                data=body if path.endswith(("sets", "register")) else json.dumps({"id": set_id}),
                headers=headers,
                timeout=60,
            )
            assert resp.status_code == 415, (path, content_type, resp.status_code, resp.text)
            assert "application/json" in resp.json()["error"]["message"], resp.text
    refused = requests.delete(
        f"{server.url}/lens/hook_sets/{set_id}", data="x", headers={**auth(), "Content-Type": "text/plain"}, timeout=60
    )
    assert refused.status_code == 415, refused.text
    utf8 = requests.post(
        f"{server.url}/lens/hook_sets/{set_id}/collect",
        data="{}",
        headers={**auth(), "Content-Type": "Application/JSON; charset=utf-8"},
        timeout=60,
    )
    assert utf8.status_code == 200, utf8.text  # the set is still there: nothing above touched it
    assert delete(server, set_id).status_code == 200
    both = [create(server, SMALL, auth()) for _ in range(2)]  # no text/plain create made a set: both slots are free
    assert [resp.status_code for resp in both] == [200, 200], [resp.text for resp in both]
    assert create(server, SMALL, auth()).status_code == 429
    for resp in both:
        assert delete(server, resp.json()["id"]).status_code == 200


def test_a_hook_set_belongs_to_the_key_that_made_it(server) -> None:
    """Another key finds no such set: its collect, delete and requests that name it fail as for
    an unknown id, and the set is untouched; each key holds at most 2 (the per-key quota) while
    the other key can still make one (before #40: any key could use, drain and delete it)."""
    url = f"{server.url}/lens/hook_sets"
    mine = create(server, SMALL, auth(KEYS[0])).json()["id"]
    assert complete(server, auth(KEYS[0]), vllm_xargs=lens_xargs(hook_set=mine)).status_code == 200
    other = auth(KEYS[1])
    used = complete(server, other, vllm_xargs=lens_xargs(hook_set=mine))
    assert used.status_code == 400 and "not registered" in used.json()["error"]["message"], used.text
    assert requests.post(f"{url}/{mine}/collect", json={}, headers=other, timeout=60).status_code == 404
    assert requests.delete(f"{url}/{mine}", headers=other, timeout=60).status_code == 404
    for action in ("collect", "clear_results", "clear"):
        resp = requests.post(f"{server.url}/v1/hooks/{action}", json={"id": mine}, headers=other, timeout=60)
        assert resp.status_code == 404, (action, resp.text)
    second = create(server, SMALL, auth(KEYS[0]))
    assert second.status_code == 200, second.text
    over = create(server, SMALL, auth(KEYS[0]))
    assert over.status_code == 429 and "(LENS_EVALS_MAX_HOOK_SETS_PER_KEY)" in over.json()["error"]["message"], over.text
    theirs = create(server, SMALL, other)
    assert theirs.status_code == 200, theirs.text  # the quota is per key: the other key still gets one
    collected = requests.post(f"{url}/{mine}/collect", json={}, headers=auth(KEYS[0]), timeout=60).json()
    assert len(collected["results"]) == 1  # the owner's request's result, nothing drained by the other key
    for set_id, key in [(mine, KEYS[0]), (second.json()["id"], KEYS[0]), (theirs.json()["id"], KEYS[1])]:
        assert delete(server, set_id, key).status_code == 200


def worker_holds(server, set_id: str) -> bool:
    """Whether the worker still holds the set (its clear reports it; the frontend keeps it)."""
    resp = requests.post(f"{server.url}/collective_rpc", json={"method": "lens_evals_clear_hook_set", "args": [set_id]}, timeout=60)
    assert resp.status_code == 200, resp.text
    return bool(resp.json()["results"] == ["True"])


def test_an_idle_hook_set_is_freed_with_its_worker_half(server) -> None:
    """A set neither used nor collected for LENS_EVALS_HOOK_SET_IDLE_S (10 s here) is gone at the
    next lens call, on the worker too, and its slot is free; a set used meanwhile stays (before
    #40 sets lived until deleted: one client could hold every slot for good)."""
    idle = create(server, SMALL, auth()).json()["id"]
    used = create(server, SMALL, auth()).json()["id"]
    started = time.monotonic()
    time.sleep(IDLE_S * 0.6)
    assert complete(server, auth(), vllm_xargs=lens_xargs(hook_set=used)).status_code == 200
    time.sleep(max(0.0, IDLE_S + 1.0 - (time.monotonic() - started)))
    gone = requests.post(f"{server.url}/lens/hook_sets/{idle}/collect", json={}, headers=auth(), timeout=60)
    assert gone.status_code == 404, gone.text
    assert not worker_holds(server, idle)
    kept = requests.post(f"{server.url}/lens/hook_sets/{used}/collect", json={}, headers=auth(), timeout=60)
    assert kept.status_code == 200 and len(kept.json()["results"]) == 1, kept.text
    assert worker_holds(server, used)  # (this cleared its worker half; the frontend's goes below)
    again = create(server, SMALL, auth())
    assert again.status_code == 200, again.text  # the expired set's slot (2 per key) is free
    for set_id in (used, again.json()["id"]):
        assert delete(server, set_id).status_code == 200


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
