"""The steering eval's solver and scorer. Each sample is one item at one (layer, scale): the
solver sends, with the steering vector added after that layer (scale 0: nothing added),

* each reference completion teacher-forced after the answer prefix, for its log-probability
  (vLLM's prompt log-probs of the steered forward pass);
* the answer prefix for the model to continue greedily: the steered text;

and the steered text once more without steering, for its perplexity under the plain model."""

from __future__ import annotations

import math
from typing import Any, cast

import numpy as np
from inspect_ai.model import ChatMessageAssistant, GenerateConfig, Model, ModelOutput, get_model
from inspect_ai.scorer import Metric, SampleScore, Score, Target, Value, metric, scorer
from inspect_ai.solver import Generate, Solver, TaskState, solver

from lens_evals.evals.steering_effect.concepts import Concept, Item
from lens_evals.evals.steering_effect.measures import continuation_logprobs, perplexity, word_balance
from lens_evals.evals.steering_effect.vectors import chat, mean_difference
from lens_evals.inspect_kit.provider.api import VLLMLensAPI
from lens_evals.inspect_kit.provider.outputs import (
    NOT_A_LENS_MODEL,
    PROMPT_TOKEN_IDS_KEY,
    TOKEN_IDS_KEY,
    output_prompt_logprobs,
    output_token_ids,
)
from lens_evals.request.spec import STEERING_KEY, SteeringVector

STEERING_METADATA_KEY = "steering"
CONTINUE = {"continue_final_message": True, "add_generation_prompt": False}


def _extra_body(steering: SteeringVector | None, **more: Any) -> dict[str, Any]:
    return {**CONTINUE, **more, **({"extra_args": {STEERING_KEY: [steering]}} if steering is not None else {})}


async def _continuation(model: Model, item: Item, text: str, prefix_ids: list[int], steering: SteeringVector | None) -> list[float]:
    """Log-probabilities of ``text``'s tokens after the answer prefix (teacher-forced)."""
    messages = [*item.messages, {"role": "assistant", "content": item.answer_prefix + text}]
    config = GenerateConfig(max_tokens=1, temperature=0.0, extra_body=_extra_body(steering, prompt_logprobs=0))
    output = await model.generate(chat(messages), config=config)
    prompt_logprobs = output_prompt_logprobs(output)
    return continuation_logprobs(prompt_logprobs, output_token_ids(output)["prompt"], prefix_ids)


async def _steered_text(model: Model, item: Item, steering: SteeringVector | None, max_tokens: int) -> ModelOutput:
    messages = [*item.messages, {"role": "assistant", "content": item.answer_prefix}]
    config = GenerateConfig(max_tokens=max_tokens, temperature=0.0, extra_body=_extra_body(steering))
    return await model.generate(chat(messages), config=config)


def _api(model: Model) -> VLLMLensAPI:
    api = model.api  # (the registered name VLLMLensAPI is Inspect's factory, not the class: no isinstance)
    if not callable(getattr(api, "tokenize", None)) or not callable(getattr(api, "server_json", None)):
        raise RuntimeError(f"the steering eval steers the served model's residual stream: {NOT_A_LENS_MODEL}")
    return cast(VLLMLensAPI, api)


@solver
def steering_sweep(concept: Concept, layers: list[int], vector: np.ndarray | None = None, max_tokens: int = 24) -> Solver:
    """``vector``: ``(len(layers), hidden)``; None computes the concept's mean difference on the model."""

    async def solve(state: TaskState, generate: Generate) -> TaskState:
        model = get_model()
        api = _api(model)
        item = concept.items[int(state.metadata["item"])]
        layer, scale = int(state.metadata["layer"]), float(state.metadata["scale"])
        vectors = vector if vector is not None else await mean_difference(model, concept, layers)
        row = vectors[layers.index(layer)]
        steering = SteeringVector(activations=row[None, :], layer_indices=[layer], scale=scale) if scale != 0 else None
        prefix = [*item.messages, {"role": "assistant", "content": item.answer_prefix}]
        prefix_ids = await api.tokenize(messages=prefix, continue_final_message=True)
        positive = await _continuation(model, item, item.positive, prefix_ids, steering)
        negative = await _continuation(model, item, item.negative, prefix_ids, steering)
        output = await _steered_text(model, item, steering, max_tokens)
        for key in (TOKEN_IDS_KEY, PROMPT_TOKEN_IDS_KEY):  # a steered request's ids: not for the log
            (output.metadata or {}).pop(key, None)
        text = output.completion
        fluency = await _continuation(model, item, text, prefix_ids, None) if text.strip() else []
        state.output = output
        state.messages.append(ChatMessageAssistant(content=item.answer_prefix + text))
        state.metadata[STEERING_METADATA_KEY] = {
            "logprob_positive": sum(positive),
            "logprob_negative": sum(negative),
            "word_balance": word_balance(text, concept),
            "perplexity": perplexity(fluency),
            "text": text,
            "vector_norm": float(np.linalg.norm(row)),
        }
        return state

    return solve


@metric
def finite_mean() -> Metric:
    """The mean of the finite values (a steered text of only whitespace has no perplexity: nan)."""

    def compute(scores: list[SampleScore]) -> Value:
        values = [float(s.score.as_float()) for s in scores]
        finite = [v for v in values if math.isfinite(v)]
        return float(np.mean(finite)) if finite else math.nan

    return compute


@scorer(metrics={"*": [finite_mean()]})
def steering_scorer(concept_has_words: bool = True) -> Any:
    """Per sample: ``logprob_diff`` (log P(positive reference) - log P(negative reference)),
    ``word_balance`` (net fraction of the concept's positive words; concepts with word lists),
    ``perplexity`` (of the steered text under the unsteered model; nan for a text of only whitespace).
    ``Score.metadata`` has the layer, the scale and every number."""

    async def score(state: TaskState, target: Target) -> Score:
        found = state.metadata[STEERING_METADATA_KEY]
        value = {"logprob_diff": found["logprob_positive"] - found["logprob_negative"], "perplexity": found["perplexity"]}
        if concept_has_words:
            value["word_balance"] = found["word_balance"]
        return Score(
            value=value,
            answer=found["text"],
            explanation=f"layer {state.metadata['layer']}, scale {state.metadata['scale']:g}",
            metadata={key: state.metadata[key] for key in ("concept", "item", "layer", "scale")} | found,
        )

    return score
