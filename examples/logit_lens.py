"""Logit lens (nostalgebraist, 2020) on the embedded SmolLM2-135M-Instruct: project the residual
stream after every layer through the final norm and the unembedding, at the last prompt
position, with the registered hook "logit_lens" (it reads the weights with ctx.get_parameter).

    python examples/logit_lens.py ["prompt"]
"""

from __future__ import annotations

import math
import sys
import time

from _engine import embedded_llm

PROMPT = "The capital of France is"
TOP_K = 3


def main() -> None:
    from vllm import SamplingParams

    from lens_evals.request.hooks import Hook

    started = time.monotonic()
    prompt = sys.argv[1] if len(sys.argv) > 1 else PROMPT
    llm = embedded_llm()
    tokenizer = llm.get_tokenizer()
    last = len(tokenizer(prompt).input_ids) - 1
    n_layers = llm.llm_engine.model_config.hf_text_config.num_hidden_layers
    lens = Hook("logit_lens", list(range(n_layers)), args={"top_k": TOP_K, "positions": [last]})
    params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=TOP_K, extra_args={"apply_hooks": [lens]})
    out = llm.generate([prompt], params)[0]
    saved = out.activations["saved"]

    print(f"prompt: {prompt!r}; top {TOP_K} next tokens read from the stream after each layer")
    print(f"{'layer':>5}  " + "  ".join(f"{'token':>12} {'p':>5}" for _ in range(TOP_K)))
    for layer in range(n_layers):
        ids, logprobs = saved[f"top_ids.{layer}"][0], saved[f"top_logprobs.{layer}"][0]
        cells = [f"{tokenizer.decode([int(i)])!r:>12} {float(lp.exp()):5.2f}" for i, lp in zip(ids, logprobs)]
        print(f"{layer:>5}  " + "  ".join(cells))
    engine = sorted(out.outputs[0].logprobs[0].items(), key=lambda item: -item[1].logprob)[:TOP_K]
    print("model  " + "  ".join(f"{tokenizer.decode([i])!r:>12} {math.exp(lp.logprob):5.2f}" for i, lp in engine))
    print(f"(the last row is the engine's own next-token distribution; {time.monotonic() - started:.1f} s)")


if __name__ == "__main__":
    main()
