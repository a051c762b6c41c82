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
CHOSEN: dict[str, ChosenRecipe] = {}


def chosen_recipe(model: str) -> ChosenRecipe | None:
    return CHOSEN.get(Path(model).name)


def follow_up_of(chosen: ChosenRecipe) -> FollowUp | None:
    return FollowUp() if chosen.follow_up else None


def context_line(model: str, auroc: float) -> str:
    """One line: the main job's AUROC beside chance, the study's recipes and Apollo's 70B."""
    chosen = chosen_recipe(model)
    if chosen is None:
        return f"AUROC {auroc:.3f}: chance is 0.5; Apollo's 70B probe scores {APOLLO_70B_AUROC} (no recipe study for {Path(model).name})"
    low, high = chosen.others
    return (
        f"AUROC {auroc:.3f} on all 144 scenarios ({chosen.label}, chosen on the dev split; {chosen.test_auroc:.3f} on the test split): "
        f"chance 0.5, today's single-layer probe {chosen.apollo_baseline:.3f} and our other recipes {low:.3f}-{high:.3f} on the test "
        f"split (docs/results.md), Apollo's 70B {APOLLO_70B_AUROC}"
    )
