"""Bad input, table-driven: every malformed lens request gets HTTP 400 with its reason (and the
same request offline raises ValueError) while a concurrent good capture completes with the same
activations as offline and the server stays up. Security: no pickle, no file serving, size caps."""

from __future__ import annotations

import base64
import json
import os
import pickle
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import requests
import torch

from lens_evals import Hook, LinearProbe, SteeringVector
from lens_evals.client import activations_from_response, lens_xargs
from lens_evals.inspect_kit.provider.server import LensServer
from lens_evals.wire import formats as wire
from tests.conftest import capture, greedy, lens_server, make_llm
from tests.tolerance import assert_stream_close

PROMPT = "the cat reads a book."
LAYERS = [0, 3]
HIDDEN = 128
# Small per-request cap so "capture too large" is reachable on the tiny model: 4 layers x 1024
# positions x 128 x 4 B = 2 MiB is refused, the good request (2 x ~210 x 128 x 4 B) passes.
CAP_GIB = "0.0005"
TRIED = {"http": 0, "offline": 0}


def steer(**fields: Any) -> str:
    base = {"activations": [[1.0] * HIDDEN], "layer_indices": [0]}
    return json.dumps({**base, **fields})


def hook(name: str, **args: Any) -> str:
    return Hook(name, [0], args=args).to_json()


def probe(**fields: Any) -> str:
    base = {"name": "p", "layer": 0, "weights": wire.encode_array(np.ones(HIDDEN, np.float32))}
    return json.dumps({**base, **fields})


def encoded(raw: bytes) -> dict[str, str]:
    return {"encoding": wire.ENCODING, "data": base64.b64encode(raw).decode()}


def safetensors_raw(dtype: str, body: bytes, shape: list[int] | None = None, offsets: Any = None) -> bytes:
    offsets = [0, len(body)] if offsets is None else offsets
    header = json.dumps({"tensor": {"dtype": dtype, "shape": shape or [1, len(body)], "data_offsets": offsets}}).encode()
    return len(header).to_bytes(8, "little") + header + body


VALID = wire.encode_array(np.ones((1, HIDDEN), np.float32))
PICKLE = pickle.dumps({"canary": "lens-evals-pickle-canary"})  # tests/scripts/pickle_canary watches for it
CANARY_DIR = Path(__file__).parents[1] / "scripts" / "pickle_canary"

