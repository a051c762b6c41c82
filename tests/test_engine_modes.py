"""The multiprocess engine (engine core and worker in their own processes) and AsyncLLM give
the same captures and steered tokens as the in-process offline engine."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from safetensors import safe_open
from safetensors.torch import load_file

from tests.conftest import engine_tolerance

SCRIPT = Path(__file__).parent / "scripts" / "run_capture.py"

TOL = engine_tolerance()


def lambda_hook_result(path: Path) -> str:
    with safe_open(str(path), framework="pt") as handle:
        return handle.metadata()["lambda_hook"]


def run(model: Path, tmp_path: Path, mode: str, multiprocess: bool) -> dict[str, torch.Tensor]:
    out = tmp_path / f"{mode}_{int(multiprocess)}.safetensors"
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "1" if multiprocess else "0", "VLLM_CPU_KVCACHE_SPACE": "1"}
    proc = subprocess.run([sys.executable, str(SCRIPT), str(model), str(out), mode], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"engine run failed ({mode}, multiprocess={multiprocess}):\n{proc.stderr[-4000:]}"
    result = load_file(str(out))
    result["_path"] = out  # type: ignore[assignment]
    return result


@pytest.fixture(scope="module")
def in_process(tiny_path, tmp_path_factory) -> dict[str, torch.Tensor]:
    return run(tiny_path, tmp_path_factory.mktemp("inproc"), "offline", multiprocess=False)


@pytest.mark.parametrize("mode", ["offline", "async"])
def test_multiprocess_engine_matches_in_process(tiny_path, tmp_path, in_process, mode: str) -> None:
    result = run(tiny_path, tmp_path, mode, multiprocess=True)
    assert result.keys() == in_process.keys() and "saved_norm.3_2" in result
    if mode == "offline":  # a lambda hook works in-process only, and says why elsewhere
        assert lambda_hook_result(in_process["_path"]) == "ok"
        assert "cannot be imported by name" in lambda_hook_result(result["_path"])
    for name, tensor in in_process.items():
        if name == "_path":
            continue
        if name.startswith("tokens"):
            assert torch.equal(result[name], tensor), name
        else:
            torch.testing.assert_close(result[name], tensor, atol=TOL, rtol=TOL)
