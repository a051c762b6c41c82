"""A failing worker hook fails its request loudly while others go on; LENS_EVALS_DISABLE=1
turns the plugin off; plain requests give the same tokens with and without the plugin."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import numpy as np
import pytest

from lens_evals import SteeringVector
from lens_evals.engine.frontend.attach import LensRequestError
from lens_evals.engine.worker import taps
from tests.conftest import capture, engine_options, greedy

PROMPTS = ["the cat reads a book.", "a model finds the truth.", "my friend"]
VEC = SteeringVector(activations=np.ones((1, 128), dtype=np.float32), layer_indices=[1], scale=2.0)


def test_failing_hook_fails_its_request_loudly_and_the_engine_goes_on(llm, monkeypatch) -> None:
    def broken(*args, **kwargs):
        raise RuntimeError("injected failure")

    monkeypatch.setattr(taps, "_apply_steering", broken)  # the real tap calls it on the worker
    params = [greedy(4, apply_steering_vectors=[VEC]), greedy(4), greedy(4, output_residual_stream=[0])]
    with pytest.raises(LensRequestError, match="injected failure") as info:
        llm.generate(PROMPTS, params)
    outputs = info.value.outputs
    assert outputs[0].activations is None  # the steered request failed, it did not run unsteered silently
    assert len(outputs[1].outputs[0].token_ids) == 4  # the plain neighbour completed
    monkeypatch.undo()
    again = llm.generate(PROMPTS[:1], greedy(4, apply_steering_vectors=[VEC], output_residual_stream=[1]))[0]
    assert capture(again).shape[0] == 1


DISABLED_SCRIPT = """
import json, os, sys
from vllm import LLM, SamplingParams
if __name__ == "__main__":
    llm = LLM(sys.argv[1], **json.loads(sys.argv[3]))  # the tests' options, eager as the plugin would
    sp = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, extra_args={"output_residual_stream": [0]})
    outs = llm.generate(json.loads(sys.argv[2]), sp)
    print("RESULT", json.dumps([[list(o.outputs[0].token_ids), hasattr(o, "activations")] for o in outs]))
"""


def run_script(script: str, tiny_path, env: dict[str, str]) -> Any:
    """Run ``script`` in a fresh Python (the tiny model, PROMPTS, the tests' eager engine options
    as its arguments) and return what it printed after ``RESULT``."""
    proc = subprocess.run(
        [sys.executable, "-c", script, str(tiny_path), json.dumps(PROMPTS), json.dumps(engine_options(enforce_eager=True))],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))
    return json.loads(line[len("RESULT ") :])


def test_disable_makes_the_plugin_a_no_op_and_plain_tokens_match(llm, tiny_path) -> None:
    env = {**os.environ, "LENS_EVALS_DISABLE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    without_plugin = run_script(DISABLED_SCRIPT, tiny_path, env)
    assert all(not has_activations for _, has_activations in without_plugin)
    with_plugin = llm.generate(PROMPTS, greedy(6))
    assert [list(o.outputs[0].token_ids) for o in with_plugin] == [tokens for tokens, _ in without_plugin]


WORKER_WITHOUT_PLUGIN_SCRIPT = """
import json, os, sys
if __name__ == "__main__":
    from lens_evals.engine import plugin
    plugin.register()  # this process (the frontend) has the plugin ...
    os.environ["LENS_EVALS_DISABLE"] = "1"  # ... the engine core and worker started below do not
    from vllm import LLM, SamplingParams
    llm = LLM(sys.argv[1], **json.loads(sys.argv[3]))
    prompts = json.loads(sys.argv[2])
    plain = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    before = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, plain)]
    try:
        llm.generate(prompts[:1], SamplingParams(max_tokens=2, extra_args={"output_residual_stream": [0]}))
        error = None
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
    after = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, plain)]
    print("RESULT", json.dumps({"before": before, "error": error, "after": after}))
