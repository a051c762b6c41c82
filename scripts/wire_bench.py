"""Bytes and seconds of a large capture over HTTP, per activations encoding (issue #19).

Starts one server per code tree (``--old-tree``: a checkout of the code before the change, whose
only encoding was float32 safetensors; then this tree, asked in turn for each encoding of
``lens_evals.wire.formats.RESPONSE_ENCODINGS``), sends N prompts with ``output_residual_stream`` over
``--concurrency`` connections and measures, per encoding: wall time of the whole run, response
bytes, and the client's decode time. Writes a JSON report.

    cd /tmp && /work/main/.venv/bin/python /work/main/scripts/wire_bench.py --model tiny-llama \\
        --dtype bfloat16 --prompts 1000 --layers 0,1,2,3 --rounds 3 --old-tree /tmp/lens-evals-head \\
        --out /work/main/docs/bench/wire_encodings.json

Run it from a directory without a ``lens_evals`` package (``python -m`` puts the working directory
first on the server's path, before ``PYTHONPATH``). Each round runs every encoding once, in a
rotated order, so load from other processes spreads over all of them.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import date
from pathlib import Path
from typing import Any

import httpx
from tqdm import tqdm

from lens_evals.client import decode_activations
from lens_evals.inspect_kit.provider.server import LensServer
from lens_evals.models.registry import model_path
from lens_evals.wire import formats as wire
from lens_evals.wire import frame as wire_frame

WORDS = "the cat reads a book model finds truth river sees city team builds many layers student likes answer".split()


def prompts(n: int, words: int = 48) -> list[str]:
    """``n`` distinct prompts of ``words`` words (deterministic)."""
    return [" ".join(WORDS[(i * 7 + j * (i % 5 + 1)) % len(WORDS)] for j in range(words)) + f" {i}." for i in range(n)]


def run(server: LensServer, texts: list[str], layers: list[int], encoding: str | None, concurrency: int) -> dict[str, Any]:
    xargs: dict[str, Any] = {"output_residual_stream": layers}
    if encoding is not None:
        xargs["activations_encoding"] = encoding
    sizes: list[int] = []
    decode_seconds = 0.0
    values = 0

    with httpx.Client(timeout=600) as client:

        def one(text: str) -> tuple[bytes, str | None]:
            body = {"model": "bench", "prompt": text, "max_tokens": 1, "temperature": 0, "vllm_xargs": xargs}
            response = client.post(f"{server.url}/v1/completions", json=body)
            response.raise_for_status()
            return response.content, response.headers.get("content-type")

        start = time.perf_counter()
        with ThreadPoolExecutor(concurrency) as pool:
            for content, content_type in tqdm(pool.map(one, texts), total=len(texts), desc=encoding or "old default"):
                sizes.append(len(content))
                began = time.perf_counter()
                stream = decode_activations(wire_frame.response_body(content, content_type))["residual_stream"]
                decode_seconds += time.perf_counter() - began
                values += stream.numel()
        wall = time.perf_counter() - start
    return {
        "encoding": encoding or "float32 safetensors (before)",
        "requests": len(texts),
        "response_bytes": sum(sizes),
        "wall_seconds": round(wall, 2),
        "client_decode_seconds": round(decode_seconds, 2),
        "values": values,
        "dtype": str(stream.dtype),
    }


def serve(model: str, dtype: str, tree: str | None) -> LensServer:
    env = {"PYTHONPATH": tree} if tree else None
    args = {"dtype": dtype, "max_model_len": 512, "seed": 0, "max_num_seqs": 32}
    return LensServer(model, served_name="bench", server_args=args, env=env).start()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--prompts", type=int, default=1000)
    parser.add_argument("--layers", default="0,4,8,12,16,20,24,29")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--old-tree", help="a checkout of the code before native dtypes (omit to skip the old run)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    model = str(model_path(args.model))
    texts = prompts(args.prompts)
    layers = [int(n) for n in args.layers.split(",")]
    rows = []
    if args.old_tree:
        server = serve(model, args.dtype, args.old_tree)
        try:
            rows += [run(server, texts, layers, None, args.concurrency) for _ in range(args.rounds)]
        finally:
            server.stop()
    server = serve(model, args.dtype, None)
    try:
        encodings = list(wire.RESPONSE_ENCODINGS)
        for round_index in range(args.rounds):
            for encoding in encodings[round_index:] + encodings[:round_index]:
                rows.append(run(server, texts, layers, encoding, args.concurrency))
    finally:
        server.stop()
    report = {
        "date": str(date.today()),
        "machine": platform.processor() or platform.machine(),
        "model": args.model,
        "dtype": args.dtype,
        "prompts": args.prompts,
        "layers": layers,
        "concurrency": args.concurrency,
        "runs": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    for encoding in dict.fromkeys(row["encoding"] for row in rows):
        runs = [row for row in rows if row["encoding"] == encoding]
        walls = sorted(row["wall_seconds"] for row in runs)
        decodes = sorted(row["client_decode_seconds"] for row in runs)
        print(
            f"{encoding:>30}: {runs[0]['response_bytes'] / 2**20:8.1f} MiB  wall {walls[len(walls) // 2]:6.1f} s (median of "
            f"{walls})  decode {decodes[len(decodes) // 2]:5.2f} s  ({runs[0]['dtype']})"
        )


if __name__ == "__main__":
    main()
