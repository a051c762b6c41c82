"""Checks of `lens-evals` arguments that know about models, probes and oracle recipes: each
mistake is an argparse error (exit 2) naming the value and what was expected, found before an
engine starts (not a KeyError from :mod:`lens_evals.models`, an OSError from the HF hub or the
engine's refusal of a layer minutes later). What they ask of models is :mod:`lens_evals.models.lookup`
(library code asks it there: nothing below the command line imports this package). No vllm, no
torch at import."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from lens_evals.models.lookup import known_models, model_config, unknown_model


def model_name(text: str) -> str:
    """An embedded model name (what :func:`lens_evals.models.registry.model_path` prepares)."""
    known = known_models()
    if text not in known:
        raise argparse.ArgumentTypeError(f"unknown model {text!r}; expected one of {', '.join(known)}")
    return text


def model_name_or_dir(text: str) -> str:
    problem = unknown_model(text)
    if problem:
        raise argparse.ArgumentTypeError(problem)
    return text


def _integer_at_least(lowest: int, text: str, complaint: str) -> int:
    value = int(text)  # argparse turns a ValueError into "invalid <type> value"
    if value < lowest:
        raise argparse.ArgumentTypeError(f"{complaint}, got {value}")
    return value


def positive_float(text: str) -> float:
    value = float(text)  # argparse turns a ValueError into "invalid <type> value"
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"must be a positive finite number, got {text}")
    return value


def positive_int(text: str) -> int:
    return _integer_at_least(1, text, "must be a positive integer")


def layer_index(text: str) -> int:
    return _integer_at_least(0, text, "a layer index is 0 or more")


def count(text: str) -> int:
    return _integer_at_least(0, text, "must be 0 or more")


def joblib_file(text: str) -> str:
    """``probes convert FILE``: an existing ``.joblib`` probe (its card beside it is checked on load)."""
    if not text.endswith(".joblib"):
        raise argparse.ArgumentTypeError(f"{text!r} is not a .joblib probe file")
    return existing_file(text)


def probe_name(text: str) -> str:
    """``--name``: the probe's file name in ``--out`` (a "/" wrote elsewhere or failed at saving,
    after the training, on a missing subdirectory)."""
    if not text or "/" in text or "\\" in text or text in (".", ".."):
        raise argparse.ArgumentTypeError(f"a probe name is a file name without '/', got {text!r} (--out picks the directory)")
    return text


def existing_file(text: str) -> str:
    """A file that exists (checked before a model is prepared or a default probe trained)."""
    if not Path(text).is_file():
        raise argparse.ArgumentTypeError(f"no such file: {text}")
    return text


def batch_sizes(text: str) -> str:
    """Comma-separated positive integers (kept as text: the command splits it)."""
    parts = text.split(",")
    if not all(part.strip().isdigit() and int(part) > 0 for part in parts):
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, e.g. 4,8,16; got {text!r}")
    return text


def bench_systems(text: str) -> str:
    """Comma-separated names of :data:`benchmarks.systems.ALL_SYSTEMS` (kept as text)."""
    from benchmarks.systems import ALL_SYSTEMS

    for name in text.split(","):
        if name not in ALL_SYSTEMS:
            raise argparse.ArgumentTypeError(f"unknown system {name!r}; expected some of {', '.join(ALL_SYSTEMS)}, comma-separated")
    return text


def oracle_recipe(text: str) -> str:
    from lens_evals.oracle.adapters import RECIPES

    if text not in RECIPES:
        raise argparse.ArgumentTypeError(f"unknown oracle recipe {text!r}; expected one of {', '.join(sorted(RECIPES))}")
    return text


def check_layer(parser: argparse.ArgumentParser, model: str, layer: int | None) -> None:
    """``--layer`` within the model's decoder layers (exit 2 otherwise)."""
    n_layers = (model_config(model) or {}).get("num_hidden_layers") if layer is not None else None
    if isinstance(n_layers, int) and layer is not None and layer >= n_layers:
        parser.error(f"argument --layer: {layer} is past the last layer of {Path(model).name} ({n_layers} layers: 0..{n_layers - 1})")


def check_probe_for_model(parser: argparse.ArgumentParser, probe: str, model: str) -> None:
    """``--probe``: its files exist and its card fits ``model`` (trained on it, its hidden size, one
    of its layers). A probe of another model or layer would otherwise give scores that mean nothing."""
    from lens_evals.probing.probe import load_probe

    try:
        card = load_probe(probe).card
    except (FileNotFoundError, TypeError, ValueError) as exc:
        parser.error(f"argument --probe: {exc}")
    name = Path(model).name
    if card.model != name:
        parser.error(
            f"argument --probe: {probe} was trained on {card.model}, not {name}; train one with `lens-evals probes train --model {model}`"
        )
    config = model_config(model) or {}
    hidden = config.get("hidden_size")
    if isinstance(hidden, int) and card.hidden_size != hidden:
        parser.error(f"argument --probe: {probe} reads hidden size {card.hidden_size} but {name}'s is {hidden}")
    n_layers = config.get("num_hidden_layers")
    if isinstance(n_layers, int) and card.layer >= n_layers:
        parser.error(f"argument --probe: {probe} reads layer {card.layer} but {name} has {n_layers} layers (0..{n_layers - 1})")
