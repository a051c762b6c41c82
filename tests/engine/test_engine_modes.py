"""The multiprocess engine (engine core and worker in their own processes) and AsyncLLM give
the same captures and steered tokens as the in-process offline engine."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from lens_evals.engine.transport import handoff_files
from tests.conftest import engine_options
from tests.tolerance import assert_values_close

SCRIPT = Path(__file__).parents[1] / "scripts" / "run_capture.py"


def metadata(path: Path, name: str) -> str:
    with safe_open(str(path), framework="pt") as handle:
        return handle.metadata()[name]


def run(model: Path, tmp_path: Path, mode: str, multiprocess: bool, handoff_dir: Path | None = None) -> dict[str, torch.Tensor]:
    """``handoff_dir``: every row block goes through a hand-off file there (else inline bytes)."""
    out = tmp_path / f"{mode}_{int(multiprocess)}.safetensors"
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "1" if multiprocess else "0", "VLLM_CPU_KVCACHE_SPACE": "1"}
    if handoff_dir is not None:
        env |= {"LENS_EVALS_HANDOFF_DIR": str(handoff_dir), "LENS_EVALS_HANDOFF_MIN_BYTES": "0"}
    else:
        env["LENS_EVALS_HANDOFF"] = "0"
    proc = subprocess.run([sys.executable, str(SCRIPT), str(model), str(out), mode], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"engine run failed ({mode}, multiprocess={multiprocess}):\n{proc.stderr[-4000:]}"
    result = load_file(str(out))
    result["_path"] = out  # type: ignore[assignment]
    return result


@pytest.fixture(scope="module")
def in_process(tiny_path, tmp_path_factory) -> Iterator[dict[str, torch.Tensor]]:
    """The in-process engine's results; its hand-off directory in memory where the host has one
    (``/dev/shm``, as by default: its rows then come from the pool), ``result["_handoff"]``."""
    tmp_path = tmp_path_factory.mktemp("inproc")
    shm = Path("/dev/shm")
    with tempfile.TemporaryDirectory(dir=shm if shm.is_dir() and os.access(shm, os.W_OK) else tmp_path) as handoff_dir:
        result = run(tiny_path, tmp_path, "offline", multiprocess=False, handoff_dir=Path(handoff_dir))
        result["_handoff"] = Path(handoff_dir)  # type: ignore[assignment]
        yield result


# one multiprocess engine in the default suite (the common case: offline, hand-off files); the
# other two modes each start one more engine (~60 s on 2 CPU cores) and run with ``-m slow``
@pytest.mark.parametrize(
    "mode,handoff",
    [pytest.param("offline", False, marks=pytest.mark.slow), ("offline", True), pytest.param("async", True, marks=pytest.mark.slow)],
)
def test_multiprocess_engine_matches_in_process(tiny_path, tmp_path, in_process, mode: str, handoff: bool) -> None:
    """Through collective_rpc's bytes, and through hand-off files (which are all claimed and gone
    afterwards)."""
    handoff_dir = tmp_path / "handoff"
    handoff_dir.mkdir()
    result = run(tiny_path, tmp_path, mode, multiprocess=True, handoff_dir=handoff_dir if handoff else None)
    assert result.keys() == in_process.keys() - {"_handoff"} and "saved_norm.3_2" in result
    # 3 captures and 2 probe-score blocks (the offline lambda-hook request fails without rows)
    assert int(metadata(result["_path"], "handoff_files")) == (5 if handoff else 0)
    # in-process the same blocks come from the pool too (memory touched before, not new bytes),
    # where the hand-off directory is in memory
    pooled_here = handoff_files.in_memory(str(in_process["_handoff"]))
    assert int(metadata(in_process["_path"], "handoff_files")) == (5 if pooled_here else 0)
    # requests 1 and 2 finish before the last step: their rows are written before the fetch (into
    # the pool), request 0's at the fetch, or (multiprocess: the engine
    # core tells the worker of the last step's finished requests in a step of their own) perhaps
    # just before; without the hand-off, none
    assert int(metadata(in_process["_path"], "early_written")) == 2
    if mode == "offline":
        assert int(metadata(result["_path"], "early_written")) in ((2, 3) if handoff else (0,))
    assert list(handoff_dir.iterdir()) == []  # claimed files unlinked, the marker removed at exit
    if mode == "offline":  # a lambda hook works in-process only, and says why elsewhere
        assert metadata(in_process["_path"], "lambda_hook") == "ok"
        assert "cannot be imported by name" in metadata(result["_path"], "lambda_hook")
    for name, tensor in in_process.items():
        if name in ("_path", "_handoff"):
            continue
        if name.startswith("tokens"):
            assert torch.equal(result[name], tensor), name
        else:
            assert_values_close(result[name], tensor, name)


def test_a_loop_of_offline_calls_reuses_the_regions_of_dropped_outputs(tiny_path) -> None:
    """``out = llm.generate(...)`` in a loop on the multiprocess engine: during a call the previous
    call's rows are still held, and the rows of the call before were dropped when ``out`` was
    reassigned. Those regions go back to the worker as the call starts, so the pool holds two
    calls' rows plus one segment of first-fit slack, not three (without the early release: 3
    segments of 64 MiB here instead of 2). Every call's rows equal the first call's, and the held
    rows are intact after the next call wrote into the pool. Left idle (a 2 s idle setting), the
    worker gives back the free regions' pages of every segment but the first."""
    import json

    script = Path(__file__).parents[1] / "scripts" / "pool_loop.py"
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
    env.pop("LENS_EVALS_HANDOFF", None)
    env.pop("LENS_EVALS_HANDOFF_POOL_MIB", None)
    env["LENS_EVALS_HANDOFF_POOL_IDLE_S"] = "2"
    # 96 prompts x 256 tokens x 4 layers x 128 fp32 = 48 MiB a call: 2 calls fit 2 segments, 3 do not
    options = engine_options(enforce_eager=True, enable_prefix_caching=False, max_model_len=264)
    command = [sys.executable, str(script), str(tiny_path), "5", "96", "256", json.dumps(options), "8"]
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))
    got = json.loads(line[len("RESULT ") :])
    call_bytes = got["capture_bytes"][0]
    assert call_bytes == 96 * 256 * 4 * 128 * 4 and set(got["capture_bytes"]) == {call_bytes}
    assert all(got["equal"]) and all(got["held_intact"]) and len(got["held_intact"]) == 4
    segment = 64 * 2**20
    assert max(got["pool_bytes"]) <= 2 * call_bytes + segment, got["pool_bytes"]
    # left idle: the second segment's pages go back (the small call's region may stay: its
    # tensor died after the call, unknown to the worker), the pool's segments themselves stay
    assert got["pool_idle"] >= 2 * segment and got["allocated_busy"] >= 2 * segment, got
    assert got["allocated_idle"] <= segment + 2**20, got
