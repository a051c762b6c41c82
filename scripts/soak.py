"""Soak a lens-enabled server: many capture / steer / plain requests, some aborted mid-generation
(streams closed early, non-streaming requests timed out by the client). Records the RSS of the
server's process tree and the worker's held capture bytes; writes JSON and a PNG.

    PYTHONPATH=$PWD .venv/bin/python scripts/soak.py --requests 1000 --out docs/reliability

Starts its own tiny-llama server (with VLLM_SERVER_DEV_MODE=1 so ``/collective_rpc`` can ask the
worker for ``lens_evals_memory``) unless ``--url`` and ``--pid`` name a running one.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import psutil

from lens_evals import SteeringVector
from lens_evals.client import activations_from_response, lens_xargs

PROMPT = " ".join(f"the probe reads {n} small data." for n in range(40))  # ~280 tokens: a capture holds ~0.6 MiB
CAPTURE_LAYERS = [0, 1, 2, 3]
STEER = SteeringVector(activations=np.random.default_rng(2).normal(size=(1, 128)).astype(np.float32), layer_indices=[1], scale=4.0)
SERVER_ENV = {"VLLM_SERVER_DEV_MODE": "1"}
SERVER_ARGS = {"dtype": "float32", "max_model_len": 1024, "seed": 0}


def tree_rss(pid: int) -> int:
    """Resident memory of a process and its children, bytes."""
    root = psutil.Process(pid)
    total = 0
    for proc in [root, *root.children(recursive=True)]:
        try:
            total += proc.memory_info().rss
        except psutil.NoSuchProcess:
            continue
    return total


def worker_memory(client: httpx.Client, url: str) -> dict[str, int]:
    resp = client.post(f"{url}/collective_rpc", json={"method": "lens_evals_memory"}, timeout=60)
    resp.raise_for_status()
    return resp.json()["results"][0]


def wait_released(client: httpx.Client, url: str, timeout: float = 30) -> dict[str, int]:
    """Aborts are released asynchronously: poll until no capture is held (or time out)."""
    deadline = time.monotonic() + timeout
    memory = worker_memory(client, url)
    while (memory["held_bytes"] or memory["requests"]) and time.monotonic() < deadline:
        time.sleep(0.5)
        memory = worker_memory(client, url)
    return memory


def one_request(url: str, index: int) -> str:
    """Request ``index`` of the soak; returns its kind ("ok-capture", "aborted-stream", ...)."""
    kind = ("capture", "plain", "steer", "abort-stream", "abort-wait")[index % 5]
    body: dict[str, Any] = {"model": "test", "prompt": PROMPT, "temperature": 0, "ignore_eos": True, "max_tokens": 16}
    if kind == "capture":
        body["vllm_xargs"] = lens_xargs(CAPTURE_LAYERS)
    elif kind == "steer":
        body["vllm_xargs"] = lens_xargs([2], steering=[STEER])
    elif kind.startswith("abort"):
        body.update(max_tokens=600, vllm_xargs=lens_xargs(CAPTURE_LAYERS))
    if kind == "abort-stream":
        with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=120) as resp:
            for n, _ in enumerate(resp.iter_lines()):
                if n >= 3:
                    break  # closing the stream here disconnects mid-generation
        return "aborted-stream"
    if kind == "abort-wait":
        try:
            httpx.post(f"{url}/v1/completions", json=body, timeout=0.3)
        except httpx.TimeoutException:
            return "aborted-timeout"
        return "completed-before-timeout"
    resp = httpx.post(f"{url}/v1/completions", json=body, timeout=300)
    resp.raise_for_status()
    data = resp.json()
    if kind == "capture":
        stream = activations_from_response(data)["residual_stream"]
        if stream.shape[0] != len(CAPTURE_LAYERS):
            raise RuntimeError(f"request {index}: capture has {stream.shape[0]} layers")
    elif "activations" in data and kind == "plain":
        raise RuntimeError(f"request {index}: plain request got activations")
    return f"ok-{kind}"


def sample(completed: int, pid: int, memory: dict[str, int]) -> dict[str, int]:
    return {"completed": completed, "rss_bytes": tree_rss(pid), "held_bytes": memory["held_bytes"], "held_requests": memory["requests"]}


def run_soak(
    url: str,
    pid: int,
    n_requests: int,
    concurrency: int = 8,
    sample_every: int = 25,
    on_sample: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """``on_sample(result so far)`` after every batch, so a run cut short still leaves its data."""
    samples: list[dict[str, Any]] = []
    kinds: dict[str, int] = {}
    start = time.monotonic()
    with httpx.Client() as client, ThreadPoolExecutor(concurrency) as pool:
        samples.append(sample(0, pid, worker_memory(client, url)))
        for batch_start in range(0, n_requests, sample_every):
            indices = range(batch_start, min(batch_start + sample_every, n_requests))
            for kind in pool.map(lambda i: one_request(url, i), indices):
                kinds[kind] = kinds.get(kind, 0) + 1
            memory = wait_released(client, url)
            samples.append(sample(indices[-1] + 1, pid, memory))
            if on_sample is not None:
                on_sample(
                    {
                        "requests": indices[-1] + 1,
                        "concurrency": concurrency,
                        "seconds": time.monotonic() - start,
                        "kinds": kinds,
                        "samples": samples,
                    }
                )
    return {"requests": n_requests, "concurrency": concurrency, "seconds": time.monotonic() - start, "kinds": kinds, "samples": samples}


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [s["completed"] for s in result["samples"]]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.plot(xs, [s["rss_bytes"] / 2**20 for s in result["samples"]], marker="o", label="server process tree RSS")
    ax.plot(xs, [s["held_bytes"] / 2**20 for s in result["samples"]], marker="x", label="worker held capture")
    ax.set_xlabel("requests completed (every 5th a stream closed early, every 5th a client timeout)")
    ax.set_ylabel("MiB")
    ax.set_title(f"lens-evals soak: tiny-llama, {result['requests']} requests, {result['machine']}", fontsize=9)
    ax.set_ylim(bottom=0)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--out", type=Path, default=Path("docs/reliability"))
    parser.add_argument("--url", help="a running server started with VLLM_SERVER_DEV_MODE=1 (else one is started)")
    parser.add_argument("--pid", type=int, help="that server's process id (for RSS)")
    args = parser.parse_args()
    server = None
    if args.url is None:
        from lens_evals.inspect_kit.provider.server import LensServer
        from lens_evals.models.registry import model_path

        server = LensServer(str(model_path("tiny-llama")), served_name="test", server_args=SERVER_ARGS, env=SERVER_ENV).start()
        args.url, args.pid = server.url, server.pid
    args.out.mkdir(parents=True, exist_ok=True)
    try:
        result = run_soak(
            args.url, args.pid, args.requests, args.concurrency, on_sample=lambda partial: write(partial, args.out, args.requests)
        )
    finally:
        if server is not None:
            server.stop()
    write(result, args.out, args.requests)
    print(json.dumps({k: v for k, v in result.items() if k != "samples"}, indent=1))


def write(result: dict[str, Any], out: Path, planned: int) -> None:
    result["machine"] = f"{platform.node()} {psutil.cpu_count()} CPUs, load average {psutil.getloadavg()[0]:.1f}"
    result["date"] = datetime.now(UTC).isoformat(timespec="seconds")
    rss = [s["rss_bytes"] for s in result["samples"]]
    result["rss_mib"] = {"start": rss[0] / 2**20, "after_first_batch": rss[1] / 2**20, "end": rss[-1] / 2**20, "max": max(rss) / 2**20}
    result["max_held_bytes_after_batches"] = max(s["held_bytes"] for s in result["samples"])
    (out / f"soak-{planned}.json").write_text(json.dumps(result, indent=1))
    plot(result, out / f"soak-{planned}.png")


if __name__ == "__main__":
    main()
