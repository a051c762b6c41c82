"""The Inspect provider ``vllm-lens/<model>`` end to end against real servers."""

from __future__ import annotations

import asyncio
import json
import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import numpy as np
import openai
import psutil
import pytest
import torch
from inspect_ai import Task
from inspect_ai import eval as inspect_eval
from inspect_ai.dataset import Sample
from inspect_ai.model import GenerateConfig, get_model
from inspect_ai.scorer import match

from lens_evals import SteeringVector
from lens_evals.client import lens_xargs
from lens_evals.inspect_kit.lens_solvers import capture_activations, steer
from lens_evals.inspect_kit.provider.server import LensServer, free_port
from lens_evals.inspect_kit.provider.xargs import to_vllm_xargs
from lens_evals.request.hooks import Hook
from lens_evals.request.spec import HOOKS_KEY
from tests.conftest import capture, gpu_share, greedy, make_llm
from tests.tolerance import assert_stream_close

PROMPT = "the cat reads a book."
VEC = np.random.default_rng(2).normal(size=(128,)).astype(np.float32)


@pytest.fixture(scope="module")
def tiny_server(tiny_path):
    server = LensServer(str(tiny_path), served_name="tiny-llama", server_args={"dtype": "float32", "max_model_len": 1024, "seed": 0})
    server.start()
    try:
        yield server
    finally:
        server.stop()


def tiny_model(server: LensServer):
    return get_model("vllm-lens/tiny-llama", base_url=f"{server.url}/v1")


def generate(model, **extra_args):
    config = GenerateConfig(max_tokens=6, temperature=0.0, extra_body={"extra_args": extra_args, "ignore_eos": True})
    return asyncio.run(model.generate(PROMPT, config=config))


def test_provider_activations_and_steering_equal_offline(tiny_server, tiny_path) -> None:
    model = tiny_model(tiny_server)
    captured = generate(model, output_residual_stream=[0, 3])
    vector = SteeringVector(activations=np.stack([VEC]), layer_indices=[1], scale=5.0)
    steered = generate(model, apply_steering_vectors=[vector])
    plain = generate(model)
    hook = Hook("record_norm", [2])  # an object in extra_args: encoded by lens_xargs, as every client does
    assert to_vllm_xargs({HOOKS_KEY: hook}) == to_vllm_xargs({HOOKS_KEY: [hook.to_wire()]}) == lens_xargs(hooks=[hook])
    hooked = generate(model, apply_hooks=[hook])
    with make_llm(tiny_path) as llm:
        messages = [{"role": "user", "content": PROMPT}]
        offline_capture = llm.chat(messages, greedy(6, output_residual_stream=[0, 3]))[0]
        offline_steered = llm.chat(messages, greedy(6, apply_steering_vectors=[vector]))[0]
        offline_plain = llm.chat(messages, greedy(6))[0]
        offline_hooked = llm.chat(messages, greedy(6, apply_hooks=[hook]))[0]
    stream = captured.metadata["activations"]["residual_stream"]
    assert isinstance(stream, torch.Tensor)
    assert_stream_close(stream, capture(offline_capture), "provider capture vs offline")
    assert steered.completion == offline_steered.outputs[0].text
    assert plain.completion == offline_plain.outputs[0].text
    assert steered.completion != plain.completion
    norms, offline_norms = hooked.metadata["hook_results"]["0"]["norm.2"], offline_hooked.activations["saved"]["norm.2"]
    assert_stream_close(norms.float()[:, None], torch.as_tensor(offline_norms).float()[:, None], "provider hook vs offline")
    assert captured.usage is not None and captured.usage.input_tokens == len(offline_capture.prompt_token_ids)


def test_captures_reach_the_provider_as_binary_frames_equal_to_json(tiny_server) -> None:
    """The provider asks for the binary frame and reads it through its own transport (the OpenAI
    SDK parses only JSON): the arrays equal the same request's in the default JSON encoding, bit
    for bit, the hook results too, and a JSON encoding asked for explicitly still comes as JSON.
    The frame never reaches Inspect's log: its reference is taken out as the arrays are."""
    from lens_evals.inspect_kit.provider import frames
    from lens_evals.request.spec import ENCODING_KEY

    model = tiny_model(tiny_server)
    hook = Hook("record_norm", [2])
    before = frames.frames_read
    framed = generate(model, output_residual_stream=[0, 3], apply_hooks=[hook])
    assert frames.frames_read == before + 1, "the capture did not come as a frame"
    as_json = generate(model, output_residual_stream=[0, 3], apply_hooks=[hook], **{ENCODING_KEY: "safetensors-zstd"})
    assert frames.frames_read == before + 1, "a JSON encoding asked for came as a frame"
    got, want = framed.metadata["activations"]["residual_stream"], as_json.metadata["activations"]["residual_stream"]
    assert got.dtype == want.dtype and torch.equal(got, want)
    assert torch.equal(
        torch.as_tensor(framed.metadata["hook_results"]["0"]["norm.2"]), torch.as_tensor(as_json.metadata["hook_results"]["0"]["norm.2"])
    )
    assert not frames._waiting, "a frame's fields were left behind"
    plain = generate(model)  # no lens field: nothing asked, nothing framed
    assert frames.frames_read == before + 1 and "activations" not in (plain.metadata or {})


