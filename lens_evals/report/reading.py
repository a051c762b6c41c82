"""Read an Inspect eval log into what the report shows.

Three kinds of log are understood: probe tasks (Roleplaying, coup: samples scored by
``probe_scores`` + ``probe_scorer``, one tab per probe; Roleplaying scored by a recipe probe:
``recipe_scores`` + ``probe_recipe``, the tab named after the recipe), activation-oracle tasks
(scorers ``oracle_answer_match`` / ``zero_vector_match``) and the steering eval; a log of any
task whose samples carry readouts (the ``lens_readouts`` solver) gets a readouts section too.
Anything else is a :class:`ReportError` that says what the log is and what the report needs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypedDict, cast

from inspect_ai.event import InfoEvent
from inspect_ai.log import EvalLog, EvalSample, read_eval_log

from lens_evals.inspect_kit.probe_reading import INFO_SOURCE
from lens_evals.report.readouts import ReadoutSample, has_readouts, readout_samples
from lens_evals.report.steering import SteeringSection, is_steering_log, steering_section

ORACLE_SCORERS = ("oracle_answer_match", "zero_vector_match")


class ReportError(ValueError):
    """The log cannot be turned into a report; the message says why."""


@dataclass(frozen=True)
class Turn:
    role: str
    text: str


@dataclass(frozen=True)
class ScoredSample:
    """One sample as one probe read it."""

    id: str
    turns: list[Turn]  # the conversation before the response
    tokens: list[str]  # the response, token by token
    token_scores: list[float]
    scored: tuple[int, int]  # [first, end) rows of tokens that the score averages
    score: float
    flagged: bool
    label: int | None  # 1 positive, 0 negative, None unknown
    explanation: str
    pair: str | None = None  # samples sharing a pair key are versions of one scenario


@dataclass(frozen=True)
class ProbeSection:
    name: str
    threshold: float
    card: dict[str, Any]
    classes: tuple[str, str]  # (negative, positive) names
    samples: list[ScoredSample]

    def labelled(self) -> tuple[list[int], list[float]]:
        chosen = [s for s in self.samples if s.label is not None and math.isfinite(s.score)]
        return [int(s.label) for s in chosen], [s.score for s in chosen]  # type: ignore[arg-type]


@dataclass(frozen=True)
class OracleSample:
    id: str
    family: str
    prompt: list[Turn]
    question: str
    target: str
    answer: str
    zero_vector_answer: str | None
    correct: bool
    zero_vector_correct: bool | None


@dataclass
class ReportData:
    title: str
    task: str
    model: str
    created: str
    location: str
    metrics: dict[str, float]
    metadata: dict[str, Any]
    probes: list[ProbeSection] = field(default_factory=list)
    oracle: list[OracleSample] = field(default_factory=list)
    steering: SteeringSection | None = None
    readouts: list[ReadoutSample] = field(default_factory=list)


def read_log(path: str | Path) -> EvalLog:
    source = Path(path)
    if not source.is_file():
        raise ReportError(f"{source}: no such file")
    try:
        return read_eval_log(str(source))
    except Exception as exc:  # the reader raises zip, JSON and validation errors alike
        raise ReportError(f"{source}: not a readable Inspect eval log (truncated or corrupt?): {type(exc).__name__}: {exc}") from None


def _turns(sample: EvalSample, drop_last: bool) -> list[Turn]:
    messages = sample.messages[:-1] if drop_last and sample.messages else sample.messages
    return [Turn(role=m.role, text=m.text) for m in messages]


def _follow_up_question(card: dict[str, Any]) -> str | None:
    """A recipe card's follow-up question: the probe then read the answer to it, not the sample's last turn."""
    follow_up = card.get("follow_up")
    return str(follow_up["question"]) if isinstance(follow_up, dict) and "question" in follow_up else None


def _matching_score(scores: list[Any], name: str) -> Any:
    """The score of probe ``name``: the one naming it as its probe (``probe_scorer``, the multi-probe
    scorers), else as its readout (``probe_recipe``, whose probe is the kind ``recipe``)."""
    for key in ("probe", "readout"):
        found = next((s for s in scores if (s.metadata or {}).get(key, name if key == "probe" else None) == name), None)
        if found is not None:
            return found
    return None


def _pair_key(sample: EvalSample) -> str | None:
    kind = (sample.metadata or {}).get("kind")
    sample_id = str(sample.id)
    return sample_id.removesuffix(f"-{kind}") if kind and sample_id.endswith(f"-{kind}") else None


class _Reading(TypedDict):
    """A probe_tokens event's data as ``ProbeReading.event_data`` writes it (the keys read here)."""

    probe: str
    threshold: float
    scored: list[int]  # [first, end)
    rows: list[list[str | float]]  # [token, score] per response token


def _score_and_flag(score: Any) -> tuple[float, bool]:
    """(value, flagged) of a probe score: ``probe_scorer``'s dict value, or a number with
    ``flagged`` in its metadata (the multi-probe task's scorers)."""
    value = score.value.get("score") if isinstance(score.value, dict) else score.value
    flagged = score.value.get("flagged") if isinstance(score.value, dict) else (score.metadata or {}).get("flagged")
    return (float(value) if isinstance(value, (int, float)) else math.nan), bool(flagged)


