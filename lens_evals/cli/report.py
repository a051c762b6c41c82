"""``lens-evals report LOG``: one self-contained HTML page for an eval log."""

from __future__ import annotations

import argparse
import sys

HELP = "one self-contained HTML page for an eval log (probe tasks, oracle tasks)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "log", help="an Inspect .eval log of roleplaying_probe (a probe, several, a recipe), coup_probe, an oracle task or steering_effect"
    )
    parser.add_argument("--out", default=None, help="HTML file to write (default: the log's path with .html)")


def run(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    from lens_evals.report import ReportError, write_report

    try:
        print(write_report(args.log, args.out))
    except ReportError as exc:
        print(f"lens-evals report: {exc}", file=sys.stderr)
        return 2
    return 0
