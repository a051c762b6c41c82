"""Issue #19 over HTTP, on one bfloat16 server with an API key: vllm-lens's request forms and
wire format beside ours (bf16 stays bf16 in every encoding), bad input in their forms (malformed
layer string, wrong dtype, truncated zstd frame, zip bombs, cloudpickled hooks) answered 400
while concurrent good requests finish, activations as a final SSE chunk of a stream,
``/v1/hooks/*`` on our hook sets (opt-in by id), and ``lens_evals.client.LensClient``."""

from __future__ import annotations

import base64
import json
import re
import threading
import time
from typing import Any

import pytest
import requests
import torch
import zstandard

from benchmarks.checks import common_prefix
from lens_evals.client import LensClient, activations_from_response, decode_activations, lens_xargs, serialize_tensor
from lens_evals.request.hooks import Hook
from lens_evals.request.spec import SteeringVector
from lens_evals.wire import formats as wire
from lens_evals.wire import frame as wire_frame
from tests.conftest import gpu_share
from tests.test_vllm_lens_names import read_their_tensor
from tests.tolerance import assert_stream_close

KEY = "compat-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPT = "the cat reads a book."
MESSAGES = [{"role": "user", "content": "a model finds the truth."}]
STEER = SteeringVector(activations=torch.randn(1, 128, generator=torch.Generator().manual_seed(5)) * 4, layer_indices=[1])
BF16_BOUND = 2e-2  # bf16 numerics of the same request in another batch composition
MIN_SAME_TOKENS = 8  # generated tokens that must agree with the request alone before any near-tie flips


@pytest.fixture(scope="module")
def server(tiny_path):
    from lens_evals.inspect_kit.provider.server import LensServer

    args: dict[str, Any] = {"dtype": "bfloat16", "max_model_len": 1024, "seed": 0, "api_key": [KEY], **gpu_share()}
    proc = LensServer(str(tiny_path), served_name="test", server_args=args).start()
    try:
        yield proc
    finally:
        proc.stop()


def post(server, path: str, body: dict[str, Any], headers: dict[str, str] = AUTH) -> requests.Response:
    return requests.post(f"{server.url}{path}", json=body, headers=headers, timeout=300)


def complete(server, xargs: dict[str, Any] | None = None, **body: Any) -> requests.Response:
    payload = {"model": "test", "prompt": PROMPT, "max_tokens": 6, "temperature": 0, "ignore_eos": True, **body}
    if xargs:
        payload["vllm_xargs"] = xargs
    return post(server, "/v1/completions", payload)


def body_of(resp: requests.Response) -> Any:
    """A response's body: JSON, or a frame unframed (checked by its content type)."""
    return wire_frame.response_body(resp.content, resp.headers.get("content-type"))


def stream_of(resp: requests.Response) -> torch.Tensor:
    assert resp.status_code == 200, resp.text
    return decode_activations(body_of(resp))["residual_stream"]


def generated_ids(resp: requests.Response) -> list[int]:
    return list(resp.json()["choices"][0]["token_ids"])


def test_every_encoding_carries_bf16_unchanged(server) -> None:
    default = complete(server, {"output_residual_stream": [0, 3]})
    assert set(default.json()["activations"]["residual_stream"]) == set(wire.encode_array(torch.ones(1), wire.DEFAULT_RESPONSE_ENCODING))
    reference = stream_of(default)
    assert reference.dtype == torch.bfloat16 and reference.shape[0] == 2 and reference.shape[2] == 128
    for encoding in wire.RESPONSE_ENCODINGS:
        resp = complete(server, {"output_residual_stream": "[0, 3]", "activations_encoding": encoding})
        assert torch.equal(stream_of(resp), reference), encoding
        assert (activations_from_response(body_of(resp))["residual_stream"] == reference.float().numpy()).all()
        assert wire_frame.is_frame(resp.headers["content-type"]) == (encoding == wire.SAFETENSORS_FRAME), encoding
    theirs = complete(server, {"output_residual_stream": "[0, 3]", "activations_encoding": "vllm-lens"}).json()
    assert theirs["activations"]["residual_stream"]["original_dtype"] == "torch.bfloat16"
    every = stream_of(complete(server, {"output_residual_stream": "true"}))
    assert every.shape[0] == 4 and torch.equal(every[[0, 3]], reference)


