"""Train one recipe probe (``lens-evals probes train --layers 7,10,14 --aggregation max --follow-up``):
capture the training set at the recipe's layers (the follow-up appended if it has one), fit one
readout per layer, measure validation AUROC on held-out groups, set the threshold at 1 % FPR on
the model's own answers to the benign control requests (read the same way), save the card."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from lens_evals.engine.frontend.offline import engine_for
from lens_evals.probing import datasets
from lens_evals.probing.dialogues import Dialogue
from lens_evals.probing.extract import answer_requests
from lens_evals.probing.known_lies import KNOWN_LIES, MIN_LIE_PAIRS, known_lie_dialogues
from lens_evals.probing.metrics import auroc
from lens_evals.probing.probe import ProbeCard
from lens_evals.probing.recipes import Aggregation, FollowUp, RecipeProbe, fit_recipe, with_follow_up
from lens_evals.probing.train import LayerFeatures, capture, load_training_set, probe_dir, split_groups

logger = logging.getLogger(__name__)


def relative_layers(n_layers: int, low: float = 0.25, high: float = 0.70, count: int = 5) -> list[int]:
    """``count`` layers evenly spread over ``low``..``high`` of depth (layer / (n_layers - 1))."""
    if n_layers < 1 or not 0 <= low <= high <= 1:
        raise ValueError(f"need n_layers >= 1 and 0 <= low <= high <= 1, got {n_layers}, {low}, {high}")
    return sorted({int(round(d * (n_layers - 1))) for d in np.linspace(low, high, count)})


def capture_recipe_view(
    engine: Any, dialogues: Sequence[Dialogue], layers: Sequence[int], follow_up: FollowUp | None, desc: str
) -> LayerFeatures:
    """Activations at ``layers`` of the tokens a recipe with ``follow_up`` reads in each dialogue."""
    return capture(engine, [with_follow_up(d, follow_up) for d in dialogues], layers, "all", desc=desc)


def stacked(data: LayerFeatures, layers: Sequence[int]) -> list[np.ndarray]:
    """Per dialogue ``(len(layers), n_tokens, hidden)`` in the order of ``layers``."""
    index = [data.layers.index(layer) for layer in layers]
    return [f[index] for f in data.features]


def recipe_name(model: str, training_set: str, layers: Sequence[int], aggregation: str, follow_up: FollowUp | None) -> str:
    layer_part = "L" + "-".join(str(layer) for layer in layers)
    return f"{Path(model).name}__{training_set}__{layer_part}__{aggregation}{'__follow-up' if follow_up else ''}"


def train_recipe(
    model: str,
    layers: Sequence[int] | None = None,
    aggregation: Aggregation = "mean",
    follow_up: FollowUp | None = None,
    training_set: str = "instructed-pairs",
    C: float = 0.1,
    out_dir: str | Path | None = None,
    name: str | None = None,
    llm: Any = None,
    limit: int | None = None,
    control_limit: int | None = None,
    control_max_tokens: int = 48,
    seed: int = 0,
    engine_args: dict[str, Any] | None = None,
) -> RecipeProbe:
    """Train, validate, calibrate and save one recipe; ``layers`` default: 5 layers over 25-70 % of depth."""
    with engine_for(model, llm, engine_args) as engine:
        n_layers = int(engine.llm_engine.model_config.hf_config.num_hidden_layers)
        layer_list = list(layers) if layers else relative_layers(n_layers)
        if max(layer_list) >= n_layers:
            raise ValueError(f"layers {layer_list}: {Path(model).name} has layers 0..{n_layers - 1}")
        if training_set == KNOWN_LIES:  # on-policy: the model's own answers, built with this engine
            dialogues = known_lie_dialogues(lambda: engine, None, model, limit)
            if len(dialogues) < 2 * MIN_LIE_PAIRS:
                raise ValueError(
                    f"{Path(model).name} gave {len(dialogues) // 2} known-truth lie pairs (right when honest, a lie when told to lie); "
                    f"a recipe needs {MIN_LIE_PAIRS} or more"
                )
        else:
            dialogues = load_training_set(training_set, limit, seed)
        data = capture_recipe_view(engine, dialogues, layer_list, follow_up, desc=f"{training_set} layers {layer_list}")
        features, labels = stacked(data, layer_list), np.array(data.labels)
        train_index, val_index = split_groups(dialogues, seed=seed)
        name = name or recipe_name(model, training_set, layer_list, aggregation, follow_up)
        train_features = [features[i] for i in train_index]  # fitted on the training groups only, as `probes train` does
        recipe = fit_recipe(
            name, Path(model).name, layer_list, train_features, labels[train_index], aggregation, follow_up, training_set, C
        )
        val_auroc = auroc(labels[val_index], recipe.scores([features[i] for i in val_index]))
        control = answer_requests(engine, datasets.control_requests()[:control_limit], max_tokens=control_max_tokens)
        control_features = stacked(capture_recipe_view(engine, control, layer_list, follow_up, desc="control answers"), layer_list)
        recipe.calibrate(control_features)
        recipe.card = recipe.card.model_copy(
            update={
                "validation_auroc": val_auroc,
                "dtype": str(engine.llm_engine.model_config.dtype).removeprefix("torch."),
                "control_set": f"lens_evals benign_requests.yaml answered by the model (greedy, {control_max_tokens} tokens)",
                "chosen_by": "given on the command line" if layers else "5 layers evenly over 25-70 % of depth (Nordby et al. 2026)",
                "versions": ProbeCard.current_versions(),
                "created": ProbeCard.today(),
            }
        )
        saved = recipe.save(out_dir if out_dir is not None else probe_dir())
        logger.warning("saved %s: validation AUROC %.3f, threshold %.3f at 1%% FPR", saved, val_auroc, recipe.card.threshold)
        return recipe


def ensure_chosen_recipe(model: str, control_limit: int = 300, control_max_tokens: int = 32) -> Path | None:
    """The recipe the study chose for ``model`` (``NAME.recipe.json`` in the probe directory),
    trained if missing; None for a model the study has not covered."""
    from lens_evals.probing.recipe_defaults import chosen_recipe, follow_up_of
    from lens_evals.probing.recipes import recipe_files

    chosen = chosen_recipe(model)
    if chosen is None:
        return None
    follow_up = follow_up_of(chosen)
    path = recipe_files(probe_dir() / recipe_name(model, chosen.training_set, chosen.layers, chosen.aggregation, follow_up))[0]
    if not path.is_file():
        logger.warning("no recipe at %s: training it (a few minutes on CPU)", path)
        train_recipe(
            model,
            list(chosen.layers),
            chosen.aggregation,
            follow_up,
            chosen.training_set,
            control_limit=control_limit,
            control_max_tokens=control_max_tokens,
        )
    return path
