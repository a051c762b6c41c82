"""Neuron ablation on the embedded SmolLM2-135M-Instruct: find the MLP neurons (any layer) that
write most towards the answer at the last position -- direct logit attribution, activation x
(W_down column . (answer unembedding - mean unembedding)) -- zero them with the registered hook
"ablate" on mlp.down_proj's input, and compare the answer's probability with zeroing as many
random neurons of the same layers. The attribution is an offline Python callable (it reads the
weights with ctx.get_parameter); the ablation uses only registered hooks.

    python examples/neuron_ablation.py [--count 10]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from _engine import embedded_llm, prompt_and_answer

PROMPT = "The capital of France is"
ANSWER = " Paris"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=10)
    args = parser.parse_args()
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from lens_evals.request.hooks import Hook

    started = time.monotonic()
    llm = embedded_llm()
    prompt_ids, answer = prompt_and_answer(llm, PROMPT, ANSWER)
    ids = TokensPrompt(prompt_token_ids=prompt_ids + [answer])
    last = len(prompt_ids) - 1

    def run(hooks: list) -> tuple[float, dict]:
        params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, extra_args={"apply_hooks": hooks})
        out = llm.generate([ids], params)[0]
        return float(np.exp(next(iter(out.prompt_logprobs[-1].values())).logprob)), out.activations["saved"]

    def direct_effect(ctx, hidden):
        """Each neuron's write towards the answer (vs the average token) at ``last``."""
        row = (ctx.positions == last).nonzero()
        if len(row):
            down = ctx.get_parameter(f"model.layers.{ctx.layer_idx}.mlp.down_proj.weight")  # (hidden, neurons)
            unembed = ctx.get_parameter("lm_head.weight")
            direction = unembed[answer] - unembed.mean(dim=0)
            ctx.saved[f"effect.{ctx.layer_idx}"] = hidden[row[0, 0]] * (direction @ down)

    n_layers = llm.llm_engine.model_config.hf_text_config.num_hidden_layers
    base, saved = run([Hook(direct_effect, list(range(n_layers)), pre=True, module="mlp.down_proj")])
    effects = np.stack([saved[f"effect.{layer}"].numpy() for layer in range(n_layers)])  # (layers, neurons)
    top = np.argsort(effects, axis=None)[::-1][: args.count]
    chosen = [np.unravel_index(flat, effects.shape) for flat in top]
    rng = np.random.default_rng(0)
    control = [(layer, int(rng.integers(effects.shape[1]))) for layer, _ in chosen]

    def ablation(pairs) -> list:
        by_layer: dict[int, list[int]] = {}
        for layer, neuron in pairs:
            by_layer.setdefault(int(layer), []).append(int(neuron))
        return [Hook("ablate", [layer], pre=True, module="mlp.down_proj", args={"indices": neurons}) for layer, neurons in by_layer.items()]

    ablated, _ = run(ablation(chosen))
    random_p, _ = run(ablation(control))
    print(f"p({ANSWER!r} | {PROMPT!r}) = {base:.4f}")
    print(f"zero the {args.count} neurons with the largest direct effect {[(int(layer), int(n)) for layer, n in chosen]}:")
    print(f"    p = {ablated:.4f} ({ablated - base:+.4f})")
    print(f"zero {args.count} random neurons of the same layers: p = {random_p:.4f} ({random_p - base:+.4f})")
    print(f"({time.monotonic() - started:.1f} s)")


if __name__ == "__main__":
    main()