def test_an_unmodified_vllm_lens_client_reads_our_responses(server) -> None:
    """Issue #43: their client's request (``vllm_xargs`` as JSON strings, no encoding named) gets
    its activations, hook results and a stream's last event in their form, read here by a reader
    of their documented format, equal to what our own frame carries."""
    their_xargs = {"output_residual_stream": json.dumps([1, 2]), "apply_hooks": json.dumps([Hook("record_norm", [2]).model_dump()])}
    theirs = complete(server, their_xargs)
    assert theirs.status_code == 200, theirs.text
    body = theirs.json()
    stream = read_their_tensor(body["activations"]["residual_stream"])
    norms = body["hook_results"]["0"]["norm.2"]
    assert norms["__type__"] == "tensor" and body["activations"]["saved"]["norm.2"]["__type__"] == "tensor"
    framed = decode_activations(body_of(complete(server, {**their_xargs, "activations_encoding": wire.SAFETENSORS_FRAME})))
    assert stream.dtype == torch.bfloat16 and torch.equal(stream, framed["residual_stream"])
    assert torch.equal(read_their_tensor(norms), framed["saved"]["norm.2"])
    chat = {"model": "test", "messages": MESSAGES, "max_tokens": 4, "temperature": 0, "ignore_eos": True, "vllm_xargs": their_xargs}
    whole = read_their_tensor(post(server, "/v1/chat/completions", chat).json()["activations"]["residual_stream"])
    with requests.post(f"{server.url}/v1/chat/completions", json={**chat, "stream": True}, headers=AUTH, stream=True, timeout=300) as resp:
        events = [line.removeprefix(b"data: ") for line in resp.iter_lines() if line.startswith(b"data: ")]
    last = json.loads(events[-2])
    assert events[-1] == b"[DONE]" and last["hook_results"]["0"]["norm.2"]["__type__"] == "tensor"
    assert_stream_close(read_their_tensor(last["activations"]["residual_stream"]).float(), whole.float(), "their stream vs whole")


def test_vllm_lens_request_forms_equal_ours(server) -> None:
    ours = complete(server, lens_xargs([1], steering=[STEER]), return_token_ids=True)
    their_vector = {
        "activations": serialize_tensor(STEER.activations),
        "layer_indices": [1],
        "scale": 1.0,
        "norm_match": False,
        "position_indices": None,
    }
    theirs = complete(
        server, {"output_residual_stream": json.dumps([1]), "apply_steering_vectors": json.dumps([their_vector])}, return_token_ids=True
    )
    assert theirs.json()["choices"][0]["token_ids"] == ours.json()["choices"][0]["token_ids"]
    assert torch.equal(stream_of(theirs), stream_of(ours))
    plain = stream_of(complete(server, {"output_residual_stream": [1]}))
    # the reference: layer 1's prompt rows (the same input tokens in both runs) are plain + scale * v
    n_prompt = plain.shape[1] - 6 + 1
    reference = plain[0, :n_prompt].float() + STEER.activations[0]
    assert_stream_close(stream_of(ours)[0, :n_prompt].float(), reference, "steered vs plain + v", bound=BF16_BOUND)


def _frame(data: bytes) -> str:
    return base64.b64encode(zstandard.ZstdCompressor().compress(data)).decode()


def _steer_with(payload: dict[str, Any]) -> dict[str, Any]:
    return {"apply_steering_vectors": json.dumps([{"activations": payload, "layer_indices": [1]}])}


