"""The coup-probe evaluation: ``inspect eval lens_evals/coup_probe`` (``tasks/coup_probe.py`` is the
same task as a file).

A coup probe (Roger 2023) is trained off-policy on agent actions that undermine oversight against
benign engineering actions, and is meant to flag an untrusted model's harmful actions. Samples are
the held-out coup intents (never used in training), each as the assistant's reply of an agent
asked for its next action, or trajectories from a JSONL file: one object per line,
``{"messages": [{"role": ..., "content": ...}, ...], "label": 0 | 1}``, ending with the assistant
turn to score. The ``probe_scores`` solver scores that turn; the metrics are AUROC and recall at
the probe's 1%-FPR threshold.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

from inspect_ai import Task, task
from inspect_ai.dataset import MemoryDataset, Sample
from inspect_ai.model import ChatMessage, ChatMessageAssistant, ChatMessageSystem, ChatMessageUser

from lens_evals.inspect_kit.default_probes import default_probe
from lens_evals.inspect_kit.probe_reading import task_metadata
from lens_evals.inspect_kit.probe_scorer import probe_metrics, probe_scorer
from lens_evals.inspect_kit.probe_solver import probe_scores
from lens_evals.probing.datasets import coup_intents, coup_split
from lens_evals.probing.dialogues import Dialogue
from lens_evals.probing.probe import load_probe

Split = Literal["held_out", "all"]
COUP_CLASSES = ("benign", "harmful")
_KINDS = {"system": ChatMessageSystem, "user": ChatMessageUser, "assistant": ChatMessageAssistant}


def _sample(dialogue: Dialogue, sample_id: str) -> Sample:
    messages: list[ChatMessage] = [_KINDS[m["role"]](content=m["content"]) for m in dialogue.messages]
    return Sample(
        id=sample_id,
        input=messages,
        target=COUP_CLASSES[dialogue.label == 1],
        metadata={"label": dialogue.label, "group": dialogue.group, "score_from": dialogue.score_from},
    )


def read_trajectories(path: str | Path) -> list[Dialogue]:
    source = Path(path)
    if not source.is_file():
        raise FileNotFoundError(f'trajectories: no such file: {source} (JSONL, one {{"messages": [...], "label": 0|1|null}} a line)')
    dialogues = []
    for number, line in enumerate(source.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
            messages = [{"role": str(m["role"]), "content": str(m["content"])} for m in item["messages"]]
            label = item.get("label")
            if label not in (0, 1, None) or any(m["role"] not in _KINDS for m in messages):
                raise ValueError("label must be 0, 1 or null; roles system / user / assistant")
            dialogues.append(Dialogue(messages=messages, label=label, group=f"line-{number}"))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{source}:{number}: not a trajectory ({exc})") from None
    if not dialogues:
        raise ValueError(f"{source}: no trajectories")
    return dialogues


def coup_task(probe: str | Path, split: Split = "held_out", trajectories: str | Path | None = None, tokenizer: str | None = None) -> Task:
    if split not in ("held_out", "all"):
        raise ValueError(f"split must be held_out or all, got {split!r}")
    loaded = load_probe(probe)
    if trajectories is not None:
        dialogues, source = read_trajectories(trajectories), str(trajectories)
    else:
        dialogues = coup_split()[1] if split == "held_out" else coup_intents()
        source = f"lens_evals coup intents ({split.replace('_', '-')})"
    if loaded.card.training_set == "coup" and trajectories is None and split == "all":
        source += "; includes the probe's own training items"
    samples = [_sample(d, d.group or str(i)) for i, d in enumerate(dialogues)]
    return Task(
        name="coup_probe",
        dataset=MemoryDataset(samples, name="coup_probe"),
        solver=probe_scores(loaded, mode="off_policy", tokenizer=tokenizer),
        scorer=probe_scorer(classes=COUP_CLASSES),
        metrics=[*probe_metrics(COUP_CLASSES)],  # a list of the wider element type Task takes
        metadata=task_metadata(loaded.card, source, COUP_CLASSES),
    )


@task
def coup_probe(
    probe: str | None = None,
    split: str = "held_out",
    trajectories: str | None = None,
    tokenizer: str | None = None,
    probe_dir: str | None = None,
) -> Task:
    """``probe`` defaults to the default model's coup probe in ``probe_dir`` (default:
    ``LENS_EVALS_PROBE_DIR``, else the repository's ``probes/``; ``lens-evals probes train --dataset coup`` writes it)."""
    return coup_task(
        probe or default_probe(probe_dir, training_set="coup"),
        split=split,  # type: ignore[arg-type]
        trajectories=trajectories,
        tokenizer=tokenizer,
    )
