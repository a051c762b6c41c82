"""The probe files a task reads when it is given none: looked up, never trained here.

Building a task changes no environment variable and trains nothing; a missing default probe is a
clear error naming the command that trains it (``lens-evals roleplaying`` trains the default probe
itself, before it builds the task). ``directory``: where to look (default: ``LENS_EVALS_PROBE_DIR``,
else the repository's committed ``probes/``, where ``lens-evals probes train`` writes; never the
working directory's ``./probes``, whose files someone else may have put there). The training
modules are imported only when a default is looked up, so the task registry loads in a
client-only install."""

from __future__ import annotations

from pathlib import Path


def default_probe(directory: str | Path | None = None, training_set: str | None = None, model: str | None = None) -> Path:
    """The default model's probe trained on ``training_set`` (default: Instructed-Pairs), with its card."""
    from lens_evals.probing.probe import PROBE_SUFFIX
    from lens_evals.probing.train import DEFAULT_MODEL, DEFAULT_TRAINING_SET, default_probe_name, probe_dir

    training_set = training_set or DEFAULT_TRAINING_SET
    path = (Path(directory) if directory else probe_dir()) / f"{default_probe_name(model or DEFAULT_MODEL, training_set)}{PROBE_SUFFIX}"
    if not path.is_file() or not path.with_suffix(".json").is_file():
        dataset = "" if training_set == DEFAULT_TRAINING_SET else f" --dataset {training_set}"
        raise FileNotFoundError(
            f"no probe at {path} (and its .json card): train it once with `lens-evals probes train"
            f"{dataset}` (with LENS_EVALS_PROBE_DIR={path.parent}), "
            "or pass -T probe=PATH"
        )
    return path


def default_probe_set(directory: str | Path | None = None, model: str | None = None) -> Path:
    """The default model's probe set (``NAME.json`` with its ``NAME.npz``)."""
    from lens_evals.probing.multi import probe_set_path, set_files
    from lens_evals.probing.train import DEFAULT_MODEL

    model = model or DEFAULT_MODEL
    path = probe_set_path(model) if not directory else Path(directory) / probe_set_path(model).name
    if not all(file.is_file() for file in set_files(path)):
        raise FileNotFoundError(
            f"no probe set at {path} (and its .npz): train it once with `lens-evals probes train-set "
            f"--model {model}` (with LENS_EVALS_PROBE_DIR={path.parent}), or pass -T probe_set=PATH"
        )
    return path