# name -> (vllm_xargs, other body fields, expected substring in the message)
BAD: dict[str, tuple[dict[str, Any], dict[str, Any], str]] = {
    # capture layers
    "capture layer out of range": ({"output_residual_stream": [7]}, {}, "out of range"),
    "capture layer negative": ({"output_residual_stream": [-1]}, {}, "negative"),
    "capture layers duplicated": ({"output_residual_stream": [0, 0]}, {}, "duplicate layers"),
    "capture layers empty": ({"output_residual_stream": []}, {}, "at least one layer"),
    "capture layer as a non-JSON string": ({"output_residual_stream": "three"}, {}, "string is not valid JSON"),
    "capture layer as float": ({"output_residual_stream": 1.5}, {}, "list of layer indices"),
    "capture layer list of strings": ({"output_residual_stream": ["a"]}, {}, "must be integers"),
    "capture layer list of floats": ({"output_residual_stream": [0.5]}, {}, "must be integers"),
    "capture huge layer list": ({"output_residual_stream": list(range(5000))}, {}, "too many layers"),
    "capture JSON nested too deeply": ({"output_residual_stream": "[" * 100_000 + "]" * 100_000}, {}, "nested too deeply"),
    "capture 100 layers": ({"output_residual_stream": list(range(100))}, {}, "out of range"),
    "capture over per-request cap": ({"output_residual_stream": [0, 1, 2, 3]}, {"max_tokens": 1000}, "per-request limit"),
    "capture with n=2": ({"output_residual_stream": [0]}, {"n": 2, "temperature": 1.0}, "need n=1"),
    # steering vectors
    "steer wrong hidden size": ({"apply_steering_vectors": [steer(activations=[[1.0] * 64])]}, {}, "hidden size 64"),
    "steer oversize vector": (
        {"apply_steering_vectors": [steer(activations=wire.encode_array(np.ones((1, 200_000), np.float32)))]},
        {},
        "that a steering vector (4 layers x 11 positions x 128) may",  # refused before it is decoded
    ),
    "steer NaN": ({"apply_steering_vectors": ['{"activations": [[NaN]], "layer_indices": [0]}']}, {}, "NaN or inf"),
    "steer inf": ({"apply_steering_vectors": [steer(activations=[[float("inf")] * HIDDEN])]}, {}, "NaN or inf"),
    "steer int beyond float": (
        {"apply_steering_vectors": ['{"activations": [[' + "9" * 400 + ']], "layer_indices": [0]}']},
        {},
        "numeric array",
    ),
    "steer position out of range": (
        {"apply_steering_vectors": [steer(activations=[[[1.0] * HIDDEN]], position_indices=[999])]},
        {},
        "position 999 out of range",
    ),
    "steer position negative": (
        {"apply_steering_vectors": [steer(activations=[[[1.0] * HIDDEN]], position_indices=[-2])]},
        {},
        "must be >= 0",
    ),
    "steer positions duplicated": (
        {"apply_steering_vectors": [steer(activations=[[[1.0] * HIDDEN] * 2], position_indices=[1, 1])]},
        {},
        "duplicates",
    ),
    "steer layers duplicated": (
        {"apply_steering_vectors": [steer(activations=[[1.0] * HIDDEN] * 2, layer_indices=[1, 1])]},
        {},
        "duplicates",
    ),
    "steer layer out of range": ({"apply_steering_vectors": [steer(layer_indices=[9])]}, {}, "layer 9 out of range"),
    "steer layer indices empty": ({"apply_steering_vectors": [steer(layer_indices=[])]}, {}, "must not be empty"),
    "steer layer indices missing": ({"apply_steering_vectors": ['{"activations": [[1.0]]}']}, {}, "layer_indices"),
    "steer layer rows mismatch": ({"apply_steering_vectors": [steer(activations=[[1.0] * HIDDEN] * 2)]}, {}, "2 layer rows"),
    "steer 1-D activations": ({"apply_steering_vectors": [steer(activations=[1.0] * HIDDEN)]}, {}, "got shape (128,)"),
    "steer 4-D activations": (
        {"apply_steering_vectors": [steer(activations=[[[[1.0] * HIDDEN]]], position_indices=[0])]},
        {},
        "got shape (1, 1, 1, 128)",
    ),
    # 3-D without positions means positions 0..n-1 (vllm-lens's rule): 1500 of them do not fit the request
    "steer 3-D without positions, too many": (
        {"apply_steering_vectors": [steer(activations=[[[1.0] * HIDDEN] * 1500])]},
        {},
        "out of range: this request has at most",
    ),
    "steer scale NaN": ({"apply_steering_vectors": [steer(scale=float("nan"))]}, {}, "must be finite"),
    "steer scale beyond float32": ({"apply_steering_vectors": [steer(scale=1e39)]}, {}, "must be finite in float32"),
    "steer norm_match scale beyond float32": ({"apply_steering_vectors": [steer(scale=1e39, norm_match=True)]}, {}, "finite in float32"),
    "steer scale x vector overflows": (
        {"apply_steering_vectors": [steer(activations=[[2.0] * HIDDEN], scale=3e38)]},
        {},
        "scale x activations is not finite in float32",
    ),
    "steer scale string": ({"apply_steering_vectors": [steer(scale="big")]}, {}, "scale"),
    "steer norm_match zero vector": ({"apply_steering_vectors": [steer(activations=[[0.0] * HIDDEN], norm_match=True)]}, {}, "non-zero"),
    "steer unknown field": ({"apply_steering_vectors": [steer(code="__import__('os')")]}, {}, "unknown steering vector fields"),
    "steer not JSON": ({"apply_steering_vectors": ["{oops"]}, {}, "not valid JSON"),
    "steer JSON nested too deeply": (
        {"apply_steering_vectors": ['{"activations": ' + "[" * 100_000 + "]" * 100_000 + "}"]},
        {},
        "nested too deeply",
    ),
    "steer JSON list": ({"apply_steering_vectors": ["[1, 2]"]}, {}, "must be an object"),
    "steer key a number": ({"apply_steering_vectors": 5}, {}, "must be a list"),
    # wire payloads
    "wire bogus base64": (
        {"apply_steering_vectors": [steer(activations={"encoding": wire.ENCODING, "data": "!!"})]},
        {},
        "not valid base64",
    ),
    "wire truncated base64": (
        {"apply_steering_vectors": [steer(activations={**VALID, "data": VALID["data"][:-3]})]},
        {},
        "not valid base64",
    ),
    "wire truncated payload": ({"apply_steering_vectors": [steer(activations={**VALID, "data": VALID["data"][:-200]})]}, {}, "truncated"),
    "wire random bytes": ({"apply_steering_vectors": [steer(activations=encoded(bytes(range(256))))]}, {}, "truncated"),
    "wire unknown encoding": (
        {"apply_steering_vectors": [steer(activations={**VALID, "encoding": "pickle"})]},
        {},
        "unknown tensor encoding",
    ),
    "wire data missing": ({"apply_steering_vectors": [steer(activations={"encoding": wire.ENCODING})]}, {}, "no 'data' string"),
    "wire dtype int64": (
        {"apply_steering_vectors": [steer(activations=encoded(safetensors_raw("I64", bytes(8 * HIDDEN), [1, HIDDEN])))]},
        {},
        "not allowed",
    ),
    "wire dtype bogus string": (
        {"apply_steering_vectors": [steer(activations=encoded(safetensors_raw("float128x", bytes(16))))]},
        {},
        "not allowed",
    ),
    "wire dtype object (pickle body)": (
        {"apply_steering_vectors": [steer(activations=encoded(safetensors_raw("object", PICKLE)))]},
        {},
        "not allowed",
    ),
    "wire raw pickle bytes": ({"apply_steering_vectors": [steer(activations=encoded(PICKLE))]}, {}, "truncated"),
    "wire offsets not integers": (
        {"apply_steering_vectors": [steer(activations=encoded(safetensors_raw("F32", bytes(8), [2], offsets="0-8")))]},
        {},
        "data_offsets",
    ),
    # probes
    "probe hidden size": (
        {"output_probe_scores": [LinearProbe(name="p", layer=0, weights=np.ones(64)).to_json()]},
        {},
        "weights length 64",
    ),
    "probe layer out of range": ({"output_probe_scores": [probe(layer=4)]}, {}, "layer 4 out of range"),
    "probe layer negative": ({"output_probe_scores": [probe(layer=-1)]}, {}, "greater than or equal to 0"),
    "probe layer as string": ({"output_probe_scores": [probe(layer="0")]}, {}, "layer"),
    "probe NaN": ({"output_probe_scores": [probe(weights=[float("nan")] * HIDDEN)]}, {}, "NaN or inf"),
    "probe bias inf": ({"output_probe_scores": [probe(bias=float("inf"))]}, {}, "must be finite"),
    "probe weights 2-D": ({"output_probe_scores": [probe(weights=[[1.0] * HIDDEN])]}, {}, "1-D array"),
    "probe names duplicated": ({"output_probe_scores": [probe(), probe()]}, {}, "unique per request"),
    "probe empty name": ({"output_probe_scores": [probe(name=" ")]}, {}, "must not be empty"),
    "probe not JSON": ({"output_probe_scores": ["{oops"]}, {}, "probe string is not valid JSON"),
    "probe unknown field": ({"output_probe_scores": [probe(code="import os")]}, {}, "unknown probe fields"),
    # hooks' args: bounded by the request's positions (~12 here) and the model's hidden size
    "hook add 100k positions": (
        {"apply_hooks": [hook("add", vector=[1.0] * HIDDEN, positions=list(range(100_000)))]},
        {},
        "100000 positions, more than the",
    ),
    "hook position out of range": ({"apply_hooks": [hook("record", positions=[0, 50])]}, {}, "position 50 out of range"),
    "hook positions duplicated": ({"apply_hooks": [hook("add", vector=[1.0] * HIDDEN, positions=[1, 1])]}, {}, "positions has duplicates"),
    "hook position negative": ({"apply_hooks": [hook("patch", values=[[1.0] * HIDDEN], positions=[-1])]}, {}, "positions must be >= 0"),
    "hook add vector width": ({"apply_hooks": [hook("add", vector=[1.0] * 64)]}, {}, "vector must be (128,), got shape (64,)"),
    "hook add vector rows": (
        {"apply_hooks": [hook("add", vector=[[1.0] * HIDDEN] * 3, positions=[0, 1])]},
        {},
        "vector must be (128,) or (2, 128), got shape (3, 128)",
    ),
    "hook add scale x vector overflows": (
        {"apply_hooks": [hook("add", vector=[2.0] * HIDDEN, scale=3e38)]},
        {},
        "scale x vector is not finite in float32",
    ),
    "hook patch values width": ({"apply_hooks": [hook("patch", values=[[1.0] * 64], positions=[0])]}, {}, "values must be (1, 128)"),
    "hook patch values inf": (
        {"apply_hooks": [hook("patch", values=np.full((1, HIDDEN), np.inf, np.float32), positions=[0])]},
        {},
        "values contains NaN or inf",
    ),
    "hook ablate column out of range": ({"apply_hooks": [hook("ablate", indices=[HIDDEN])]}, {}, "index 128 out of range"),
    "hook logit_lens token out of range": ({"apply_hooks": [hook("logit_lens", token_ids=[10**6])]}, {}, "token id 1000000 out of range"),
    # keys
    "reserved internal key": ({"_lens_evals": "x"}, {}, "reserved"),
    "misspelled capture key": ({"output_residual_streams": [0]}, {}, "did you mean 'output_residual_stream'"),
    "misspelled steering key": ({"apply_steering_vector": [steer()]}, {}, "did you mean 'apply_steering_vectors'"),
}


