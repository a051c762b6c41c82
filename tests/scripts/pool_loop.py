"""A loop of offline capture calls, each call's outputs held while the next runs (``out =
llm.generate(...)``), on a multiprocess engine whose worker writes the rows into the frontend's
hand-off pool. Prints ``RESULT`` and a JSON object: each call's capture bytes and the worker's pool
size after it, whether every call's rows equal the first call's, and whether the held previous
call's rows were still intact after the next call. Then every output is dropped, one small call
tells the worker (its regions go back as a call starts), and after IDLE_WAIT seconds idle the
pool's size and allocated bytes (``LENS_EVALS_HANDOFF_POOL_IDLE_S``: idle segments give their
pages back) are printed too.

Usage: python pool_loop.py MODEL_DIR CALLS PROMPTS TOKENS ENGINE_OPTIONS_JSON IDLE_WAIT (the tests'
engine options, ``tests.conftest.engine_options``; with VLLM_ENABLE_V1_MULTIPROCESSING=1)."""

from __future__ import annotations

import gc
import json
import sys
import time


def main() -> None:
    import numpy as np
    import torch
    from vllm import LLM, SamplingParams

    from lens_evals.engine.transport.protocol import MEMORY_METHOD

    model, calls, n_prompts, n_tokens = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    llm = LLM(model, **json.loads(sys.argv[5]))
    vocab = llm.llm_engine.model_config.get_vocab_size()
    rng = np.random.default_rng(0)
    prompts = [{"prompt_token_ids": rng.integers(0, vocab, n_tokens).tolist()} for _ in range(n_prompts)]
    params = SamplingParams(max_tokens=1, temperature=0.0, extra_args={"output_residual_stream": [0, 1, 2, 3]})

    def rows(outputs: list) -> list[torch.Tensor]:
        return [output.activations["residual_stream"] for output in outputs]

    reference = [row.clone() for row in rows(llm.generate(prompts, params, use_tqdm=False))]
    capture_bytes, pool_bytes, equal, held_intact = [], [], [], []
    out = None
    for _ in range(calls):
        previous = out
        out = llm.generate(prompts, params, use_tqdm=False)
        captured = rows(out)
        capture_bytes.append(sum(row.numel() * row.element_size() for row in captured))
        (memory,) = llm.collective_rpc(MEMORY_METHOD)
        pool_bytes.append(memory["pool_bytes"])
        equal.append(all(torch.equal(got, want) for got, want in zip(captured, reference)))
        if previous is not None:
            held_intact.append(all(torch.equal(got, want) for got, want in zip(rows(previous), reference)))
        del previous, captured  # the previous call's rows die here, as at `out = ...` in a loop
    (busy,) = llm.collective_rpc(MEMORY_METHOD)
    del out
    gc.collect()
    llm.generate(prompts[:1], params, use_tqdm=False)  # its start gives the worker every region back
    time.sleep(float(sys.argv[6]))
    (idle,) = llm.collective_rpc(MEMORY_METHOD)
    result = {"capture_bytes": capture_bytes, "pool_bytes": pool_bytes, "equal": equal, "held_intact": held_intact}
    result |= {
        "allocated_busy": busy["pool_allocated_bytes"],
        "pool_idle": idle["pool_bytes"],
        "allocated_idle": idle["pool_allocated_bytes"],
    }
    print("RESULT " + json.dumps(result))
    llm.llm_engine.engine_core.shutdown()


if __name__ == "__main__":
    main()
