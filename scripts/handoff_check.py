"""The end of a multiprocess capture call under the hand-off settings, on this machine (issue #21).

Three ``LLM.generate`` calls of the prefill benchmark's prompt lengths (token ids, 40-400 tokens),
``max_tokens=1``, one layer captured at every token, each call's outputs held while the next runs
(as the benchmark's best-of-N and a loop of ``out = llm.generate(...)`` do), then a plain call.
Run it with ``LENS_EVALS_TIMING=1`` to see the phases (``fetch: worker round trip``, ``fetch:
attach to outputs``, ``early: write rows``), once per setting, e.g.

    LENS_EVALS_TIMING=1 VLLM_ENABLE_V1_MULTIPROCESSING=1 LENS_EVALS_HANDOFF_MIN_BYTES=1048576 \\
        LENS_EVALS_HANDOFF_POOL_MIB=1024 .venv/bin/python scripts/handoff_check.py --prompts 1000
    LENS_EVALS_TIMING=1 VLLM_ENABLE_V1_MULTIPROCESSING=1 .venv/bin/python scripts/handoff_check.py --prompts 1000
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the checkout's, not in the wheel


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-llama", help="embedded model name or a model directory")
    parser.add_argument("--prompts", type=int, default=1000)
    parser.add_argument("--layer", type=int, default=2)
    parser.add_argument("--calls", type=int, default=3)
    args = parser.parse_args()
    from pathlib import Path

    from vllm import SamplingParams

    from benchmarks.prefill import prefill_lengths
    from benchmarks.prompts import make_prompts
    from lens_evals.engine.frontend.offline import open_offline_engine

    llm = open_offline_engine(args.model, max_model_len=512, enable_prefix_caching=False, max_num_batched_tokens=16384)
    config = llm.llm_engine.model_config
    ids = make_prompts(args.prompts, Path(config.model), config.get_vocab_size(), lengths=prefill_lengths(args.prompts))  # the bench's
    prompts = [{"prompt_token_ids": prompt} for prompt in ids]
    capture = SamplingParams(max_tokens=1, temperature=0, extra_args={"output_residual_stream": [args.layer]})
    llm.generate(prompts[:8], capture, use_tqdm=False)  # warm-up
    held = None
    for call in range(args.calls):
        started = time.perf_counter()
        outputs = llm.generate(prompts, capture, use_tqdm=False)
        seconds = time.perf_counter() - started
        nbytes = sum(o.activations["residual_stream"].nbytes for o in outputs)
        print(f"capture call {call}: {seconds:.2f} s, {nbytes / 2**20:.0f} MiB", flush=True)
        held = outputs  # the last call's outputs stay alive while the next one runs
    del held
    started = time.perf_counter()
    llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)
    print(f"plain call: {time.perf_counter() - started:.2f} s", flush=True)


if __name__ == "__main__":
    main()