@pytest.fixture(scope="module")
def canary_log(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("canary") / "unpickled.log"


def canary_env(log: Path) -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(CANARY_DIR), os.environ.get("PYTHONPATH", "")) if p)
    return {"PYTHONPATH": path, "LENS_EVALS_PICKLE_CANARY_LOG": str(log)}


@pytest.fixture(scope="module")
def server(tiny_path, canary_log):
    with lens_server(tiny_path, env={"LENS_EVALS_MAX_CAPTURE_GIB": CAP_GIB, **canary_env(canary_log)}) as proc:
        yield proc


def complete(server: LensServer, **body: Any) -> requests.Response:
    payload = {"model": "test", "prompt": PROMPT, "max_tokens": 6, "temperature": 0, "ignore_eos": True, **body}
    return requests.post(f"{server.url}/v1/completions", json=payload, timeout=300)


def test_every_bad_request_gets_400_while_a_good_capture_completes(server, llm) -> None:
    result: dict[str, requests.Response] = {}
    good = threading.Thread(target=lambda: result.setdefault("resp", complete(server, max_tokens=200, vllm_xargs=lens_xargs(LAYERS))))
    good.start()
    failures = []
    for name, (xargs, body, message) in BAD.items():
        resp = complete(server, vllm_xargs=xargs, **body)
        TRIED["http"] += 1
        if resp.status_code != 400 or message not in resp.json()["error"]["message"]:
            failures.append(f"{name}: {resp.status_code} {resp.text[:300]}")
    good.join(timeout=600)
    print(f"\nbad requests over HTTP: {TRIED['http']} tried, {TRIED['http'] - len(failures)} refused with 400 and the reason")
    assert not failures, "\n".join(failures)
    resp = result["resp"]
    assert resp.status_code == 200, resp.text
    got = torch.from_numpy(activations_from_response(resp.json())["residual_stream"])
    token_ids = llm.get_tokenizer()(PROMPT).input_ids
    reference = llm.generate([PROMPT], greedy(200, output_residual_stream=LAYERS))[0]
    assert got.shape[1] == len(token_ids) + 199
    assert_stream_close(got, capture(reference), "capture over HTTP beside bad requests vs offline")
    assert requests.get(f"{server.url}/health", timeout=10).status_code == 200


