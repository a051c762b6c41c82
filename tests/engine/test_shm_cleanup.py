"""An offline engine that is never shut down leaves nothing behind: a process that opens one
(engine core in its own process), captures and exits gets no "leaked shared_memory" warning from
Python's resource tracker (vLLM's executor ring, unlinked by the graceful shutdown the plugin runs
at exit) and leaves no lens_evals file of its own in /dev/shm."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.device import gpu_share

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = """
import os
def main():
    from vllm import LLM, SamplingParams
    llm = LLM({path!r}, dtype="float32", max_model_len=128, seed=0, **{share!r})
    out = llm.generate(["hello world " * 10], SamplingParams(max_tokens=2, extra_args={{"output_residual_stream": [0, 1]}}), use_tqdm=False)
    print("captured", tuple(out[0].activations["residual_stream"].shape), os.getpid(), flush=True)
if __name__ == "__main__":
    main()  # exits without llm.llm_engine.engine_core.shutdown()
"""


# slow, not in CI (a multiprocess engine, 35-110 s). It failed under load (5 of 5 runs beside
# another engine, 2026-12-04): vLLM's frontend killed the engine core 5 s after SIGTERM, while the
# engine core still waited for its slow worker (5 s, then 4 s after SIGTERM) and had not unlinked
# its ring yet. Since the plugin gives it those waits and a margin (compat
# ``give_engine_cores_their_teardown_time``): 3 of 3 passed with three busy loops beside it on
# the 2-core machine (load ~4, 2026-12-05).
@pytest.mark.slow
@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no /dev/shm")
def test_exit_without_shutdown_leaks_nothing(tiny_path: Path, tmp_path: Path) -> None:
    script = tmp_path / "open_and_exit.py"
    script.write_text(SCRIPT.format(path=str(tiny_path), share=gpu_share()))  # on a GPU: a share of the device
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
    env.pop("LENS_EVALS_DISABLE", None)
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    captured = [line for line in done.stdout.splitlines() if line.startswith("captured")]
    assert captured and "(2, " in captured[0], done.stdout[-2000:]
    pid = captured[0].split()[-1]
    assert "leaked shared_memory" not in done.stderr, done.stderr[-3000:]
    mine = [
        name
        for name in os.listdir("/dev/shm")
        if name.startswith("lens_evals") and (Path("/dev/shm") / name).read_text(errors="replace").strip() == pid
    ]
    assert not mine, mine