VECTOR = torch.ones(1, 128).numpy().tobytes()
ATTEMPTS = 3  # rounds of good requests beside the bad ones (see the test that sends them)
BAD_FORMS = {
    "malformed layer string": ({"output_residual_stream": "[1, 2"}, "output_residual_stream string is not valid JSON"),
    "wrong dtype": (
        _steer_with(
            {"data": _frame(VECTOR), "dtype": "int16", "original_dtype": "torch.float32", "shape": [1, 128], "compression": "zstd"}
        ),
        "does not match the storage dtype",
    ),
    "truncated zstd frame": (
        _steer_with(
            {
                "data": base64.b64encode(base64.b64decode(_frame(VECTOR))[:-5]).decode(),
                "dtype": "float32",
                "shape": [1, 128],
                "compression": "zstd",
            }
        ),
        "truncated",
    ),
    "zip bomb (frame declares 16 MiB)": (  # small enough encoded (~700 characters) to reach the frame's check
        _steer_with({"data": _frame(bytes(16 * 2**20)), "dtype": "float32", "shape": [1, 128], "compression": "zstd"}),
        "refused before inflating",
    ),
    "zip bomb (shape over the bound)": (
        _steer_with({"data": _frame(VECTOR), "dtype": "float32", "shape": [2**20, 2**20], "compression": "zstd"}),
        "refused before decoding",
    ),
    "cloudpickled hook": (
        {"apply_hooks": json.dumps([{"fn": {"cloudpickle": "gASVAAAA"}, "layer_indices": [0]}])},
        "never runs code sent over the network",
    ),
    "unknown encoding": ({"output_residual_stream": [0], "activations_encoding": "pickle"}, "activations_encoding must be one of"),
}


def running_requests(server) -> int:
    """The engine's ``vllm:num_requests_running`` gauge, summed over engines, from ``/metrics``."""
    text = requests.get(f"{server.url}/metrics", headers=AUTH, timeout=30).text
    return int(sum(float(n) for n in re.findall(r"^vllm:num_requests_running\{[^}]*\} (\S+)$", text, re.MULTILINE)))


def test_bad_input_in_their_forms_is_400_while_good_requests_finish(server) -> None:
    prompts = ["the cat reads a book.", "a model finds the truth.", "my friend"]
    n_tokens = 400  # long enough that every bad request is answered while the good ones decode
    alone = [complete(server, {"output_residual_stream": [2]}, prompt=p, max_tokens=n_tokens, return_token_ids=True) for p in prompts]
    baseline = [stream_of(resp) for resp in alone]
    results: dict[int, requests.Response] = {}

    def good(i: int) -> None:
        results[i] = complete(server, {"output_residual_stream": "[2]"}, prompt=prompts[i], max_tokens=n_tokens, return_token_ids=True)

    # On a loaded host the good requests may all end before the metrics show them running, or
    # before the last bad answer: that round proves nothing either way and runs again. An engine
    # that holds the bad answers back until the good requests end fails every round.
    ended_first: list[list[int]] = []
    for _ in range(ATTEMPTS):
        results.clear()
        threads = [threading.Thread(target=good, args=(i,)) for i in range(len(prompts))]
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + 60
        while running_requests(server) < len(prompts) and not results:  # every good request admitted and decoding
            assert time.monotonic() < deadline, "good requests never all ran"
            time.sleep(0.01)
        for name, (xargs, message) in BAD_FORMS.items():
            resp = complete(server, xargs)
            assert resp.status_code == 400, f"{name}: {resp.status_code} {resp.text}"
            assert message in resp.json()["error"]["message"], f"{name}: {resp.text}"
        # the bad requests were answered while the good ones were still in flight
        in_flight = not results and running_requests(server) == len(prompts)
        for thread in threads:
            thread.join(timeout=300)
        if in_flight:
            break
        ended_first.append(sorted(results))
    else:
        raise AssertionError(f"in each of {ATTEMPTS} rounds good requests ended before the bad ones: {ended_first}")
    for i, expected in enumerate(baseline):
        got = stream_of(results[i])
        assert got.shape == expected.shape and got.shape[0] == 1
        ids, ids_alone = generated_ids(results[i]), generated_ids(alone[i])
        assert len(ids) == len(ids_alone) == n_tokens
        # rows (axis 1) up to the first generated token that differs: in bf16 a near-tie greedy token
        # of the random model may flip in another batch composition, and every later row reads other
        # input. Row t reads token (prompt + completion)[t]: prompt rows plus ``same`` completion rows.
        same = common_prefix(ids_alone, ids)
        assert same >= MIN_SAME_TOKENS, (
            f"good request {i}: tokens differ from alone at {same}: {ids[: same + 1]} vs {ids_alone[: same + 1]}"
        )
        rows = expected.shape[1] - n_tokens + 1 + same
        assert_stream_close(got[:, :rows].float(), expected[:, :rows].float(), f"good request {i} beside bad ones", bound=BF16_BOUND)
    assert requests.get(f"{server.url}/health", timeout=5).status_code == 200