def capture_task(n: int) -> Task:
    samples = [Sample(input=f"{PROMPT} {i}", target="x") for i in range(n)]
    return Task(
        dataset=samples, solver=[capture_activations([0, 1, 2, 3])], scorer=match(), config=GenerateConfig(max_tokens=8, temperature=0.0)
    )


def test_eval_logs_stay_small_and_carry_summaries(tiny_server, tmp_path) -> None:
    logs = inspect_eval(
        capture_task(50), model="vllm-lens/tiny-llama", model_base_url=f"{tiny_server.url}/v1", log_dir=str(tmp_path), display="none"
    )
    log = logs[0]
    assert log.status == "success", log.error
    files = list(Path(tmp_path).glob("*.eval"))
    size = files[0].stat().st_size
    print(f"log of 50 captured samples: {size / 1024:.0f} KiB")
    assert size < 3 * 2**20, f"log is {size} bytes"
    from inspect_ai.log import read_eval_log

    full = read_eval_log(str(files[0]))
    assert len(full.samples) == 50
    summary = full.samples[0].messages[-1].metadata["lens_capture"]
    assert summary["layers"] == [0, 1, 2, 3] and summary["n_positions"] > 5


def _descendants() -> set[int]:
    """Every live process below this one (servers and their engine core / worker processes)."""
    return {p.pid for p in psutil.Process().children(recursive=True) if p.is_running() and p.status() != psutil.STATUS_ZOMBIE}


def test_eval_on_smollm2_starts_and_stops_its_server(smollm2_path, tmp_path) -> None:
    samples = [Sample(input="What is the capital of France?", target="Paris"), Sample(input="Name a colour.", target="red")]
    task = Task(
        dataset=samples,
        solver=[steer(np.ones(576, dtype=np.float32), layers=[10], scale=0.05, norm_match=True, capture_layers=[10, 20])],
        scorer=match(),
        config=GenerateConfig(max_tokens=8, temperature=0.0),
    )
    before = _descendants()
    model_args = {"max_model_len": 512, "dtype": "float32", **gpu_share()}
    # the server the eval shares (same model and args): it takes a random key, which its client sends
    api = get_model("vllm-lens/smollm2-135m-instruct", memoize=False, **model_args).api
    assert api.server is not None and api.server.api_key and len(api.server.api_key) >= 32
    assert api.api_key == api.server.api_key
    for path, body in [("/v1/models", None), ("/lens/hook_sets", {"hooks": [{"name": "record_norm", "layer_indices": [1]}]})]:
        method = "get" if body is None else "post"
        assert httpx.request(method, f"{api.server.url}{path}", json=body, timeout=60).status_code == 401, path
        wrong = {"Authorization": "Bearer lens-evals-local"}  # the provider's old placeholder key
        assert httpx.request(method, f"{api.server.url}{path}", json=body, headers=wrong, timeout=60).status_code == 401, path
    assert asyncio.run(api.served_models()) == ["smollm2-135m-instruct"]
    logs = inspect_eval(task, model="vllm-lens/smollm2-135m-instruct", model_args=model_args, log_dir=str(tmp_path), display="none")
    api.close()
    assert logs[0].status == "success", logs[0].error
    sample = logs[0].samples[0]
    assert sample.messages[-1].metadata["lens_steering"]["layers"] == [10]
    assert sample.output.usage.input_tokens > 0
    left = _descendants() - before
    assert not left, f"processes left after the eval: {[psutil.Process(p).cmdline()[:4] for p in left]}"


def _tagged_engines(tag: str) -> set[int]:
    """Live vLLM server / engine processes whose environment carries ``LENS_EVALS_TEST_TAG=tag``:
    those the eval started (inherited through every fork), and no other server on the host."""
    found = set()
    for proc in psutil.process_iter(["pid", "cmdline", "name", "status"]):
        try:
            if proc.info["status"] == psutil.STATUS_ZOMBIE or proc.environ().get("LENS_EVALS_TEST_TAG") != tag:
                continue
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        cmd = " ".join(proc.info["cmdline"] or [])
        if "vllm.entrypoints.openai.api_server" in cmd or (proc.info["name"] or "").startswith("VLLM::"):
            found.add(proc.info["pid"])
    return found


