"""``lens-evals bench``: the benchmarks live in the repository (``benchmarks/``), not in the wheel.

The one subcommand that parses nothing itself: :func:`lens_evals.cli.app.main` hands it its
arguments unparsed (``run_argv``), for ``benchmarks.main`` to parse."""

from __future__ import annotations

import argparse
import sys

HELP = "speed against pure vLLM, HF + hook, nnsight, TransformerLens (from a checkout)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Nothing: listed in ``lens-evals --help`` only (``run_argv`` gets the arguments)."""


def run(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    return run_argv([])


def run_argv(argv: list[str]) -> int:
    try:
        from benchmarks.main import main as bench_main
    except ImportError:
        print(
            "lens-evals bench: the benchmarks are not installed with the package; from a checkout of the "
            "repository run `python -m benchmarks --help` (or `lens-evals bench` from its root)",
            file=sys.stderr,
        )
        return 2
    return bench_main(argv, prog="lens-evals bench")
