"""Host time of one request's admission, without an engine (issue #47): what vLLM's
``InputProcessor.process_inputs`` does for us per request (``SamplingParams.clone``, a deep copy
of ``extra_args`` included), the frontend's ``admit.on_request`` and the worker's
``decode_worker_request``, for the requests ``scripts/decode_profile.py`` sends (the Llama-8B
shape: 32 layers, hidden 4096; one steering vector, three probes, or a capture of one layer).

Prints microseconds per request for each part, the median of ``--repeats`` timings of
``--requests`` requests. To compare two trees in one run, run it under each tree's PYTHONPATH
in turn (ABAB)::

    for tree in /tmp/base $PWD /tmp/base $PWD; do PYTHONPATH=$tree .venv/bin/python scripts/admission_bench.py; done
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # benchmarks/ lives at the repo root

LAYERS, HIDDEN, LAYER = 32, 4096, 16


def processor() -> Any:
    """The input processor as admission reads it (``frontend_state`` reads the engine's facts once)."""
    hf_config = SimpleNamespace(architectures=["LlamaForCausalLM"], num_hidden_layers=LAYERS, hidden_size=HIDDEN)
    model_config = SimpleNamespace(
        hf_config=hf_config, hf_text_config=hf_config, max_model_len=2048, dtype=torch.bfloat16, get_vocab_size=lambda: 32000
    )
    config = SimpleNamespace(
        model_config=model_config,
        scheduler_config=SimpleNamespace(max_num_batched_tokens=16384),
        parallel_config=SimpleNamespace(),
        additional_config={},
        use_v2_model_runner=False,
        speculative_config=None,
    )
    return SimpleNamespace(vllm_config=config)


def extra_args(feature: str) -> dict[str, Any] | None:
    from benchmarks.config import BenchConfig
    from benchmarks.systems import System
    from benchmarks.vllm_systems import lens_extra_args

    cfg = BenchConfig(model_dir="", prompts=[], max_tokens=128, layer=LAYER, num_layers=LAYERS, hidden_size=HIDDEN, probe_count=3)
    return lens_extra_args(System(feature, feature, "vllm", lens=feature), cfg)


def measure(feature: str, requests: int) -> dict[str, float]:
    from vllm import SamplingParams

    from lens_evals.engine.frontend import admit
    from lens_evals.engine.worker.requests import decode_worker_request

    params = SamplingParams(max_tokens=128, temperature=0.0, ignore_eos=True, detokenize=False, seed=0, extra_args=extra_args(feature))
    proc = processor()
    prompt = list(range(80))
    clone_s = admit_s = decode_s = 0.0
    for index in range(requests):
        began = time.perf_counter()
        request = SimpleNamespace(sampling_params=params.clone(), prompt_token_ids=prompt, cache_salt=None)
        cloned = time.perf_counter()
        admit.on_request(proc, f"r{index}", request)
        admitted = time.perf_counter()
        worker = decode_worker_request(request.sampling_params.extra_args, torch.device("cpu"), torch.bfloat16, {})
        decoded = time.perf_counter()
        assert (worker is None) == (feature == "plain")
        clone_s, admit_s, decode_s = clone_s + cloned - began, admit_s + admitted - cloned, decode_s + decoded - admitted
        if worker is not None:
            admit.frontend_state(proc).pending.take(worker.key)  # as the fetch does: the budget is released
    return {"clone": 1e6 * clone_s / requests, "frontend": 1e6 * admit_s / requests, "worker": 1e6 * decode_s / requests}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--features", default="plain,capture-1,steer-1,probe")
    parser.add_argument("--label", default="")
    args = parser.parse_args(argv)
    np.random.seed(0)
    for feature in args.features.split(","):
        measure(feature, 16)  # warm: imports, the facts, the caches a first request fills
        runs = [measure(feature, args.requests) for _ in range(args.repeats)]
        parts = {part: statistics.median(run[part] for run in runs) for part in runs[0]}
        cells = " ".join(f"{part} {value:7.1f}" for part, value in parts.items())
        print(f"{args.label:8} {feature:10} us/request: {cells}  total {sum(parts.values()):7.1f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
