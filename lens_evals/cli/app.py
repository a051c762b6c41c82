"""``lens-evals`` command line."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from typing import Protocol

# subcommand -> its module in lens_evals.cli. Each module has one shape: ``HELP`` (its line in
# --help), ``add_arguments(parser)`` (its arguments, each checked by a type in cli.checks) and
# ``run(parser, args) -> int`` (the checks across arguments, as parser errors, then the work).
# ``bench`` parses nothing itself: main() hands it its arguments (cli.bench.run_argv).
SUBCOMMANDS = {
    "models": "models",
    "demo": "demo",
    "probes": "probes",
    "roleplaying": "roleplaying",
    "verify": "verify",
    "report": "report",
    "bench": "bench",
    "capture": "capture",
    "oracle": "oracle",
    "chat": "chat",
    "readouts": "readouts",
}


class Subcommand(Protocol):
    HELP: str

    def add_arguments(self, parser: argparse.ArgumentParser) -> None: ...

    def run(self, parser: argparse.ArgumentParser, args: argparse.Namespace) -> int: ...


def subcommand(name: str) -> Subcommand:
    module: Subcommand = importlib.import_module(f"lens_evals.cli.{SUBCOMMANDS[name]}")
    return module


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lens-evals", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    for name in SUBCOMMANDS:
        module = subcommand(name)
        command = commands.add_parser(name, help=module.HELP, add_help=name != "bench")
        module.add_arguments(command)
        command.set_defaults(subcommand_parser=command)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:
        from lens_evals.cli.bench import run_argv

        return run_argv(argv[1:])
    args = build_parser().parse_args(argv)
    return int(subcommand(args.command).run(args.subcommand_parser, args) or 0)


if __name__ == "__main__":
    sys.exit(main())