def test_streaming_chat_ends_with_an_activations_chunk(server) -> None:
    body = {
        "model": "test",
        "messages": MESSAGES,
        "max_tokens": 5,
        "temperature": 0,
        "ignore_eos": True,
        "vllm_xargs": {"output_residual_stream": [1, 2], "apply_hooks": [Hook("record_norm", [2]).to_json()]},
    }
    whole = post(server, "/v1/chat/completions", body).json()
    # a frame carries the hooks' results too; a stream asking for one gets its chunk as JSON
    body["vllm_xargs"]["activations_encoding"] = wire.SAFETENSORS_FRAME
    framed = post(server, "/v1/chat/completions", body)
    assert wire_frame.is_frame(framed.headers["content-type"]) and framed.content.startswith(wire_frame.MAGIC)
    framed_activations = decode_activations(body_of(framed))
    assert torch.equal(framed_activations["saved"]["norm.2"], decode_activations(whole)["saved"]["norm.2"])
    assert_stream_close(
        framed_activations["residual_stream"].float(), decode_activations(whole)["residual_stream"].float(), "frame vs JSON"
    )
    with requests.post(f"{server.url}/v1/chat/completions", json={**body, "stream": True}, headers=AUTH, stream=True, timeout=300) as resp:
        assert resp.status_code == 200
        events = [line.removeprefix(b"data: ") for line in resp.iter_lines() if line.startswith(b"data: ")]
    assert events[-1] == b"[DONE]"
    last = json.loads(events[-2])
    assert set(last) == {"activations", "hook_results"}
    assert isinstance(last["activations"]["residual_stream"]["data"], str)  # base64 in the JSON chunk
    assert all("activations" not in json.loads(event) for event in events[:-2])
    streamed = decode_activations(last)
    assert_stream_close(streamed["residual_stream"].float(), decode_activations(whole)["residual_stream"].float(), "stream vs whole")
    assert torch.equal(streamed["saved"]["norm.2"], decode_activations(whole)["saved"]["norm.2"])


def test_persistent_hooks_under_their_routes(server) -> None:
    pickled = {"hooks": [{"fn": {"cloudpickle": "gASVAAAA"}, "layer_indices": [0], "pre": False}]}
    refused = post(server, "/v1/hooks/register", pickled)
    assert refused.status_code == 400 and "LENS_EVALS_HOOKS=" in refused.json()["error"]["message"], refused.text
    assert post(server, "/v1/hooks/register", {"hooks": [Hook("record_norm", [1]).to_wire()]}, headers={}).status_code == 401
    for route in ("/v1/hooks/register", "/lens/hook_sets"):  # JSON deeper than the parser goes: 400, was 500
        deep = requests.post(
            f"{server.url}{route}",
            data='{"hooks": ' + "[" * 100_000 + "]" * 100_000 + "}",
            headers={**AUTH, "Content-Type": "application/json"},
            timeout=60,
        )
        assert deep.status_code == 400 and "nested too deeply" in deep.json()["error"]["message"], f"{route}: {deep.text[:300]}"
    made = post(server, "/v1/hooks/register", {"hooks": [Hook("record_norm", [1]).to_wire()]})
    assert made.status_code == 200 and made.json()["status"] == "ok" and made.json()["count"] == 1, made.text
    set_id = made.json()["id"]
    assert complete(server).status_code == 200  # does not opt in: not touched
    assert post(server, "/v1/hooks/collect", {"id": set_id}).json() == {"results": {}}
    opted = complete(server, {"use_hook_set": set_id, "output_residual_stream": [1]})
    assert opted.status_code == 200 and "hook_results" not in opted.json()  # a set's results wait for collect
    results = post(server, "/v1/hooks/collect", {"id": set_id}).json()["results"]
    ((request_id, per_hook),) = results.items()
    assert request_id.startswith(opted.json()["id"])
    norms = decode_activations({"activations": per_hook["0"]})["norm.1"]
    stream = stream_of(opted)[0].float()
    assert_stream_close(norms[: stream.shape[0]].float()[:, None], stream.norm(dim=-1)[:, None], "set norm vs capture", bound=BF16_BOUND)
    assert post(server, "/v1/hooks/collect", {"id": set_id}).json()["results"].keys() == {request_id}  # not drained
    assert post(server, "/v1/hooks/clear_results", {"id": set_id}).json() == {"status": "ok"}
    assert post(server, "/v1/hooks/collect", {"id": set_id}).json() == {"results": {}}
    no_id = post(server, "/v1/hooks/collect", {})
    assert no_id.status_code == 400 and "name the hook set" in no_id.json()["error"]["message"]
    assert post(server, "/v1/hooks/prefetch", {"params": ["lm_head.weight"]}).json()["status"] == "ok"
    assert post(server, "/v1/hooks/clear", {"id": set_id}).json() == {"status": "ok"}
    assert post(server, "/v1/hooks/collect", {"id": set_id}).status_code == 404


