"""``lens-evals models path NAME | list``: the embedded models."""

from __future__ import annotations

import argparse

from lens_evals.cli.checks import model_name

HELP = "embedded models"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    commands = parser.add_subparsers(dest="models_command", required=True)
    path = commands.add_parser("path", help="print a prepared model's directory (prepare if missing)")
    path.add_argument("name", type=model_name)
    commands.add_parser("list", help="list embedded model names")


def run(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    from lens_evals.models.registry import PREPARERS, model_path

    if args.models_command == "path":
        print(model_path(args.name))
    else:
        for name in sorted(PREPARERS):
            print(name)
    return 0
