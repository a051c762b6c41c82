"""Causal tracing (Meng et al., "Locating and Editing Factual Associations in GPT") on the
embedded SmolLM2-135M-Instruct, with registered hooks only (so the same requests work against a
server): corrupt the subject's embeddings with noise (pre-hook "add" at layer 0), then restore
one clean residual-stream state per (layer, position) (post-hook "patch") and measure how much
of the answer's probability comes back ("logit_lens" at the last layer reads p(answer) at the
last position only). All layer x position runs go in one batch.

    python examples/causal_tracing.py [--out examples/out/causal_tracing.png]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
from _engine import embedded_llm, prompt_and_answer

PROMPT = "The Eiffel Tower is located in the city of"
SUBJECT = "The Eiffel Tower"
ANSWER = " Paris"
NOISE_SCALE = 3.0  # times the embeddings' standard deviation, as in the paper


def answer_probability(outputs, last_layer: int) -> np.ndarray:
    """p(answer | prompt) of each output, as read by the "logit_lens" hook at the last layer."""
    return np.array([float(o.activations["saved"][f"token_logprobs.{last_layer}"][0, 0].exp()) for o in outputs])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "out" / "causal_tracing.png")
    args = parser.parse_args()
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from lens_evals.request.hooks import Hook

    started = time.monotonic()
    llm = embedded_llm()
    tokenizer = llm.get_tokenizer()
    ids, answer = prompt_and_answer(llm, PROMPT, ANSWER)
    subject = list(range(len(tokenizer(SUBJECT).input_ids)))
    n_layers = llm.llm_engine.model_config.hf_text_config.num_hidden_layers
    last_layer = n_layers - 1
    read = Hook("logit_lens", [last_layer], args={"top_k": 0, "token_ids": [answer], "positions": [len(ids) - 1]})

    def params(hooks=(), capture=None):
        extra = {"apply_hooks": [*hooks, read]}
        if capture:
            extra["output_residual_stream"] = capture
        return SamplingParams(max_tokens=1, temperature=0.0, extra_args=extra)

    clean = llm.generate([TokensPrompt(prompt_token_ids=ids)], params(capture=list(range(n_layers))))[0]
    states = clean.activations["residual_stream"].numpy()  # (layers, positions, hidden)
    embedded = llm.generate([TokensPrompt(prompt_token_ids=ids)], params([Hook("record", [0], pre=True)]))[0]  # embeddings
    std = float(embedded.activations["saved"]["rows.0"].std())  # the embeddings' scale
    rng = np.random.default_rng(0)
    noise = (NOISE_SCALE * std * rng.normal(size=(len(subject), states.shape[-1]))).astype(np.float32)
    corrupt = Hook("add", [0], pre=True, args={"vector": noise, "positions": subject})
    corrupted = answer_probability(llm.generate([TokensPrompt(prompt_token_ids=ids)], params([corrupt])), last_layer)[0]

    positions = list(range(len(ids)))
    batch = [
        params([corrupt, Hook("patch", [layer], args={"positions": [p], "values": states[layer, p : p + 1]})])
        for layer in range(n_layers)
        for p in positions
    ]
    outputs = llm.generate([TokensPrompt(prompt_token_ids=ids)] * len(batch), batch)
    restored = answer_probability(outputs, last_layer).reshape(n_layers, len(positions)).T  # (positions, layers)
    clean_p = answer_probability([clean], last_layer)[0]

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [tokenizer.decode([t]) + ("*" if i in subject else "") for i, t in enumerate(ids)]
    fig, ax = plt.subplots(figsize=(9, 4.5))
    image = ax.imshow(restored, aspect="auto", cmap="Purples", vmin=min(corrupted, restored.min()), vmax=max(clean_p, restored.max()))
    ax.set_yticks(range(len(labels)), labels)
    ax.set_xlabel("layer whose output is restored")
    ax.set_title(f"p({ANSWER.strip()!r}) after restoring one clean state (clean {clean_p:.3f}, corrupted {corrupted:.3f})")
    fig.colorbar(image, ax=ax)
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=120)
    best = np.unravel_index(restored.argmax(), restored.shape)
    print(f"clean p={clean_p:.4f}  corrupted p={corrupted:.4f}  runs={len(batch)}")
    print(f"largest recovery: p={restored.max():.4f} restoring {labels[best[0]]!r} after layer {best[1]}")
    print(f"wrote {args.out} in {time.monotonic() - started:.1f} s")


if __name__ == "__main__":
    main()