def test_lens_client(server) -> None:
    client = LensClient(server.url, api_key=KEY)
    out = client.generate(PROMPT, max_tokens=4, capture_layers=[1], hooks=[Hook("record_norm", [1])], ignore_eos=True)
    stream = out.activations["residual_stream"]
    assert stream.dtype == torch.bfloat16 and stream.shape[1] == len(out.prompt_token_ids) + len(out.token_ids) - 1
    assert torch.equal(out.hook_results["0"]["norm.1"], out.activations["saved"]["norm.1"])
    steered = client.generate(PROMPT, max_tokens=4, capture_layers=[1], steering_vectors=[STEER], ignore_eos=True)
    assert torch.equal(steered.activations["residual_stream"], stream_of(complete(server, lens_xargs([1], steering=[STEER]), max_tokens=4)))
    chat = client.chat(MESSAGES, max_tokens=3, capture_layers=True)
    assert chat.activations["residual_stream"].shape[0] == 4 and chat.text == chat.raw["choices"][0]["message"]["content"]
    client.register_hooks([Hook("record_norm", [1])])
    first = client.generate(PROMPT, max_tokens=3)
    client.register_hooks([Hook("record_norm", [2])])  # appends: a new set with both hooks
    second = client.generate(PROMPT, max_tokens=3)
    collected = client.collect_hook_results()
    by_prefix = {rid.rsplit("-", 1)[0]: per_hook for rid, per_hook in collected.items()}
    assert set(by_prefix[first.raw["id"]]) == {"0"} and set(by_prefix[second.raw["id"]]) == {"0", "1"}
    client.clear_hooks()
    assert client.collect_hook_results() == {} and client.hook_set is None
    with pytest.raises(RuntimeError, match="never runs code"):
        client._json("POST", "/v1/hooks/register", {"hooks": [{"fn": {"cloudpickle": ""}, "layer_indices": [0]}]})


def test_inspect_metadata_carries_token_ids_and_hook_results(server) -> None:
    import asyncio

    from inspect_ai.model import GenerateConfig, get_model

    model = get_model("vllm-lens/test", base_url=f"{server.url}/v1", api_key=KEY, memoize=False)
    extra_args = {"output_residual_stream": True, "apply_hooks": [Hook("record_norm", [2])]}
    config = GenerateConfig(max_tokens=4, temperature=0, extra_body={"extra_args": extra_args, "ignore_eos": True})
    output = asyncio.run(model.generate(PROMPT, config=config))
    metadata = output.metadata
    stream = metadata["activations"]["residual_stream"]
    assert stream.dtype == torch.bfloat16 and stream.shape[0] == 4
    assert metadata["prompt_token_ids"] == metadata["token_ids"]["prompt"] and len(metadata["token_ids"]["completion"]) == 4
    assert stream.shape[1] == len(metadata["prompt_token_ids"]) + 4 - 1  # row t is token (prompt + completion)[t]
    assert set(metadata["hook_results"]) == {"0"}
    assert_stream_close(
        metadata["hook_results"]["0"]["norm.2"].float()[:, None],
        stream[2].float().norm(dim=-1)[:, None],
        "provider hook result vs capture",
        bound=BF16_BOUND,
    )
