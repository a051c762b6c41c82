"""A probe's scikit-learn pipeline as plain numbers: its fitted arrays go to ``NAME.safetensors``,
its steps (class, constructor parameters, fitted scalars) to the card, and loading rebuilds a
Pipeline whose scores equal the saved one's bit for bit.

Nothing in either file names code to run: only the step classes in :data:`STEPS` are built, only
the fitted attributes listed there are set, and safetensors holds numeric tensors (no pickle)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict
from safetensors.numpy import load_file, save_file
from sklearn.linear_model import LogisticRegression
from sklearn.pipeline import Pipeline
from sklearn.preprocessing import StandardScaler

Scalar = bool | int | float | str | None
StepKind = Literal["StandardScaler", "LogisticRegression"]

# Each step class we rebuild, with the fitted attributes it may carry (arrays or scalars).
STEPS: dict[str, tuple[type[Any], frozenset[str]]] = {
    "StandardScaler": (StandardScaler, frozenset({"mean_", "scale_", "var_", "n_samples_seen_", "n_features_in_"})),
    "LogisticRegression": (LogisticRegression, frozenset({"coef_", "intercept_", "classes_", "n_iter_", "n_features_in_"})),
}


class PipelineStep(BaseModel):
    """One step of a probe's pipeline, as its card records it; its arrays are the tensors
    ``NAME.ATTRIBUTE`` of the probe's safetensors file."""

    model_config = ConfigDict(extra="forbid")

    name: str
    kind: StepKind
    params: dict[str, Scalar] = {}  # constructor parameters (get_params)
    fitted: dict[str, Scalar] = {}  # fitted attributes that are not arrays (n_features_in_, ...)


def _scalar(value: Any, where: str) -> Scalar:
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, np.generic) and value.dtype.kind in "biuf":
        item: Scalar = value.item()
        return item
    raise ValueError(f"{where} is {type(value).__name__}, not a number or string: a probe file cannot hold it")


def _fitted_attributes(estimator: Any) -> dict[str, Any]:
    return {key: value for key, value in vars(estimator).items() if key.endswith("_") and not key.startswith("_")}


def split_pipeline(pipeline: Pipeline) -> tuple[list[PipelineStep], dict[str, np.ndarray]]:
    """The pipeline's steps (for the card) and its fitted arrays (for safetensors). A step or a
    fitted attribute this module cannot rebuild is a ValueError naming it."""
    steps: list[PipelineStep] = []
    tensors: dict[str, np.ndarray] = {}
    for name, estimator in pipeline.steps:
        kind = type(estimator).__name__
        if kind not in STEPS or type(estimator) is not STEPS[kind][0]:
            raise ValueError(f"pipeline step {name!r} is a {kind}: probe files hold only {', '.join(STEPS)}")
        allowed = STEPS[kind][1]
        params = {key: _scalar(value, f"{name}.{key}") for key, value in estimator.get_params(deep=False).items()}
        fitted: dict[str, Scalar] = {}
        for key, value in _fitted_attributes(estimator).items():
            if key not in allowed:
                raise ValueError(f"pipeline step {name!r} has a fitted {key}, which probe files do not hold")
            if isinstance(value, np.ndarray):
                if value.dtype.kind not in "biuf":
                    raise ValueError(f"{name}.{key} has dtype {value.dtype}: probe files hold numeric arrays only")
                tensors[f"{name}.{key}"] = np.ascontiguousarray(value)
            else:
                fitted[key] = _scalar(value, f"{name}.{key}")
        steps.append(PipelineStep(name=name, kind=kind, params=params, fitted=fitted))  # type: ignore[arg-type]
    return steps, tensors


def join_pipeline(steps: list[PipelineStep], tensors: dict[str, np.ndarray]) -> Pipeline:
    """Rebuild the pipeline :func:`split_pipeline` took apart. Tensors that no step names, or a
    step's attribute given twice, are a ValueError."""
    if not steps:
        raise ValueError("the card lists no pipeline steps")
    built: list[tuple[str, Any]] = []
    used: set[str] = set()
    for step in steps:
        cls, allowed = STEPS[step.kind]
        arrays = {key.removeprefix(f"{step.name}."): key for key in tensors if key.startswith(f"{step.name}.")}
        unknown = sorted((set(arrays) | set(step.fitted)) - allowed)
        if unknown or set(arrays) & set(step.fitted):
            raise ValueError(
                f"pipeline step {step.name!r} ({step.kind}) cannot take {', '.join(unknown or sorted(set(arrays) & set(step.fitted)))}"
            )
        estimator = cls(**step.params)
        for key, value in step.fitted.items():
            setattr(estimator, key, value)
        for key, tensor_name in arrays.items():
            setattr(estimator, key, tensors[tensor_name])
        used.update(arrays.values())
        built.append((step.name, estimator))
    extra = sorted(set(tensors) - used)
    if extra:
        raise ValueError(f"tensors {', '.join(extra)} belong to no pipeline step of the card")
    return Pipeline(built)


def save_pipeline(pipeline: Pipeline, path: Path) -> list[PipelineStep]:
    """Write the pipeline's arrays to ``path`` (safetensors); returns its steps for the card."""
    steps, tensors = split_pipeline(pipeline)
    save_file(tensors, str(path), metadata={"format": "lens-evals probe", "steps": ",".join(step.name for step in steps)})
    return steps


def load_pipeline(path: Path, steps: list[PipelineStep]) -> Pipeline:
    """The pipeline whose arrays are in ``path`` and whose steps the card lists."""
    try:
        tensors = load_file(str(path))
    except Exception as exc:  # safetensors raises its own error types for a bad header or a short file
        raise ValueError(f"{path} is not a readable safetensors file: {exc}") from exc
    try:
        return join_pipeline(steps, tensors)
    except (TypeError, ValueError) as exc:  # TypeError: a parameter the step class does not take
        raise ValueError(f"{path} and its card do not make a probe: {exc}") from exc
