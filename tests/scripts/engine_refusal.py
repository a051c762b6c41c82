"""An engine the plugin cannot serve lens requests on, in a process of its own (both engines
below leave state behind that breaks later tests in the same process: vLLM's Transformers backend
rewrites transformers' classes, n-gram speculative decoding leaves its compiled kernels):
plain requests are served, a lens request is refused; the refusal is printed last.

    python tests/scripts/engine_refusal.py transformers-backend|speculative MODEL_DIR
"""

from __future__ import annotations

import faulthandler
import os
import sys
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

ENGINES = {
    "transformers-backend": {"model_impl": "transformers"},
    "speculative": {"speculative_config": {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3, "prompt_lookup_min": 2}},
}
PROMPT = "1 2 3 4 1 2 3 4 1 2"
# Past this many seconds every thread's stack is printed and the process exits: the caller's
# report says where it stood (2026-12-04, H200: the speculative engine ran on past 7 minutes
# with nothing in the log)
STACKS_AFTER_S = 150


def main(mode: str, path: str) -> None:
    from vllm import LLM, SamplingParams

    from lens_evals.engine.frontend.attach import LensRequestError
    from tests.device import gpu_share

    faulthandler.dump_traceback_later(STACKS_AFTER_S, exit=True)
    options = gpu_share()  # on a GPU: a share of the device beside the test process's engine
    llm = LLM(path, dtype="float32", max_model_len=1024, seed=0, **ENGINES[mode], **options)
    plain = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    lens = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, extra_args={"output_residual_stream": [1]})
    try:
        assert len(llm.generate([PROMPT], plain)[0].outputs[0].token_ids) == 4
        try:
            llm.generate([PROMPT], lens)
        except (LensRequestError, ValueError) as exc:
            print(f"{type(exc).__name__}: {exc}", flush=True)
        else:
            sys.exit("the lens request was not refused")
        assert len(llm.generate([PROMPT], plain)[0].outputs[0].token_ids) == 4  # the engine goes on
    finally:
        llm.llm_engine.engine_core.shutdown()


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests.device
    main(sys.argv[1], sys.argv[2])
