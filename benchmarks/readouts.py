"""Readouts (``output_readouts``) against plain requests and a one-layer capture, in alternating
rounds on ONE engine (as ``interleaved.py`` does for the other features): per round every feature
runs back to back in a rotating order; the report is each feature's median time paired with
the same round's plain time.

    PYTHONPATH=$PWD .venv/bin/python -m benchmarks.readouts --model smollm2-135m-instruct --prompts 8 --max-tokens 16

Features: ``plain``; ``capture-1`` (the middle layer's stream); ``probe`` (one probe, middle
layer); ``lens-1`` (logit lens top-10 at the middle layer); ``lens-all`` (logit lens top-10 at
every layer); ``sae-1`` (a 16x-wide random ReLU SAE at the middle layer, top-16); ``tuned-all``
(an affine lens on every layer, top-10: its weights, ``layers x hidden x hidden`` float32, reach
the workers once, as a file) and ``tuned-all:inline`` (the same lens with the hand-off off, so its
weights travel with every request, as they did before ``transport/readout_files.py``)."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import time
from typing import Any
from unittest import mock

import numpy as np

from benchmarks.interleaved import rotated, summarise

FEATURES = ("plain", "capture-1", "probe", "lens-1", "lens-all", "sae-1", "tuned-all", "tuned-all:inline")
INLINE = ":inline"  # the feature with LENS_EVALS_HANDOFF=0 for its calls


def extra_args(feature: str, layers: int, hidden: int) -> dict[str, Any] | None:
    from lens_evals import LinearProbe
    from lens_evals.request.readouts import AffineLens, LensReadout, SaeEncoder, SaeReadout

    mid = layers // 2
    rng = np.random.default_rng(0)
    if feature == "plain":
        return None
    if feature == "capture-1":
        return {"output_residual_stream": [mid]}
    if feature == "probe":
        return {"output_probe_scores": [LinearProbe(name="p", layer=mid, weights=rng.normal(size=hidden).astype(np.float32))]}
    if feature == "lens-1":
        return {"output_readouts": [LensReadout(name="l", layers=[mid], top_k=10)]}
    if feature == "lens-all":
        return {"output_readouts": [LensReadout(name="l", layers="all", top_k=10)]}
    if feature.startswith("tuned-all"):
        near_identity = np.eye(hidden, dtype=np.float32) + rng.normal(scale=0.01, size=(layers, hidden, hidden)).astype(np.float32)
        lens = AffineLens(layers=list(range(layers)), weights=near_identity)
        return {"output_readouts": [LensReadout(name="t", layers="all", top_k=10, lens=lens)]}
    width = 16 * hidden
    sae = SaeEncoder(W_enc=rng.normal(size=(hidden, width)).astype(np.float32) / np.sqrt(hidden), b_enc=np.zeros(width, np.float32))
    return {"output_readouts": [SaeReadout(name="s", layer=mid, top_k=16, sae=sae)]}


def _handoff(on: bool) -> contextlib.AbstractContextManager[Any]:
    """``LENS_EVALS_HANDOFF`` for the calls inside (the frontend reads it per request)."""
    from lens_evals import settings

    return mock.patch.dict(os.environ, {settings.HANDOFF.name: "1" if on else "0"})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dtype", default="auto")
    args = parser.parse_args()

    from vllm import SamplingParams

    from lens_evals.engine.frontend.offline import open_offline_engine

    llm = open_offline_engine(args.model, dtype=args.dtype, enable_prefix_caching=False)
    config = llm.llm_engine.model_config.hf_config
    layers, hidden = config.num_hidden_layers, config.hidden_size
    rng = np.random.default_rng(1)
    prompts: list[Any] = [{"prompt_token_ids": rng.integers(100, 5000, size=args.prompt_tokens).tolist()} for _ in range(args.prompts)]
    params = {
        f: SamplingParams(
            max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True, detokenize=False, extra_args=extra_args(f, layers, hidden)
        )
        for f in FEATURES
    }
    for f in FEATURES:  # warm-up (and the SAE's and the lens's weights sent once)
        with _handoff(not f.endswith(INLINE)):
            llm.generate(prompts[:2], params[f], use_tqdm=False)
    times: dict[str, list[float]] = {f: [] for f in FEATURES}
    for round_index in range(args.rounds):
        for feature in rotated(FEATURES, round_index):
            with _handoff(not feature.endswith(INLINE)):
                began = time.perf_counter()
                llm.generate(prompts, params[feature], use_tqdm=False)
                times[feature].append(time.perf_counter() - began)
    summary = summarise(times)
    device = "cuda" if llm.llm_engine.vllm_config.device_config.device_type == "cuda" else "cpu"
    print(json.dumps({"model": args.model, "device": device, "host": platform.node(), "args": vars(args), "summary": summary}, indent=1))
    for feature, row in summary.items():
        print(f"{feature:10s} median {row['median_s']:.3f}s  x plain (paired median) {row['x_plain_paired_median']:.3f}")


if __name__ == "__main__":
    main()
