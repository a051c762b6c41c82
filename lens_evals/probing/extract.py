"""Activations for probe training, from the offline vLLM engine with our capture (batched).

Each dialogue is sent as token ids rendered by :func:`tokenize_dialogue`, so the captured rows
are exactly the positions the probe will read at evaluation time.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from lens_evals.probing.dialogues import Dialogue, TokenSelection, tokenize_dialogue
from lens_evals.request.spec import CAPTURE_KEY


def extract_features(
    llm: Any,
    dialogues: Sequence[Dialogue],
    layers: Sequence[int],
    selection: TokenSelection = "all",
    batch_size: int = 64,
    desc: str = "capturing",
) -> list[np.ndarray]:
    """Per dialogue, the residual stream at its scored tokens: ``(n_layers, n_scored, hidden)``."""
    from vllm import SamplingParams

    tokenizer = llm.get_tokenizer()
    tokenized = [tokenize_dialogue(tokenizer, d, selection) for d in dialogues]
    params = SamplingParams(max_tokens=1, temperature=0.0, extra_args={CAPTURE_KEY: sorted(layers)})
    features: list[np.ndarray] = []
    with tqdm(total=len(tokenized), desc=desc, unit="dialogue") as progress:
        for begin in range(0, len(tokenized), batch_size):
            chunk = tokenized[begin : begin + batch_size]
            outputs = llm.generate([{"prompt_token_ids": t.token_ids} for t in chunk], params, use_tqdm=False)
            for item, output in zip(chunk, outputs):
                stream = output.activations["residual_stream"]  # (n_layers, n_tokens, hidden)
                if stream.shape[1] != len(item.token_ids):
                    raise RuntimeError(f"captured {stream.shape[1]} rows for a {len(item.token_ids)}-token prompt")
                features.append(stream[:, item.scored_positions].float().numpy())
            progress.update(len(chunk))
    return features


def answer_requests(llm: Any, requests: Sequence[str], max_tokens: int = 64) -> list[Dialogue]:
    """The model's own greedy answers to benign requests, as label-0 dialogues (the control set)."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    conversations = [[{"role": "user", "content": request}] for request in requests]
    outputs = llm.chat(conversations, params, use_tqdm=True)
    dialogues = []
    for index, (conversation, output) in enumerate(zip(conversations, outputs)):
        answer = output.outputs[0].text.strip()
        if not answer:
            continue
        dialogues.append(Dialogue(messages=[*conversation, {"role": "assistant", "content": answer}], label=0, group=f"control-{index}"))
    return dialogues