# the interrupted eval in the default suite (it must stop the server too); the clean exit with ``-m slow``
@pytest.mark.parametrize("interrupt", [pytest.param(False, marks=pytest.mark.slow), True])
def test_inspect_cli_leaves_no_engine_processes(tmp_path, interrupt: bool) -> None:
    """`inspect eval` starts a server per eval and stops it at exit, also on SIGTERM mid-eval."""
    import signal
    import subprocess
    import sys
    import time

    tag = f"lifecycle-{os.getpid()}-{interrupt}-{time.monotonic_ns()}"
    model_args = [arg for key, value in {"max_model_len": 512, **gpu_share()}.items() for arg in ("-M", f"{key}={value}")]
    cmd = [
        sys.executable,
        "-m",
        "inspect_ai",
        "eval",
        "lifecycle_task.py",
        "--model",
        "vllm-lens/tiny-llama",
        *model_args,
        "--log-dir",
        str(tmp_path),
        "--display",
        "plain",
    ]
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=Path(__file__).parents[1] / "scripts",
        env={**os.environ, "LENS_EVALS_TEST_TAG": tag},
    )
    if interrupt:
        deadline = time.monotonic() + 300
        while not _tagged_engines(tag) and time.monotonic() < deadline:
            time.sleep(1)
        assert _tagged_engines(tag), "the eval never started a server"
        time.sleep(5)
        proc.send_signal(signal.SIGTERM)
    output, _ = proc.communicate(timeout=600)
    if not interrupt:
        assert proc.returncode == 0, output[-3000:]
    time.sleep(2)
    left = _tagged_engines(tag)
    assert not left, f"engine processes left after `inspect eval` exited: {left}"


def test_bad_model_arg_shows_the_server_log() -> None:
    before = _descendants()
    with pytest.raises(RuntimeError, match="unrecognized arguments|no-such-flag"):
        get_model("vllm-lens/tiny-llama", no_such_flag=3, server_timeout=300)
    assert not _descendants() - before


def test_dead_server_is_a_clear_error() -> None:
    with pytest.raises(RuntimeError, match="no vLLM server reachable"):
        get_model("vllm-lens/tiny-llama", base_url=f"http://127.0.0.1:{free_port()}/v1")


def test_conflicting_vllm_lens_package_is_refused(tmp_path, monkeypatch) -> None:
    dist = tmp_path / "vllm_lens-0.1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm-lens\nVersion: 0.1.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(RuntimeError, match="Uninstall one of them"):
        get_model("vllm-lens/tiny-llama", base_url="http://127.0.0.1:1/v1")


def test_a_memoised_model_follows_the_base_url_variable_and_fails_fast_without_a_server(tiny_server, monkeypatch) -> None:
    """Inspect memoises models by their arguments, not the environment: a model built from
    VLLM_LENS_BASE_URL must follow the variable, and a vanished server must fail the call at
    once (Inspect would otherwise retry a refused connection for ever)."""
    import time

    from lens_evals.inspect_kit.provider.api import BASE_URL_ENV

    monkeypatch.setenv(BASE_URL_ENV, f"{tiny_server.url}/v1")
    model = get_model("vllm-lens/tiny-llama", memoize=False)
    plain = generate(model)
    monkeypatch.setenv(BASE_URL_ENV, f"http://127.0.0.1:{free_port()}/v1")  # that server went away
    started = time.monotonic()
    with pytest.raises(openai.APIConnectionError, match="(?i)connect"):  # the client's own error, not a retry's or ours
        generate(model)
    assert time.monotonic() - started < 60
    monkeypatch.setenv(BASE_URL_ENV, f"{tiny_server.url}/v1")
    assert generate(model).completion == plain.completion


class _KeyedServer(BaseHTTPRequestHandler):
    """vLLM's rule for a server started with --api-key: /v1 routes answer 401 without the key."""

    def _answer(self) -> None:
        keyed = self.path.startswith("/v1") and self.headers.get("Authorization") != "Bearer secret"
        status, body = (401, {"error": "Unauthorized"}) if keyed else (200, {"data": [{"id": "tiny-llama"}], "tokens": [1, 2]})
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    do_GET = do_POST = _answer

    def log_message(self, *args: object) -> None:
        return None


def test_the_providers_own_routes_send_the_api_key() -> None:
    """served_models() (the oracle task asks it) and tokenize() against a server that needs a key."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _KeyedServer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/v1"
        api = get_model("vllm-lens/tiny-llama", base_url=url, api_key="secret", memoize=False).api
        assert asyncio.run(api.served_models()) == ["tiny-llama"]
        assert asyncio.run(api.tokenize(text="hello")) == [1, 2]
        other = get_model("vllm-lens/tiny-llama", base_url=url, api_key="wrong", memoize=False).api
        with pytest.raises(RuntimeError, match="HTTP 401"):
            asyncio.run(other.served_models())
        with pytest.MonkeyPatch.context() as env:  # Inspect's SERVICE_API_KEY convention
            env.setenv("VLLM_LENS_API_KEY", "secret")
            from_env = get_model("vllm-lens/tiny-llama", base_url=url, memoize=False).api
            assert asyncio.run(from_env.served_models()) == ["tiny-llama"]
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize("flag", ["port", "host", "served_model_name"])
def test_flags_the_provider_sets_itself_are_refused_before_a_server_starts(flag: str) -> None:
    """``-M port=N`` made the server listen where the health check never looked: a hang until
    server_timeout (then an error naming no cause)."""
    before = _descendants()
    with pytest.raises(ValueError, match=f"-M {flag}: the provider sets --{flag.replace('_', '-')}"):
        get_model("vllm-lens/tiny-llama", memoize=False, server_timeout=30, **{flag: "x"})
    assert not _descendants() - before
