"""The recipe the main job runs per embedded model: the one the recipe study chose on its Roleplaying
development split (``lens-evals probes recipes``, docs/results.md), with the study's numbers that
put the main job's result in context."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from lens_evals.probing.recipes import Aggregation, FollowUp


@dataclass(frozen=True)
class ChosenRecipe:
    training_set: str
    layers: tuple[int, ...]
    aggregation: Aggregation
    follow_up: bool
    label: str  # the study's name for it
    test_auroc: float  # on the study's test split
    others: tuple[float, float]  # lowest and highest test AUROC of the study's other recipes
    apollo_baseline: float  # today's single-layer probe on the same test split


APOLLO_70B_AUROC = 0.964  # arXiv 2502.03407, Llama-3.3-70B on Roleplaying, as released
# docs/results.md, recipe study of 2026-12-07 (SmolLM2-135M, fp32, CPU): the best development AUROC
# (0.737) of 17 recipes; on the test split 0.655 [0.578, 0.724], recall 0.02 at 1 % FPR
CHOSEN: dict[str, ChosenRecipe] = {
    "smollm2-135m-instruct": ChosenRecipe(
        training_set="varied-pairs",
        layers=(7, 11, 14, 17, 20),
        aggregation="last",
        follow_up=False,
        label="varied-pairs, ensemble of layers 7-20, last token",
        test_auroc=0.655,
        others=(0.461, 0.655),
        apollo_baseline=0.552,
    )
}


def chosen_recipe(model: str) -> ChosenRecipe | None:
    return CHOSEN.get(Path(model).name)


def follow_up_of(chosen: ChosenRecipe) -> FollowUp | None:
    return FollowUp() if chosen.follow_up else None


def samples_scope(samples: int, total: int) -> str:
    """What an eval's AUROC was measured on: every one of the dataset's ``total`` samples (an
    honest and a deceptive completion per scenario), or the first ``samples`` of them (``--limit``)."""
    if samples >= total:
        return f"all {total} samples"
    return f"{samples} of the {total} samples (--limit)"


def context_line(model: str, auroc: float, samples: int, total: int) -> str:
    """One line: the main job's AUROC on ``samples`` of the dataset's ``total`` beside chance, the
    study's recipes and Apollo's 70B."""
    scope = samples_scope(samples, total)
    chosen = chosen_recipe(model)
    if chosen is None:
        return f"AUROC {auroc:.3f} on {scope}: chance is 0.5; Apollo's 70B probe scores {APOLLO_70B_AUROC} (no recipe study for {Path(model).name})"
    low, high = chosen.others
    return (
        f"AUROC {auroc:.3f} on {scope} ({chosen.label}, chosen on the dev split; {chosen.test_auroc:.3f} on the test split): "
        f"chance 0.5, today's single-layer probe {chosen.apollo_baseline:.3f} and our other recipes {low:.3f}-{high:.3f} on the test "
        f"split (docs/results.md), Apollo's 70B {APOLLO_70B_AUROC}"
    )