"""


def test_a_worker_without_the_plugin_fails_lens_requests_with_a_clear_error(llm, tiny_path) -> None:
    """What a Ray node without lens-evals does (tests/engine/test_ray_executor.py on the GPU), on CPU: the
    worker's process lacks our methods. The lens request fails naming the plugin and the fix;
    plain requests before and after give the plugin's tokens."""
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}  # the worker in a process of its own
    env.pop("LENS_EVALS_DISABLE", None)
    got = run_script(WORKER_WITHOUT_PLUGIN_SCRIPT, tiny_path, env)
    assert got["error"] is not None, "the lens request succeeded on a worker without the plugin"
    assert got["error"].startswith("WorkerWithoutPlugin: "), got["error"]
    assert "lens-evals plugin did not load" in got["error"] and "every node" in got["error"], got["error"]
    with_plugin = [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, greedy(6))]
    assert got["before"] == with_plugin and got["after"] == with_plugin


def test_our_warnings_are_printed_in_vllms_api_server() -> None:
    """vLLM's API server sets the root logger to ERROR (``model_hosting_container_standards``,
    unless ``LOG_LEVEL`` says otherwise): the plugin's warnings there (a failed fetch, a LoRA dtype
    change) were silently dropped. Once registered, they reach stderr; a level the user set stays."""
    script = """
import logging, sys
from model_hosting_container_standards.logging_config import configure_root_logger
configure_root_logger()
assert logging.getLogger().level == logging.ERROR, logging.getLogger().level
from lens_evals.engine import plugin
mine = sys.argv[1] == "user-level"
if mine:
    logging.getLogger("lens_evals").setLevel(logging.ERROR)
plugin.register()
logging.getLogger("lens_evals").warning("lens_evals: a warning a researcher must see")
"""
    env = {key: value for key, value in os.environ.items() if key not in ("LOG_LEVEL", "SAGEMAKER_CONTAINER_LOG_LEVEL")}
    for case, shown in (("default", True), ("user-level", False)):
        done = subprocess.run([sys.executable, "-c", script, case], capture_output=True, text=True, timeout=300, env=env)
        assert done.returncode == 0, done.stderr[-2000:]
        assert ("a warning a researcher must see" in done.stderr) is shown, (case, done.stderr[-2000:])


def test_an_engine_vllm_would_start_without_the_plugin_is_refused_first(tiny_path, monkeypatch) -> None:
    """vLLM loads general plugins by installed entry point, filtered by ``VLLM_PLUGINS``. An engine
    that leaves ours out really answers a capture request with no activations and no error (the
    same script as above, in a fresh process); the package's engine and server starters refuse
    such an environment before starting anything, saying what to do. A source tree on PYTHONPATH
    without the installed package (the GPU run of 2026-12-05 that met this) has no entry point."""
    from lens_evals.engine.frontend.offline import open_offline_engine
    from lens_evals.engine.plugin import PluginNotLoadable, installed_plugins, plugin_load_problem, require_plugin
    from lens_evals.inspect_kit.provider.server import LensServer

    others = "lora_filesystem_resolver"
    env = {**os.environ, "VLLM_PLUGINS": others, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    env.pop("LENS_EVALS_DISABLE", None)
    left_out = run_script(DISABLED_SCRIPT, tiny_path, env)
    assert left_out and all(not has_activations for _, has_activations in left_out)

    assert plugin_load_problem(installed_plugins(), None) is None  # this environment: installed, nothing filters it
    assert plugin_load_problem(installed_plugins(), f"{others}, lens_evals") is None
    assert "VLLM_PLUGINS" in (plugin_load_problem(installed_plugins(), others) or "")
    not_installed = plugin_load_problem([(name, target) for name, target in installed_plugins() if name != "lens_evals"], None)
    assert not_installed is not None and "not installed" in not_installed and "pip install" in not_installed
    with pytest.raises(PluginNotLoadable, match="VLLM_PLUGINS='lora_filesystem_resolver' leaves out the lens-evals plugin"):
        LensServer(str(tiny_path), "tiny-llama", env={"VLLM_PLUGINS": others})
    monkeypatch.setenv("VLLM_PLUGINS", others)
    monkeypatch.delenv("LENS_EVALS_DISABLE", raising=False)
    with pytest.raises(PluginNotLoadable, match="lens requests would come back without activations"):
        open_offline_engine(str(tiny_path))
    monkeypatch.setenv("LENS_EVALS_DISABLE", "1")  # plain vLLM asked for on purpose: no refusal
    require_plugin()