def _probe_samples(log: EvalLog) -> tuple[dict[str, list[ScoredSample]], dict[str, float]]:
    """Samples per probe, and each probe's threshold (from the logged readings)."""
    by_probe: dict[str, list[ScoredSample]] = {}
    thresholds: dict[str, float] = {}
    question = _follow_up_question((log.eval.metadata or {}).get("recipe") or {})
    for sample in log.samples or []:
        readings = [e.data for e in sample.events if isinstance(e, InfoEvent) and e.source == INFO_SOURCE]
        scores = list((sample.scores or {}).values())
        for data in readings:
            if not isinstance(data, dict) or not {"probe", "rows", "scored"} <= data.keys():
                raise ReportError(f"sample {sample.id}: a {INFO_SOURCE} event without probe, rows and scored")
            reading = cast(_Reading, data)  # as ProbeReading writes it; each value is converted below
            name = str(reading["probe"])
            thresholds[name] = float(reading["threshold"])
            score = _matching_score(scores, name)
            if score is None:
                continue  # read but not scored (the sample failed before its scorer ran)
            value, flagged = _score_and_flag(score)
            by_probe.setdefault(name, []).append(
                ScoredSample(
                    id=str(sample.id),
                    turns=_turns(sample, drop_last=question is None) + ([Turn("user", question)] if question else []),
                    tokens=[str(row[0]) for row in reading["rows"]],
                    token_scores=[float(row[1]) for row in reading["rows"]],
                    scored=(int(reading["scored"][0]), int(reading["scored"][1])),
                    score=value,
                    flagged=flagged,
                    label=(score.metadata or {}).get("label"),
                    explanation=score.explanation or "",
                    pair=_pair_key(sample),
                )
            )
    return by_probe, thresholds


def _classes(log: EvalLog) -> tuple[str, str]:
    """(negative, positive) names: from the task's metadata, else the targets of labelled samples."""
    names = (log.eval.metadata or {}).get("classes")
    if isinstance(names, list) and len(names) == 2:
        return str(names[0]), str(names[1])
    seen = {
        (sample.metadata or {}).get("label"): sample.target
        for sample in log.samples or []
        if isinstance(sample.target, str) and sample.target
    }
    return str(seen.get(0) or "label 0"), str(seen.get(1) or "label 1")


def _oracle_samples(log: EvalLog) -> list[OracleSample]:
    samples = []
    for sample in log.samples or []:
        record = (sample.store or {}).get("lens_evals:oracle")
        scores = sample.scores or {}
        if not record or ORACLE_SCORERS[0] not in scores:
            continue
        zero = scores.get(ORACLE_SCORERS[1])
        target = sample.target if isinstance(sample.target, str) else ", ".join(sample.target)
        samples.append(
            OracleSample(
                id=str(sample.id),
                family=str((sample.metadata or {}).get("family", "")),
                prompt=_turns(sample, drop_last=True),
                question=str(record.get("question", "")),
                target=target,
                answer=str(record.get("answer", "")),
                zero_vector_answer=record.get("zero_vector_answer"),
                correct=scores[ORACLE_SCORERS[0]].value == "C",
                zero_vector_correct=None if zero is None else zero.value == "C",
            )
        )
    return samples


def report_data(path: str | Path) -> ReportData:
    log = read_log(path)
    task = log.eval.task
    scorers = [s.name for s in (log.results.scores if log.results else [])]
    is_probe = not {"probe", "recipe"}.isdisjoint(log.eval.metadata or {}) or any(
        step.solver.endswith(("probe_scores", "recipe_scores")) for step in log.plan.steps
    )
    is_oracle = any(name in ORACLE_SCORERS for name in scorers)
    is_steering = is_steering_log(log)
    is_readouts = has_readouts(log)
    if not (is_probe or is_oracle or is_steering or is_readouts):
        raise ReportError(
            f"{path}: a log of task {task!r}, which has no probe scores and no oracle answers (nor a steering sweep or readouts); the "
            "report reads lens-evals probe tasks (roleplaying_probe with a probe, several or a recipe; coup_probe), activation-oracle "
            "tasks, steering_effect and the samples of any task with the lens_readouts solver"
        )
    if not log.samples:
        raise ReportError(f"{path}: the log of {task!r} holds no samples (status {log.status}); run the eval with samples logged")
    metrics = {name: m.value for s in (log.results.scores if log.results else []) for name, m in s.metrics.items()}
    shown_name = task if task != "task" or not log.eval.dataset.name else log.eval.dataset.name  # an unnamed Task
    data = ReportData(
        title=f"{shown_name} on {log.eval.model}",
        task=task,
        model=log.eval.model,
        created=log.eval.created,
        location=str(path),
        metrics=metrics,
        metadata=dict(log.eval.metadata or {}),
    )
    if is_readouts:
        try:
            data.readouts = readout_samples(log)
        except ValueError as exc:
            raise ReportError(f"{path}: {exc}") from None
    if is_steering:
        data.steering = steering_section(log)
        if data.steering is None:
            raise ReportError(f"{path}: no steering scores in this log of {task!r}")
    elif is_probe:
        by_probe, thresholds = _probe_samples(log)
        if not by_probe:
            raise ReportError(
                f"{path}: no probe scores in this log of {task!r} (no sample has a {INFO_SOURCE} event and "
                "a probe score; logs written before lens-evals logged the response tokens lack them)"
            )
        card, classes = data.metadata.get("probe") or data.metadata.get("recipe") or {}, _classes(log)
        data.probes = [
            ProbeSection(
                name=name,
                threshold=thresholds[name],
                card=card if card.get("name") == name else {"name": name},
                classes=classes,
                samples=samples,
            )
            for name, samples in by_probe.items()
        ]
    elif is_oracle:
        data.oracle = _oracle_samples(log)
        if not data.oracle:
            raise ReportError(f"{path}: no oracle answers in this log of {task!r}")
    return data
