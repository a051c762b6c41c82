"""Roleplaying scenarios as Inspect samples (shared by the one-probe and the several-probe task).

Off-policy: each scenario gives two samples, its honest and its deceptive completion written
after the answer prefix as the assistant's turn; labels are known. On-policy: one sample per
scenario that ends with the answer prefix, for the model to continue."""

from __future__ import annotations

from typing import Literal

from inspect_ai.dataset import Sample
from inspect_ai.model import ChatMessage, ChatMessageAssistant, ChatMessageSystem, ChatMessageUser

from lens_evals.probing.datasets import RoleplayingScenario

Mode = Literal["off_policy", "on_policy"]


def _prompt(scenario: RoleplayingScenario) -> list[ChatMessage]:
    system, user = scenario.prompt_messages()
    return [ChatMessageSystem(content=system["content"]), ChatMessageUser(content=user["content"])]


def roleplaying_samples(scenarios: list[RoleplayingScenario], mode: Mode) -> list[Sample]:
    samples = []
    for index, scenario in enumerate(scenarios):
        facts = {"scenario": scenario.scenario, "question": scenario.question, "answer_prefix": scenario.answer_prefix}
        if mode == "on_policy":
            prefix = ChatMessageAssistant(content=scenario.answer_prefix.strip())
            samples.append(Sample(id=f"{index}", input=[*_prompt(scenario), prefix], metadata={**facts, "label": None}))
            continue
        for kind in ("honest", "deceptive"):
            dialogue = scenario.dialogue(kind, index)
            reply = ChatMessageAssistant(content=dialogue.messages[-1]["content"])
            samples.append(
                Sample(
                    id=f"{index}-{kind}",
                    input=[*_prompt(scenario), reply],
                    target=kind,
                    metadata={**facts, "label": dialogue.label, "kind": kind, "score_from": dialogue.score_from},
                )
            )
    return samples
