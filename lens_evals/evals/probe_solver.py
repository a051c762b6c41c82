"""Solver that scores each sample with a linear probe on the model's residual stream.

Off-policy (the conversation already ends with an assistant turn): that turn is sent with
``continue_final_message`` and one generated token, its residual stream captured, and the
probe reads the scored tokens chosen exactly as in training (``Dialogue`` rules).
On-policy (the conversation ends with a user turn or an assistant prefix): the model answers,
the stream is captured while it generates, and the probe reads the generated tokens.

By default the engine computes the per-token scores itself (probe-on-worker: only scores leave
the worker). Per-token scores and the sample's score (their mean) go to ``state.metadata["probe"]``; the
captured tensor itself is dropped after scoring (logs stay small).
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Any, Literal

import numpy as np
from inspect_ai.model import ChatMessageAssistant
from inspect_ai.solver import Generate, Solver, TaskState, solver

from lens_evals.probing.dialogues import Dialogue, render, tokenize_dialogue
from lens_evals.probing.probe import Probe, load_probe
from lens_evals.spec import CAPTURE_KEY, PROBE_KEY

PROBE_METADATA_KEY = "probe"


@lru_cache(maxsize=8)
def _tokenizer(model_name_or_path: str) -> Any:
    from transformers import AutoTokenizer

    from lens_evals.models import resolve_model

    return AutoTokenizer.from_pretrained(resolve_model(model_name_or_path))


def _chat(state: TaskState) -> list[dict[str, str]]:
    return [{"role": m.role, "content": m.text} for m in state.messages]


def _all_token_scores(state: TaskState, probe: Probe, on_worker: bool) -> np.ndarray:
    """Per-token scores for every captured position (prompt + generated - 1)."""
    activations = (state.output.metadata or {}).pop("activations", None) if state.output else None
    wanted = "probe_scores" if on_worker else "residual_stream"
    if not activations or wanted not in activations:
        raise RuntimeError("the model returned no activations: score with a vllm-lens/<model> model")
    if on_worker:
        return activations["probe_scores"][probe.card.name].double().numpy()
    return probe.token_scores(activations["residual_stream"][0].float().numpy())


@solver
def probe_scores(
    probe: str | Path | Probe,
    mode: Literal["off_policy", "on_policy"] = "off_policy",
    tokenizer: str | None = None,
    max_tokens: int = 64,
    on_worker: bool = True,
) -> Solver:
    """Score the final assistant turn (``off_policy``) or the model's own answer (``on_policy``;
    a final assistant turn is then a prefix the model continues).

    ``tokenizer``: a local model directory or embedded model name whose tokenizer matches the
    served model (default: the evaluated model's name). ``on_worker``: the engine computes the
    scores and returns only them (probe-on-worker); else the layer is captured and scored here."""
    loaded = probe if isinstance(probe, Probe) else load_probe(probe)
    capture = {"extra_args": {PROBE_KEY: [loaded.linear_probe()]} if on_worker else {CAPTURE_KEY: [loaded.layer]}}

    async def solve(state: TaskState, generate: Generate) -> TaskState:
        tok = _tokenizer(tokenizer or str(state.model).split("/", 1)[-1])
        messages = _chat(state)
        continuing = bool(messages) and messages[-1]["role"] == "assistant"
        score_from = int(state.metadata.get("score_from", 0))
        if mode == "off_policy":  # score the given assistant turn
            if not continuing:
                raise ValueError("off-policy probe scoring needs a conversation that ends with an assistant turn")
            dialogue = Dialogue(messages=messages, label=None, score_from=score_from)
            tokenized = tokenize_dialogue(tok, dialogue)
            kept = list(state.messages)
            state = await generate(state, max_tokens=1, temperature=0.0,
                                   extra_body={**capture, "continue_final_message": True, "add_generation_prompt": False})
            scores = _all_token_scores(state, loaded, on_worker)
            state.messages = kept
            if scores.shape[0] != len(tokenized.token_ids):
                raise RuntimeError(f"server tokenised {scores.shape[0]} tokens, local tokenizer {len(tokenized.token_ids)}: "
                                   "pass tokenizer= the served model's directory")
            positions = tokenized.scored_positions
        else:  # on-policy: the model answers; score its generated tokens (all but the last, never run)
            prompt_ids = tok(render(tok, messages) if continuing else tok.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True), add_special_tokens=False)["input_ids"]
            extra = {**capture, "continue_final_message": True, "add_generation_prompt": False} if continuing else capture
            state = await generate(state, max_tokens=max_tokens, temperature=0.0, extra_body=extra)
            scores = _all_token_scores(state, loaded, on_worker)
            positions = np.arange(len(prompt_ids), scores.shape[0])
            if continuing and state.output.completion:
                _merge_continuation(state)
        token_scores = scores[positions]
        state.metadata[PROBE_METADATA_KEY] = {
            "probe": loaded.card.name, "layer": loaded.layer, "threshold": loaded.card.threshold,
            "score": float(token_scores.mean()) if len(token_scores) else None,
            "n_tokens": int(len(token_scores)), "token_scores": [round(float(s), 4) for s in token_scores],
        }
        return state

    return solve


def _merge_continuation(state: TaskState) -> None:
    """With ``continue_final_message`` the reply continues the prefix turn: keep one assistant turn."""
    reply = state.messages.pop()
    prefix = state.messages.pop()
    state.messages.append(ChatMessageAssistant(content=f"{prefix.text}{reply.text}", model=getattr(reply, "model", None),
                                               metadata=reply.metadata))
