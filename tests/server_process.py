"""Start a lens-enabled vLLM OpenAI server in a subprocess for tests."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import requests


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ServerProcess:
    def __init__(self, model: Path, log_path: Path, *extra: str, env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        cmd = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
            "--served-model-name", "test", "--host", "127.0.0.1", "--port", str(self.port),
            "--dtype", "float32", "--max-model-len", "1024", "--seed", "0", *extra,
        ]
        import torch

        if torch.cuda.is_available():
            cmd += ["--gpu-memory-utilization", "0.2"]
        full_env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", **(env or {})}
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=full_env, start_new_session=True)

    def wait_ready(self, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                if requests.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except requests.ConnectionError:
                pass
            time.sleep(1)
        raise RuntimeError(f"server not ready after {timeout} s:\n{self.tail()}")

    def tail(self, n: int = 4000) -> str:
        self.log.flush()
        return Path(self.log_path).read_text()[-n:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, 15)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, 9)
                self.proc.wait()
        self.log.close()
