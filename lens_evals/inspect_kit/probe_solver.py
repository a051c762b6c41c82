"""Solver that scores each sample with a linear probe on the model's residual stream.

Off-policy (the conversation already ends with an assistant turn): that turn is sent with
``continue_final_message`` and one generated token, its residual stream captured, and the
probe reads the scored tokens chosen exactly as in training (``Dialogue`` rules).
On-policy (the conversation ends with a user turn or an assistant prefix): the model answers,
the stream is captured while it generates, and the probe reads the generated tokens.

By default the engine computes the per-token scores itself (probe-on-worker: only scores leave
the worker). The response's tokens with their scores are logged once, as an info event
(:mod:`lens_evals.inspect_kit.probe_reading`); the sample's score (the mean over the scored tokens) and
what the scorer needs go to ``state.metadata["probe"][PROBE_NAME]`` (several ``probe_scores``
solvers may read one sample, each with its own probe). The captured tensor and the server's
token ids (checked against the local tokenizer's) are dropped after scoring (logs stay small).
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Any, Literal

import numpy as np
from inspect_ai.log import transcript
from inspect_ai.model import ChatMessageAssistant
from inspect_ai.solver import Generate, Solver, TaskState, solver

from lens_evals.inspect_kit.probe_reading import INFO_SOURCE, ProbeReading, decoded_texts, final_message_rows, token_texts
from lens_evals.inspect_kit.provider.outputs import output_activations, output_token_ids
from lens_evals.probing.dialogues import Dialogue, render, tokenize_dialogue
from lens_evals.probing.probe import Probe, load_probe
from lens_evals.request.spec import CAPTURE_KEY, PROBE_KEY

PROBE_METADATA_KEY = "probe"


@lru_cache(maxsize=8)
def _local_tokenizer(model_name_or_path: str) -> Any:
    from transformers import AutoTokenizer

    from lens_evals.models.registry import resolve_model

    return AutoTokenizer.from_pretrained(resolve_model(model_name_or_path))


def served_tokenizer(state: TaskState, tokenizer: str | None) -> Any:
    """The local tokenizer of the served model: ``tokenizer`` (a directory or embedded model name), else the evaluated model's name."""
    return _local_tokenizer(tokenizer or str(state.model).split("/", 1)[-1])


def check_probe_model(state: TaskState, trained_on: str, probe_name: str) -> None:
    """Refuse a probe trained on another model than the evaluated one (``vllm-lens/NAME`` or
    ``vllm-lens/DIR``: its last path part). Models of one shape (hidden size, layers) pass every
    engine check, so the scores would silently read another model's activations."""
    served = Path(str(state.model).split("/", 1)[-1]).name
    if trained_on != served:
        raise ValueError(
            f"probe {probe_name} was trained on {trained_on}, not on the evaluated model {served}: its scores would read "
            f"another model's activations (train one with `lens-evals probes train --model {served}`)"
        )


def state_chat(state: TaskState) -> list[dict[str, str]]:
    return [{"role": m.role, "content": m.text} for m in state.messages]


async def send_given_turn(state: TaskState, generate: Generate, extra_body: dict[str, Any]) -> TaskState:
    """The conversation as it is, its final assistant turn left open (``continue_final_message``),
    with one generated token and ``extra_body``'s lens request; the conversation is kept unchanged.
    Every off-policy reading of a given turn (one probe or several) sends it this way."""
    kept = list(state.messages)
    state = await generate(
        state, max_tokens=1, temperature=0.0, extra_body={**extra_body, "continue_final_message": True, "add_generation_prompt": False}
    )
    state.messages = kept
    return state


