"""``lens-evals probes train | convert | sweep | train-set | science | plot``: linear probes on
engine activations, the three-probe set and the science run."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from lens_evals.cli.checks import (
    check_layer,
    existing_file,
    joblib_file,
    layer_index,
    model_name_or_dir,
    positive_float,
    positive_int,
    probe_name,
)
from lens_evals.cli.probe_recipes import (
    RECIPE_COMMANDS,
    add_recipe_commands,
    add_recipe_options,
    run_recipe_command,
    run_train_recipe,
    wants_recipe,
)
from lens_evals.engine.frontend.offline import add_engine_arg_option, parse_engine_args

HELP = "train linear probes on engine activations"


def training_set(name: str) -> str:
    """A training set name that :func:`datasets.training_dialogues` knows (checked by name before an
    engine starts; the dialogues are read once, by the command)."""
    from lens_evals.probing import datasets
    from lens_evals.probing.known_lies import KNOWN_LIES

    if name == KNOWN_LIES:  # on-policy: built with the engine (probes train only, as a recipe)
        return name
    try:
        datasets.check_training_set(name)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return name


def add_arguments(parser: argparse.ArgumentParser) -> None:
    commands = parser.add_subparsers(dest="probes_command", required=True)
    train = commands.add_parser("train", help="train one probe, write probes/NAME.safetensors and its JSON card")
    train.add_argument("--layer", type=layer_index, default=None, help="default: the model's chosen layer")
    train.add_argument("--name", type=probe_name, default=None)
    train.add_argument("--out", default=None, help="directory (default: LENS_EVALS_PROBE_DIR, else the repository's probes/)")
    convert = commands.add_parser(
        "convert", help="NAME.joblib (a pickle: only files you trust) -> NAME.safetensors beside it, card updated"
    )
    convert.add_argument("files", nargs="+", type=joblib_file, metavar="FILE.joblib")
    sweep = commands.add_parser("sweep", help="validation AUROC per layer, as JSON and PNG")
    sweep.add_argument("--out", default="probes/sweep", help="path without suffix for .json and .png")
    sweep.add_argument("--no-roleplaying", action="store_true", help="skip the Roleplaying transfer curve")
    for command in (train, sweep):
        command.add_argument("--model", type=model_name_or_dir, default="smollm2-135m-instruct")
        command.add_argument(
            "--dataset",
            type=training_set,
            default="instructed-pairs",
            help="instructed-pairs, varied-pairs, geometry-of-truth, geometry-of-truth:SET[,SET], coup, or known-lies (train: on-policy lies)",
        )
        command.add_argument("--C", type=positive_float, default=0.1, help="inverse L2 strength of the logistic regression")
        command.add_argument("--limit", type=positive_int, default=None, help="use about this many dialogues")
        add_engine_arg_option(command)
    add_recipe_options(train)
    _add_probe_set_commands(commands)
    add_recipe_commands(commands)


def run(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    if args.probes_command in ("train", "train-set"):
        check_layer(parser, args.model, args.layer)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # one process: faster start for offline capture
    if args.probes_command in ("train", "sweep") and args.dataset == "known-lies":
        if args.probes_command == "sweep":
            parser.error("--dataset known-lies is built with the model's own answers: `probes train` (a recipe) only")
        return run_train_recipe(args)  # on-policy lies train a recipe card (one layer unless --layers / --ensemble)
    if args.probes_command == "train" and wants_recipe(args):
        return run_train_recipe(args)
    if args.probes_command in RECIPE_COMMANDS:
        return run_recipe_command(args)
    if args.probes_command == "train":
        from lens_evals.probing.train import train_probe

        probe = train_probe(
            args.model,
            args.layer,
            args.dataset,
            C=args.C,
            out_dir=args.out,
            name=args.name,
            limit=args.limit,
            engine_args=parse_engine_args(args.engine_arg),
        )
        print(probe.card.model_dump_json(indent=2))
        return 0
    if args.probes_command == "convert":
        from lens_evals.probing.probe import convert_probe

        for path in args.files:
            try:
                print(convert_probe(path))
            except (FileNotFoundError, TypeError, ValueError) as exc:
                print(f"lens-evals probes convert: {exc}", file=sys.stderr)
                return 2
        return 0
    if args.probes_command == "sweep":
        return _sweep(args)
    return _run_probe_set_command(args)


def _sweep(args: argparse.Namespace) -> int:
    from lens_evals.probing.sweep import sweep_layers

    result = sweep_layers(
        args.model,
        args.dataset,
        C=args.C,
        out=args.out,
        limit=args.limit,
        with_roleplaying=not args.no_roleplaying,
        engine_args=parse_engine_args(args.engine_arg),
    )
    for row in result["layers"]:
        print("  ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()))
    print(f"best layer by validation AUROC: {result['best_layer_by_validation']}; plot: {Path(args.out).with_suffix('.png')}")
    return 0


def _add_probe_set_commands(probes_sub: Any) -> None:
    train_set = probes_sub.add_parser("train-set", help="train ip-lr, ip-dom and rp-lr at one layer (probes/MODEL__probe-set)")
    train_set.add_argument("--layer", type=layer_index, default=None, help="default: the model's chosen layer")
    train_set.add_argument(
        "--roleplaying", type=existing_file, default=None, help="Roleplaying YAML for rp-lr's grouped CV (default: ours)"
    )
    science = probes_sub.add_parser("science", help="every layer, the three probes, AUROC and recall at 1%% FPR (JSON)")
    science.add_argument("--dtype", default=None, help="engine dtype (default: float32 for embedded models)")
    science.add_argument("--out", default="docs/results")
    science.add_argument("--roleplaying-limit", type=positive_int, default=None, help="first N Roleplaying scenarios (checks only)")
    for command in (train_set, science):
        add_engine_arg_option(command)
        command.add_argument("--model", type=model_name_or_dir, default="smollm2-135m-instruct")
        command.add_argument("--limit", type=positive_int, default=None, help="about this many Instructed-Pairs dialogues")
        command.add_argument("--control-limit", type=positive_int, default=None, help="first N control requests (default: all)")
        command.add_argument("--control-max-tokens", type=positive_int, default=48)
    plot = probes_sub.add_parser("plot", help="AUROC against layer and model size from science JSON files")
    plot.add_argument("results", nargs="+", type=Path)
    plot.add_argument("--out", type=Path, default=Path("docs/results/auroc_by_size_and_layer.png"))


def _run_probe_set_command(args: argparse.Namespace) -> int:
    if args.probes_command == "plot":
        from lens_evals.probing.science import plot_results, results_table

        for path in args.results:
            problem = _not_science_result(path)
            if problem:
                print(f"lens-evals probes plot: {path}: {problem}", file=sys.stderr)
                return 2
        plot_results(args.results, args.out)
        print(results_table(args.results))
        print(f"\nplot: {args.out}")
    elif args.probes_command == "science":
        from lens_evals.probing.science import run_science

        result = run_science(
            args.model,
            args.out,
            dtype=args.dtype,
            ip_limit=args.limit,
            control_limit=args.control_limit,
            control_max_tokens=args.control_max_tokens,
            roleplaying_limit=args.roleplaying_limit,
            engine_args=parse_engine_args(args.engine_arg),
        )
        print(json.dumps({k: result[k] for k in ("model", "dtype", "chosen_layer", "probes", "thresholds", "timings_s")}, indent=2))
    else:
        from lens_evals.probing.multi import ensure_probe_set

        print(
            ensure_probe_set(
                args.model,
                layer=args.layer,
                dataset=args.roleplaying,
                limit=args.limit,
                control_limit=args.control_limit,
                control_max_tokens=args.control_max_tokens,
                retrain=True,
                engine_args=parse_engine_args(args.engine_arg),
            )
        )
    return 0


def _not_science_result(path: Path) -> str | None:
    """Why ``path`` is not a `probes science` result file (None when it is one)."""
    try:
        result = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        return f"cannot read it as JSON ({exc})"
    needed = ("model", "dtype", "n_parameters", "n_layers", "chosen_layer", "layers", "probes", "thresholds", "n_control")
    missing = [key for key in needed if not isinstance(result, dict) or key not in result]
    return f"not a `probes science` result (no {', '.join(missing)})" if missing else None