def test_every_bad_request_raises_value_error_offline(llm, monkeypatch) -> None:
    """The same table through LLM.generate (vllm_xargs become extra_args as they are)."""
    from vllm import SamplingParams

    monkeypatch.setenv("LENS_EVALS_MAX_CAPTURE_GIB", CAP_GIB)
    failures = []
    for name, (xargs, body, message) in BAD.items():
        params = SamplingParams(
            max_tokens=body.get("max_tokens", 6), n=body.get("n", 1), temperature=body.get("temperature", 0.0), extra_args=dict(xargs)
        )
        TRIED["offline"] += 1
        try:
            llm.generate([PROMPT], params, use_tqdm=False)
            failures.append(f"{name}: accepted")
        except ValueError as exc:
            if message not in str(exc):
                failures.append(f"{name}: {exc}")
    print(f"\nbad requests offline: {TRIED['offline']} tried, {TRIED['offline'] - len(failures)} raised ValueError with the reason")
    assert not failures, "\n".join(failures)
    out = llm.generate([PROMPT], greedy(4, output_residual_stream=[1]), use_tqdm=False)[0]
    assert capture(out).shape == (1, len(out.prompt_token_ids) + 3, HIDDEN)  # the engine goes on


# ----------------------------------------------------------------- security
@pytest.mark.parametrize(
    "path",
    [
        "/../../etc/passwd",
        "/%2e%2e/%2e%2e/etc/passwd",
        "/static/../../etc/passwd",
        "/static/index.html",
        "/etc/passwd",
        "/v1/../../../etc/passwd",
        "/favicon.ico",
    ],
)
def test_no_endpoint_serves_files(server, path) -> None:
    resp = requests.get(server.url + path, timeout=30)
    assert resp.status_code in (404, 405), f"{path}: {resp.status_code}"
    assert "root:" not in resp.text