def _all_token_scores(state: TaskState, probe: Probe, on_worker: bool) -> np.ndarray:
    """Per-token scores for every captured position (prompt + generated - 1)."""
    if on_worker:
        worker_scores: np.ndarray = output_activations(state.output, "probe_scores")["probe_scores"][probe.card.name].double().numpy()
        return worker_scores
    return probe.token_scores(output_activations(state.output, "residual_stream")["residual_stream"][0].float().numpy())


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
    lens = {"extra_args": {PROBE_KEY: [loaded.linear_probe()]} if on_worker else {CAPTURE_KEY: [loaded.layer]}, "return_token_ids": True}

    async def solve(state: TaskState, generate: Generate) -> TaskState:
        check_probe_model(state, loaded.card.model, loaded.card.name)
        tok = served_tokenizer(state, tokenizer)
        messages = state_chat(state)
        continuing = bool(messages) and messages[-1]["role"] == "assistant"
        if mode == "off_policy":  # score the given assistant turn
            if not continuing:
                raise ValueError("off-policy probe scoring needs a conversation that ends with an assistant turn")
            state = await send_given_turn(state, generate, lens)
            scores, token_ids = _all_token_scores(state, loaded, on_worker), output_token_ids(state.output)
            reading = given_turn_reading(
                tok,
                messages,
                int(state.metadata.get("score_from", 0)),
                scores,
                loaded.card.name,
                loaded.layer,
                float(loaded.card.threshold),
                served_ids=token_ids["prompt"],
            )
        else:  # on-policy: the model answers; score its generated tokens (all but the last, never run)
            extra = {**lens, "continue_final_message": True, "add_generation_prompt": False} if continuing else lens
            state = await generate(state, max_tokens=max_tokens, temperature=0.0, extra_body=extra)
            scores, token_ids = _all_token_scores(state, loaded, on_worker), output_token_ids(state.output)
            reading = _read_answer(tok, messages, continuing, scores, token_ids, loaded)
            if continuing and state.output.completion:
                _merge_continuation(state)
        transcript().info(reading.event_data(), source=INFO_SOURCE)
        state.metadata[PROBE_METADATA_KEY] = {**state.metadata.get(PROBE_METADATA_KEY, {}), loaded.card.name: reading.summary()}
        return state

    return solve


def _same_tokens(local: list[int], served: list[int]) -> None:
    if local != served:
        raise RuntimeError(
            f"the server tokenised the chat into {len(served)} tokens, the local tokenizer into {len(local)} "
            "(or into other ids): pass tokenizer= the served model's directory"
        )


def given_turn_reading(
    tok: Any,
    messages: list[dict[str, str]],
    score_from: int,
    scores: np.ndarray,
    name: str,
    layer: int,
    threshold: float,
    served_ids: list[int] | None = None,
) -> ProbeReading:
    """Off-policy: every token of the final turn with its score (``scores``: one per token of the
    chat), scored from ``score_from`` (``Dialogue`` rules). ``served_ids``: the server's token ids,
    checked against the local tokenizer's."""
    tokenized = tokenize_dialogue(tok, Dialogue(messages=messages, label=None, score_from=score_from))
    if served_ids is not None:
        _same_tokens(tokenized.token_ids, served_ids)
    if scores.shape[0] != len(tokenized.token_ids):
        raise RuntimeError(f"{scores.shape[0]} scores for {len(tokenized.token_ids)} tokens")
    text = render(tok, messages)
    offsets = tok(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    rows, _ = final_message_rows(text, offsets, messages[-1]["content"])
    first = rows.index(int(tokenized.scored_positions[0]))
    content = messages[-1]["content"]
    return ProbeReading(
        probe=name,
        layer=layer,
        threshold=threshold,
        tokens=token_texts(text, offsets, rows),
        token_scores=[float(s) for s in scores[rows]],
        scored=(first, first + len(tokenized.scored_positions)),
        answer_from=score_from + len(content[score_from:]) - len(content[score_from:].lstrip()),
    )


def _read_answer(
    tok: Any, messages: list[dict[str, str]], continuing: bool, scores: np.ndarray, token_ids: dict[str, list[int]], probe: Probe
) -> ProbeReading:
    """On-policy: the generated tokens that the model read (all but the last), after the
    prefix's tokens when it continued an assistant prefix (shown, not scored)."""
    text = render(tok, messages) if continuing else tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    encoded = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    prompt_ids = list(encoded["input_ids"])
    _same_tokens(prompt_ids, token_ids["prompt"])
    generated = token_ids["completion"][: max(scores.shape[0] - len(prompt_ids), 0)]
    prefix_rows = final_message_rows(text, encoded["offset_mapping"], messages[-1]["content"])[0] if continuing else []
    tokens = [*token_texts(text, encoded["offset_mapping"], prefix_rows), *decoded_texts(tok, prompt_ids, generated)]
    rows = [*prefix_rows, *range(len(prompt_ids), len(prompt_ids) + len(generated))]
    return ProbeReading(
        probe=probe.card.name,
        layer=probe.layer,
        threshold=float(probe.card.threshold),
        tokens=tokens,
        token_scores=[float(s) for s in scores[rows]],
        scored=(len(prefix_rows), len(rows)),
        answer_from=len(messages[-1]["content"]) if continuing else 0,
    )


def _merge_continuation(state: TaskState) -> None:
    """With ``continue_final_message`` the reply continues the prefix turn: keep one assistant turn."""
    reply = state.messages.pop()
    prefix = state.messages.pop()
    state.messages.append(
        ChatMessageAssistant(content=f"{prefix.text}{reply.text}", model=getattr(reply, "model", None), metadata=reply.metadata)
    )
