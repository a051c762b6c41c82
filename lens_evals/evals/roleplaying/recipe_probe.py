"""Roleplaying scored by a recipe probe (:mod:`lens_evals.probing.recipes`) in one engine pass.

Each sample's conversation is sent once, its final assistant turn left open, with the follow-up
turn appended when the card has one; every layer of the recipe goes to the worker as one linear
probe. The per-token scores that come back are averaged over the layers, the tokens the recipe
reads (the answer after its prefix, or the follow-up answer) are aggregated as the card says, and
the sample is flagged above the card's control threshold. Metrics: AUROC, recall at the 1 %-FPR
threshold, share of honest samples flagged (scorer ``probe_recipe``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from inspect_ai import Task
from inspect_ai.dataset import MemoryDataset
from inspect_ai.log import transcript
from inspect_ai.model import ChatMessageAssistant, ChatMessageUser
from inspect_ai.solver import Generate, Solver, TaskState, solver

from lens_evals.evals.roleplaying.multi_probe import PROBES_METADATA_KEY, kind_scorer
from lens_evals.evals.roleplaying.scenarios import roleplaying_samples
from lens_evals.inspect_kit.probe_reading import INFO_SOURCE
from lens_evals.inspect_kit.probe_solver import check_probe_model, given_turn_reading, send_given_turn, served_tokenizer, state_chat
from lens_evals.inspect_kit.provider.outputs import output_activations, output_token_ids
from lens_evals.probing.datasets import load_roleplaying
from lens_evals.probing.dialogues import Dialogue
from lens_evals.probing.recipes import RecipeProbe, aggregate, load_recipe
from lens_evals.request.spec import PROBE_KEY

RECIPE_KIND = "recipe"


def recipe_reading(
    recipe: RecipeProbe, tok: Any, dialogue: Dialogue, worker_scores: dict[str, Any], served_ids: list[int] | None
) -> dict[str, Any]:
    """The sample's reading from the worker's per-layer token scores of ``dialogue`` (as sent)."""
    per_layer = {layer: np.asarray(worker_scores[recipe.readout_name(layer)].double().numpy()) for layer in recipe.card.layers}
    reading = given_turn_reading(
        tok,
        dialogue.messages,
        dialogue.score_from,
        recipe.combine(per_layer),
        recipe.name,
        recipe.card.layers[0],
        recipe.card.threshold,
        served_ids=served_ids,
    )
    transcript().info(reading.event_data(), source=INFO_SOURCE)
    first, end = reading.scored
    score = aggregate(np.array(reading.token_scores[first:end]), recipe.card.aggregation)
    return {
        "readout": recipe.name,
        "layer": recipe.card.layers,
        "aggregation": recipe.card.aggregation,
        "score": score,
        "threshold": recipe.card.threshold,
        "flagged": score > recipe.card.threshold,
        "n_tokens": reading.n_scored,
    }


@solver
def recipe_scores(recipe: RecipeProbe, tokenizer: str | None = None) -> Solver:
    """Score the final assistant turn (or the follow-up answer) with ``recipe`` in one request."""
    follow_up = recipe.card.follow_up

    async def solve(state: TaskState, generate: Generate) -> TaskState:
        check_probe_model(state, recipe.card.model, recipe.name)
        tok = served_tokenizer(state, tokenizer)
        messages = state_chat(state)
        if not messages or messages[-1]["role"] != "assistant":
            raise ValueError("recipe scoring needs a conversation that ends with the assistant turn to score")
        dialogue = recipe.dialogue(Dialogue(messages=messages, label=None, score_from=int(state.metadata.get("score_from", 0))))
        kept = list(state.messages)
        if follow_up is not None:  # sent with the follow-up turn; the sample keeps its own conversation
            state.messages = [*kept, ChatMessageUser(content=follow_up.question), ChatMessageAssistant(content=follow_up.answer)]
        state = await send_given_turn(state, generate, {"extra_args": {PROBE_KEY: recipe.linear_probes()}, "return_token_ids": True})
        state.messages = kept
        worker_scores = output_activations(state.output, "probe_scores")["probe_scores"]
        reading = recipe_reading(recipe, tok, dialogue, worker_scores, output_token_ids(state.output)["prompt"])
        state.metadata[PROBES_METADATA_KEY] = {**state.metadata.get(PROBES_METADATA_KEY, {}), RECIPE_KIND: reading}
        return state

    return solve


def roleplaying_recipe_task(recipe: str | Path | RecipeProbe, dataset: str | Path | None = None, tokenizer: str | None = None) -> Task:
    """Off-policy Roleplaying scored by one recipe probe (``NAME.recipe.json``)."""
    loaded = recipe if isinstance(recipe, RecipeProbe) else load_recipe(recipe)
    name = "roleplaying_recipe"
    return Task(
        name=name,
        dataset=MemoryDataset(roleplaying_samples(load_roleplaying(dataset), "off_policy"), name=name),
        solver=recipe_scores(loaded, tokenizer=tokenizer),
        scorer=[kind_scorer(RECIPE_KIND)],
        metadata={"recipe": loaded.card.model_dump(mode="json"), "dataset": str(dataset or "lens_evals roleplaying scenarios")},
    )
