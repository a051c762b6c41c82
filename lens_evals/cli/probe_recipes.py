"""Recipe options of ``lens-evals probes train`` (``--layers``, ``--aggregation``, ``--follow-up``)
and the ``probes recipes`` / ``probes recipes-report`` commands."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from lens_evals.cli.checks import layer_index, model_name_or_dir, positive_int
from lens_evals.engine.frontend.offline import add_engine_arg_option, parse_engine_args

RECIPE_COMMANDS = ("recipes", "recipes-report")


def layer_list(text: str) -> list[int]:
    """``7,10,14`` -> [7, 10, 14] (distinct layer indices)."""
    layers = [layer_index(part.strip()) for part in text.split(",") if part.strip()]
    if not layers or len(set(layers)) != len(layers):
        raise argparse.ArgumentTypeError(f"{text!r}: give distinct layer indices separated by commas")
    return layers


def add_recipe_options(train: Any) -> None:
    """The recipe options of ``probes train``; any of them trains a recipe card (``NAME.recipe.json``)."""
    train.add_argument(
        "--layers", type=layer_list, default=None, help="several layers, e.g. 7,10,14,17,20: one readout each, scores averaged"
    )
    train.add_argument("--ensemble", action="store_true", help="5 layers evenly over 25-70%% of depth (the literature's ensemble)")
    train.add_argument(
        "--aggregation", choices=("mean", "max", "last"), default=None, help="how the scored tokens make one score (default mean)"
    )
    train.add_argument("--follow-up", action="store_true", help="append a follow-up question and read the probe at its answer")
    train.add_argument("--follow-up-question", default=None, help="the follow-up question (default: 'Was your last answer a lie? ...')")
    train.add_argument("--follow-up-answer", default=None, help="the answer read by the probe (default: 'No.')")
    train.add_argument("--control-limit", type=positive_int, default=None, help="recipes: first N control requests (default: all)")


def wants_recipe(args: argparse.Namespace) -> bool:
    follow = args.follow_up or args.follow_up_question is not None or args.follow_up_answer is not None
    return bool(args.layers or args.ensemble or args.aggregation or follow)


def run_train_recipe(args: argparse.Namespace) -> int:
    from lens_evals.probing.recipe_train import train_recipe
    from lens_evals.probing.recipes import FollowUp

    if args.layers and (args.ensemble or args.layer is not None):
        raise SystemExit("lens-evals probes train: --layers cannot be combined with --ensemble or --layer")
    follow = args.follow_up or args.follow_up_question is not None or args.follow_up_answer is not None
    given = {k: v for k, v in (("question", args.follow_up_question), ("answer", args.follow_up_answer)) if v is not None}
    layers = args.layers or ([args.layer] if args.layer is not None else None)
    if layers is None and not args.ensemble:
        from lens_evals.probing.train import DEFAULT_LAYERS

        layers = [DEFAULT_LAYERS.get(Path(args.model).name, 0)]
    recipe = train_recipe(
        args.model,
        layers=layers,
        aggregation=args.aggregation or "mean",
        follow_up=FollowUp(**given) if follow else None,
        training_set=args.dataset,
        C=args.C,
        out_dir=args.out,
        name=args.name,
        limit=args.limit,
        control_limit=args.control_limit,
        engine_args=parse_engine_args(args.engine_arg),
    )
    print(recipe.card.model_dump_json(indent=2))
    return 0


def add_recipe_commands(probes_sub: Any) -> None:
    study = probes_sub.add_parser("recipes", help="every probe recipe's Roleplaying AUROC and recall at 1%% FPR (JSON)")
    study.add_argument("--model", type=model_name_or_dir, default="smollm2-135m-instruct")
    study.add_argument("--out", default="docs/results")
    study.add_argument("--cache", default=None, help="capture cache directory (default probes/recipe_cache/MODEL)")
    study.add_argument("--limit", type=positive_int, default=None, help="about this many training dialogues per set")
    study.add_argument("--control-limit", type=positive_int, default=300)
    study.add_argument("--control-max-tokens", type=positive_int, default=32)
    study.add_argument("--roleplaying-limit", type=positive_int, default=None, help="first N Roleplaying dialogues (checks only)")
    study.add_argument("--capture-only", action="store_true", help="fill the capture cache and stop (a later run fits without the engine)")
    add_engine_arg_option(study)
    report = probes_sub.add_parser("recipes-report", help="markdown table (stdout) and plot (--out) from `probes recipes` JSON files")
    report.add_argument("results", nargs="+", type=Path)
    report.add_argument("--out", type=Path, default=Path("docs/results/recipes.png"))


def run_recipe_command(args: argparse.Namespace) -> int:
    if args.probes_command == "recipes":
        from lens_evals.probing.recipe_study import run_recipe_study

        result = run_recipe_study(
            args.model,
            args.out,
            cache=args.cache,
            control_limit=args.control_limit,
            control_max_tokens=args.control_max_tokens,
            ip_limit=args.limit,
            engine_args=parse_engine_args(args.engine_arg),
            capture_only=args.capture_only,
            roleplaying_limit=args.roleplaying_limit,
        )
        shown = result if args.capture_only else {k: result[k] for k in ("model", "dtype", "best_by_dev", "recipes", "total_s")}
        print(json.dumps(shown, indent=2))
        return 0
    from lens_evals.probing.recipe_report import plot_recipes, recipes_table

    table = recipes_table(args.results)
    plot_recipes(args.results, args.out)
    # stdout is the markdown table alone (scripts/gpu_probe_recipes.sh writes it to a .md file)
    print(table)
    print(f"plot: {args.out}", file=sys.stderr)
    return 0
