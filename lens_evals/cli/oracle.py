"""``lens-evals oracle train | path | card``: activation oracles."""

from __future__ import annotations

import argparse
import json
import sys

from lens_evals.cli.checks import oracle_recipe, positive_int
from lens_evals.engine.frontend.offline import add_engine_arg_option, parse_engine_args

HELP = "activation oracles: train one, find it"
DEFAULT = "smollm2-135m-oracle"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    commands = parser.add_subparsers(dest="oracle_command", required=True)
    train = commands.add_parser("train", help="train an oracle adapter (CPU, minutes) into the oracle cache")
    train.add_argument("--name", type=oracle_recipe, default=DEFAULT)
    train.add_argument("--train-per-family", type=positive_int)
    train.add_argument("--eval-per-family", type=positive_int)
    train.add_argument("--epochs", type=positive_int)
    add_engine_arg_option(train)
    for command in ("path", "card"):
        what = "directory" if command == "path" else "card"
        commands.add_parser(command, help=f"print a trained oracle's {what}").add_argument("name", nargs="?", default=DEFAULT)


def run(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    from lens_evals.oracle.adapters import RECIPES, oracle_path, read_card

    try:
        if args.oracle_command == "path":
            print(oracle_path(args.name))
            return 0
        if args.oracle_command == "card":
            print(json.dumps(read_card(args.name), indent=2))
            return 0
    except (FileNotFoundError, ValueError) as exc:
        print(exc, file=sys.stderr)
        return 1
    from lens_evals.oracle.build import build_oracle

    overrides = {
        key: value
        for key, value in (("train_per_family", args.train_per_family), ("eval_per_family", args.eval_per_family), ("epochs", args.epochs))
        if value is not None
    }
    config = RECIPES[args.name].model_copy(update=overrides)
    path, card = build_oracle(args.name, config, engine_args=parse_engine_args(args.engine_arg))
    heldout = {k: card["heldout"][k] for k in ("n", "oracle", "zero_vector")}
    print(json.dumps({"path": str(path), "heldout": heldout, "timings_s": card["timings_s"]}, indent=2))
    return 0
