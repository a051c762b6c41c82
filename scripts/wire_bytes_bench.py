"""The byte path of an over-HTTP capture, without a server: what the lens server does per response
(encode the rows, write the JSON) and what the client does (parse the JSON, decode the rows), per
GB of bf16 rows, for each response encoding, with the wire's fast paths (pybase64,
``wire.json_bytes``) and with the standard library's (``base64``, ``json.dumps``), in paired
rounds of one run; then the binary frame (``safetensors-frame``: no base64, no JSON around the
bytes) against uncompressed safetensors on the fast paths, paired too. Prints seconds per 1.37 GB
(the prefill bench's one-layer capture of 1,000 prompts of a Llama-8B-shaped model) and the ratios.

    PYTHONPATH=. .venv/bin/python scripts/wire_bytes_bench.py --rows 60 --rounds 3
"""

from __future__ import annotations

import argparse
import base64
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from lens_evals.wire import codec
from lens_evals.wire import formats as wire
from lens_evals.wire import frame as wire_frame

CAPTURE_GB = 1.37  # 167,618 tokens x 4,096 x 2 bytes


def one_pass(blocks: list[torch.Tensor], encoding: str, to_json: Callable[[Any], bytes]) -> tuple[float, float]:
    """(server seconds, client seconds) for these blocks, one response each."""
    start = time.perf_counter()
    bodies = [to_json({"activations": {"residual_stream": wire.encode_array(block, encoding)}}) for block in blocks]
    server = time.perf_counter() - start
    start = time.perf_counter()
    for body in bodies:
        wire.decode_tensor(json.loads(body)["activations"]["residual_stream"])
    return server, time.perf_counter() - start


def frame_pass(blocks: list[torch.Tensor]) -> tuple[float, float]:
    """(server seconds, client seconds) for these blocks as frames, one response each."""
    start = time.perf_counter()
    sent = []
    for block in blocks:  # the pieces the server sends (its tensors' buffers, uncopied)
        sent.append(wire_frame.frame_bytes({"activations": {"residual_stream": wire.encode_array(block, wire.SAFETENSORS_FRAME)}}))
    server = time.perf_counter() - start
    bodies = [b"".join(parts) for parts in sent]  # what the client reads
    start = time.perf_counter()
    for body in bodies:
        wire.decode_tensor(wire_frame.unframe(body)["activations"]["residual_stream"])
    return server, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=60, help="responses of 168 tokens x 4,096 bf16 (1.38 MB each)")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.manual_seed(0)
    blocks = [(torch.randn(168, 4096) * 3).to(torch.bfloat16) for _ in range(args.rows)]
    scale = CAPTURE_GB / (sum(b.numel() * b.element_size() for b in blocks) / 1e9)
    fast_base64 = codec._base64
    paths: dict[str, tuple[Any, Callable[[Any], bytes]]] = {
        "standard library": (base64, lambda value: json.dumps(value).encode()),
        "fast paths": (fast_base64, wire.json_bytes),
    }
    print(f"base64 module of the fast paths: {fast_base64.__name__}")
    for encoding in wire.JSON_ENCODINGS:
        times: dict[str, list[tuple[float, float]]] = {name: [] for name in paths}
        for _ in range(args.rounds):
            for name, (module, to_json) in paths.items():
                codec._base64 = module
                try:
                    times[name].append(one_pass(blocks, encoding, to_json))
                finally:
                    codec._base64 = fast_base64
        medians = {name: [statistics.median(t[i] for t in rounds) * scale for i in (0, 1)] for name, rounds in times.items()}
        old, new = medians["standard library"], medians["fast paths"]
        print(
            f"{encoding:17s} per {CAPTURE_GB} GB: server {old[0]:.2f} -> {new[0]:.2f} s ({old[0] / new[0]:.1f}x), "
            f"client {old[1]:.2f} -> {new[1]:.2f} s ({old[1] / new[1]:.1f}x)"
        )
    pairs = [(one_pass(blocks, wire.SAFETENSORS, wire.json_bytes), frame_pass(blocks)) for _ in range(args.rounds)]
    json_s, frame_s = ([statistics.median(pair[k][i] for pair in pairs) * scale for i in (0, 1)] for k in (0, 1))
    print(
        f"safetensors -> safetensors-frame per {CAPTURE_GB} GB: server {json_s[0]:.2f} -> {frame_s[0]:.2f} s "
        f"({json_s[0] / frame_s[0]:.1f}x), client {json_s[1]:.2f} -> {frame_s[1]:.2f} s ({json_s[1] / frame_s[1]:.1f}x)"
    )


if __name__ == "__main__":
    main()
