"""The plugin's Python per request, without an engine (issue #21, item 4 of the plan in
benchmarks/results/NOTEBOOK.md): the frontend's admission (``engine.frontend.admit.on_request``: parse, validate,
normalise, encode) and the worker's decoding (``requests.decode_worker_request``), each timed
with ``time.perf_counter`` over many calls of the same request, the best of several rounds.

    .venv/bin/python scripts/per_request_bench.py [--hidden 4096] [--layers 32] [--calls 2000]

The model is a stand-in config (Llama, the given shape); the requests are the bench's: capture
one layer, and three probes on one layer (as ``LinearProbe`` objects, as the offline bench sends
them, and as JSON strings, as ``vllm_xargs`` over HTTP carry them).
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from lens_evals.engine.frontend.admit import on_request
from lens_evals.engine.worker.requests import decode_worker_request
from lens_evals.request.spec import CAPTURE_KEY, INTERNAL_KEY, PROBE_KEY, LinearProbe


def stand_in_processor(num_layers: int, hidden: int) -> Any:
    """What ``on_request`` reads of vLLM's input processor: the config."""
    hf_config = SimpleNamespace(architectures=["LlamaForCausalLM"], num_hidden_layers=num_layers, hidden_size=hidden)
    model_config = SimpleNamespace(hf_config=hf_config, hf_text_config=hf_config, max_model_len=4096)
    return SimpleNamespace(
        vllm_config=SimpleNamespace(model_config=model_config, additional_config={}, use_v2_model_runner=False, speculative_config=None)
    )


def probes(hidden: int, count: int = 3) -> list[LinearProbe]:
    rng = np.random.default_rng(11)
    return [LinearProbe(name=f"p{i}", layer=16, weights=rng.standard_normal(hidden).astype(np.float32), bias=0.1 * i) for i in range(count)]


def per_call_us(run: Callable[[], Any], calls: int, rounds: int) -> float:
    """The best over ``rounds`` of the mean time of one call, in microseconds (the least disturbed
    by other processes on a shared machine, as ``timeit`` recommends)."""
    run()  # warm
    times = []
    for _ in range(rounds):
        began = time.perf_counter()
        for _ in range(calls):
            run()
        times.append((time.perf_counter() - began) / calls * 1e6)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    from vllm import SamplingParams

    processor = stand_in_processor(args.layers, args.hidden)
    prompt = list(range(200))
    three = probes(args.hidden)
    as_json = json.dumps([probe.to_wire() for probe in three])
    requests = {
        "capture 1 layer": {CAPTURE_KEY: [16]},
        "3 probes (objects)": {PROBE_KEY: three},
        "3 probes (JSON string)": {PROBE_KEY: as_json},
    }
    results: dict[str, float] = {}
    for name, extra in requests.items():
        params = SamplingParams(max_tokens=1, extra_args=extra)

        def admit(params: Any = params) -> Any:
            request = SimpleNamespace(sampling_params=copy.copy(params), prompt_token_ids=prompt, cache_salt=None)
            on_request(processor, "r", request)
            return request

        results[f"frontend on_request, {name}"] = per_call_us(admit, args.calls, args.rounds)
        spec_extra = admit().sampling_params.extra_args
        assert INTERNAL_KEY in spec_extra
        calls = max(args.calls // 4, 50)
        results[f"worker decode, {name}"] = per_call_us(
            lambda spec_extra=spec_extra: decode_worker_request(spec_extra, torch.device("cpu"), torch.bfloat16, {}), calls, args.rounds
        )
    base = per_call_us(lambda: SimpleNamespace(sampling_params=copy.copy(params), prompt_token_ids=prompt), args.calls, args.rounds)
    width = max(map(len, results))
    print(
        f"hidden {args.hidden}, {args.layers} layers; best of {args.rounds} rounds; "
        f"per call, minus {base:.1f} us of building the stand-in request"
    )
    for name, us in results.items():
        print(f"{name:<{width}}  {us - (base if name.startswith('frontend') else 0):8.1f} us")


if __name__ == "__main__":
    main()