def test_pickle_payloads_never_reach_pickle(server, canary_log, monkeypatch) -> None:
    """Object-dtype and raw-pickle payloads are refused by the header check, before safetensors or
    numpy see them. Here a patched pickle.loads would raise; in the server (and its engine
    process) tests/scripts/pickle_canary logs any unpickling of the payload's canary bytes."""

    def forbidden(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("pickle.loads called on request data")

    monkeypatch.setattr(pickle, "loads", forbidden)
    for name in ("wire dtype object (pickle body)", "wire raw pickle bytes"):
        xargs, _, message = BAD[name]
        with pytest.raises(ValueError, match=message):
            SteeringVector.from_wire(xargs["apply_steering_vectors"][0])
        resp = complete(server, vllm_xargs=xargs)
        assert resp.status_code == 400 and message in resp.text
    assert not canary_log.exists(), f"the server unpickled request data (pids {canary_log.read_text().split()})"
    monkeypatch.undo()
    # The canary works: a process with the same environment that unpickles the payload is caught.
    control = canary_log.with_name("control.log")
    code = "import pickle, sys; pickle.loads(bytes.fromhex(sys.argv[1]))"
    subprocess.run([sys.executable, "-c", code, PICKLE.hex()], env={**os.environ, **canary_env(control)}, check=True, timeout=60)
    assert control.read_text().split() != []


def test_total_held_capture_bound_is_a_clear_error(tiny_path, monkeypatch) -> None:
    """LENS_EVALS_MAX_HELD_CAPTURE_GIB bounds what the worker holds in total: a capture that would
    pass it fails loudly (LensRequestError with the variable's name), its neighbours complete and
    nothing stays held."""
    from lens_evals.engine.frontend.attach import LensRequestError

    monkeypatch.setenv("LENS_EVALS_MAX_HELD_CAPTURE_GIB", "0.0001")  # ~105 KB; read when the worker starts
    # no hand-off: the rows stay with the worker until the fetch (an in-process frontend's pool,
    # bounded by LENS_EVALS_HANDOFF_POOL_MIB, would take them as they stream, as another
    # process's does; a pool made by an earlier engine in this process keeps its segments)
    monkeypatch.setenv("LENS_EVALS_HANDOFF", "0")
    with make_llm(tiny_path) as engine:
        params = [greedy(60, output_residual_stream=[0, 1, 2, 3]), greedy(60), greedy(3, output_residual_stream=[0])]
        with pytest.raises(LensRequestError, match="LENS_EVALS_MAX_HELD_CAPTURE_GIB") as info:
            engine.generate([PROMPT] * 3, params, use_tqdm=False)
        assert len(info.value.outputs[1].outputs[0].token_ids) == 60  # the plain neighbour completed
        small = engine.generate([PROMPT], greedy(3, output_residual_stream=[0]), use_tqdm=False)[0]
        assert capture(small).shape[0] == 1
        assert engine.collective_rpc("lens_evals_memory")[0]["held_bytes"] == 0
