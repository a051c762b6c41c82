"""``lens-evals`` command line."""

from __future__ import annotations

import argparse
import logging
import sys


def _models(args: argparse.Namespace) -> int:
    from lens_evals.models import PREPARERS, model_path

    if args.models_command == "path":
        print(model_path(args.name))
    elif args.models_command == "list":
        for name in sorted(PREPARERS):
            print(name)
    return 0


def _demo(args: argparse.Namespace) -> int:
    from lens_evals.demo import run_demo

    return run_demo(args.model, args.layer, args.scale)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lens-evals", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    models = sub.add_parser("models", help="embedded models")
    models_sub = models.add_subparsers(dest="models_command", required=True)
    path = models_sub.add_parser("path", help="print a prepared model's directory (prepare if missing)")
    path.add_argument("name")
    models_sub.add_parser("list", help="list embedded model names")
    models.set_defaults(func=_models)
    demo = sub.add_parser("demo", help="capture and steer on the embedded default model")
    demo.add_argument("--model", default="smollm2-135m-instruct")
    demo.add_argument("--layer", type=int, default=15)
    demo.add_argument("--scale", type=float, default=8.0, help="steering strength in percent of ||h||")
    demo.set_defaults(func=_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
