"""``lens-evals`` command line."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from lens_evals.cli_checks import (
    check_layer,
    check_probe_for_model,
    existing_file,
    joblib_file,
    layer_index,
    model_name,
    model_name_or_dir,
    oracle_recipe,
    positive_float,
    positive_int,
    probe_name,
)
from lens_evals.offline_engine import add_engine_arg_option, parse_engine_args


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

    return run_demo(args.model, args.layer, args.scale, engine_args=parse_engine_args(args.engine_arg))


def _probes(args: argparse.Namespace) -> int:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # one process: faster start for offline capture
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
    elif args.probes_command == "convert":
        from lens_evals.probing.probe import convert_probe

        for path in args.files:
            try:
                print(convert_probe(path))
            except (FileNotFoundError, TypeError, ValueError) as exc:
                print(f"lens-evals probes convert: {exc}", file=sys.stderr)
                return 2
    elif args.probes_command in ("train-set", "science", "plot"):
        from lens_evals.probing.science_cli import run_probes_command

        return run_probes_command(args)
    else:
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


def _roleplaying(args: argparse.Namespace) -> int:
    from lens_evals.evals.roleplaying.main_job import run_roleplaying

    return run_roleplaying(args.model, limit=args.limit, log_dir=args.log_dir, probe=args.probe, dataset=args.dataset)


def _verify(args: argparse.Namespace) -> int:
    from lens_evals.verify import run_verify

    return run_verify(
        args.model, parse_engine_args(args.engine_arg), as_json=args.json, hf=not args.no_hf, self_check=not args.no_self_check
    )


def _report(args: argparse.Namespace) -> int:
    from lens_evals.report import ReportError, write_report

    try:
        print(write_report(args.log, args.out))
    except ReportError as exc:
        print(f"lens-evals report: {exc}", file=sys.stderr)
        return 2
    return 0


def _bench(args: argparse.Namespace) -> int:
    from lens_evals.bench.main import run_bench

    return run_bench(args)


def _capture(args: argparse.Namespace) -> int:
    from lens_evals.capture.command import run

    return run(args)


def _oracle(args: argparse.Namespace) -> int:
    import json

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
    if args.oracle_command == "train":
        from lens_evals.oracle.build import build_oracle

        overrides = {
            key: value
            for key, value in (
                ("train_per_family", args.train_per_family),
                ("eval_per_family", args.eval_per_family),
                ("epochs", args.epochs),
            )
            if value is not None
        }
        config = RECIPES[args.name].model_copy(update=overrides)
        path, card = build_oracle(args.name, config, engine_args=parse_engine_args(args.engine_arg))
        print(
            json.dumps(
                {
                    "path": str(path),
                    "heldout": {k: card["heldout"][k] for k in ("n", "oracle", "zero_vector")},
                    "timings_s": card["timings_s"],
                },
                indent=2,
            )
        )
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lens-evals", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    models = sub.add_parser("models", help="embedded models")
    models_sub = models.add_subparsers(dest="models_command", required=True)
    path = models_sub.add_parser("path", help="print a prepared model's directory (prepare if missing)")
    path.add_argument("name", type=model_name)
    models_sub.add_parser("list", help="list embedded model names")
    models.set_defaults(func=_models)
    demo = sub.add_parser("demo", help="capture and steer on the embedded default model")
    demo.add_argument("--model", type=model_name_or_dir, default="smollm2-135m-instruct")
    demo.add_argument("--layer", type=layer_index, default=15)
    demo.add_argument("--scale", type=float, default=8.0, help="steering strength in percent of ||h||")
    add_engine_arg_option(demo)
    demo.set_defaults(func=_demo)
    from lens_evals.probing.science_cli import add_probe_commands, training_set

    probes = sub.add_parser("probes", help="train linear probes on engine activations")
    probes_sub = probes.add_subparsers(dest="probes_command", required=True)
    train = probes_sub.add_parser("train", help="train one probe, write probes/NAME.safetensors and its JSON card")
    train.add_argument("--layer", type=layer_index, default=None, help="default: the model's chosen layer")
    train.add_argument("--name", type=probe_name, default=None)
    train.add_argument("--out", default=None, help="directory (default: LENS_EVALS_PROBE_DIR, else the repository's probes/)")
    convert = probes_sub.add_parser(
        "convert", help="NAME.joblib (a pickle: only files you trust) -> NAME.safetensors beside it, card updated"
    )
    convert.add_argument("files", nargs="+", type=joblib_file, metavar="FILE.joblib")
    sweep = probes_sub.add_parser("sweep", help="validation AUROC per layer, as JSON and PNG")
    sweep.add_argument("--out", default="probes/sweep", help="path without suffix for .json and .png")
    sweep.add_argument("--no-roleplaying", action="store_true", help="skip the Roleplaying transfer curve")
    for command in (train, sweep):
        command.add_argument("--model", type=model_name_or_dir, default="smollm2-135m-instruct")
        command.add_argument(
            "--dataset",
            type=training_set,
            default="instructed-pairs",
            help="instructed-pairs, geometry-of-truth, geometry-of-truth:SET[,SET], or coup",
        )
        command.add_argument("--C", type=positive_float, default=0.1, help="inverse L2 strength of the logistic regression")
        command.add_argument("--limit", type=positive_int, default=None, help="use about this many dialogues")
        add_engine_arg_option(command)
    add_probe_commands(probes_sub)
    probes.set_defaults(func=_probes)
    role = sub.add_parser("roleplaying", help="main job: Roleplaying probe eval on the default model (prepares what is missing)")
    role.add_argument("--model", type=model_name, default="smollm2-135m-instruct")
    role.add_argument("--probe", default=None, help="probe .safetensors (default: the model's Instructed-Pairs probe)")
    role.add_argument("--dataset", type=existing_file, default=None, help="scenarios YAML in Apollo's schema (default: ours)")
    role.add_argument("--limit", type=positive_int, default=None)
    role.add_argument("--log-dir", default="logs")
    role.set_defaults(func=_roleplaying)
    verify = sub.add_parser("verify", help="check the stream contract on a model as vLLM loads it (the start-up self-check)")
    verify.add_argument("model", type=model_name_or_dir, help="an embedded model's name or a model directory")
    verify.add_argument("--json", action="store_true", help="the numbers as JSON")
    verify.add_argument("--no-hf", action="store_true", help="the self-check only, no comparison with HF transformers")
    verify.add_argument(
        "--no-self-check",
        action="store_true",
        help="the comparison with HF only, on an engine serving lens requests whatever the check says",
    )
    add_engine_arg_option(verify)
    verify.set_defaults(func=_verify)
    report = sub.add_parser("report", help="one self-contained HTML page for an eval log (probe tasks, oracle tasks)")
    report.add_argument("log", help="an Inspect .eval log of roleplaying_probe, coup_probe or an activation-oracle task")
    report.add_argument("--out", default=None, help="HTML file to write (default: the log's path with .html)")
    report.set_defaults(func=_report)
    bench = sub.add_parser("bench", help="speed against pure vLLM, HF + hook, nnsight, TransformerLens")
    from lens_evals.bench.main import add_arguments

    add_arguments(bench)
    bench.set_defaults(func=_bench)

    capture = sub.add_parser("capture", help="activations of a prompt set to disk: sharded, resumable, bounded memory")
    from lens_evals.capture.command import add_arguments as add_capture_arguments

    add_capture_arguments(capture)
    capture.set_defaults(func=_capture)

    oracle = sub.add_parser("oracle", help="activation oracles: train one, find it")
    oracle_sub = oracle.add_subparsers(dest="oracle_command", required=True)
    oracle_train = oracle_sub.add_parser("train", help="train an oracle adapter (CPU, minutes) into the oracle cache")
    oracle_train.add_argument("--name", type=oracle_recipe, default="smollm2-135m-oracle")
    oracle_train.add_argument("--train-per-family", type=positive_int)
    oracle_train.add_argument("--eval-per-family", type=positive_int)
    oracle_train.add_argument("--epochs", type=positive_int)
    add_engine_arg_option(oracle_train)
    for oracle_command in ("path", "card"):
        what = "directory" if oracle_command == "path" else "card"
        sub_command = oracle_sub.add_parser(oracle_command, help=f"print a trained oracle's {what}")
        sub_command.add_argument("name", nargs="?", default="smollm2-135m-oracle")
    oracle.set_defaults(func=_oracle)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    parser = build_parser()
    args = parser.parse_args(argv)
    if (args.command == "probes" and args.probes_command in ("train", "train-set")) or args.command == "demo":
        check_layer(parser, args.model, args.layer)
    if args.command == "bench" and not args.gpu:
        from lens_evals.bench.main import CPU_MODEL, PREFILL_CPU_MODEL

        check_layer(parser, args.model or (PREFILL_CPU_MODEL if args.workload == "prefill" else CPU_MODEL), args.layer)
    if args.command == "roleplaying" and args.probe:
        check_probe_for_model(parser, args.probe, args.model)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
