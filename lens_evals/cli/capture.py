"""``lens-evals capture``: activations of a prompt set to disk (``lens_evals.capture``)."""

from __future__ import annotations

import argparse
import os
import sys

from lens_evals.cli.checks import model_name_or_dir
from lens_evals.engine.frontend.offline import add_engine_arg_option, parse_engine_args

HELP = "activations of a prompt set to disk: sharded, resumable, bounded memory"
MIB = 1 << 20


def _layers(text: str) -> list[int]:
    try:
        return sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"--layers takes comma-separated integers, e.g. 3,15; got {text!r}") from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "prompts",
        help="JSONL (prompt / messages / prompt_token_ids per line), a datasets file "
        "(.parquet, .arrow, .csv, a save_to_disk directory) or an Inspect .eval log",
    )
    parser.add_argument("--model", type=model_name_or_dir, required=True, help="embedded model name or a model directory")
    parser.add_argument("--layers", type=_layers, required=True, help="comma-separated layer indices, e.g. 3,15")
    parser.add_argument("--out", required=True, help="directory for the shards and manifest.json (resumes a partial capture)")
    parser.add_argument("--batch-size", type=int, default=16, help="prompts per engine call")
    parser.add_argument("--shard-rows", type=int, default=256, help="prompts per shard at most")
    parser.add_argument("--shard-mib", type=float, default=256, help="capture MiB per shard at most (the shard buffer)")
    parser.add_argument("--max-shards", type=int, default=None, help="stop after this many shards (resume later)")
    parser.add_argument("--writers", type=int, default=2, help="writer threads: shards written while the engine runs")
    parser.add_argument("--no-direct-io", dest="direct_io", action="store_false", help="write through the page cache, not O_DIRECT")
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--dtype", default=None, help="engine dtype (default: float32 for embedded models, else the model's)")
    add_engine_arg_option(parser)


def run(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from lens_evals.capture.manifest import CaptureError
    from lens_evals.capture.runner import CaptureSettings, CaptureStopped, run_capture

    engine_args = {**({"dtype": args.dtype} if args.dtype else {}), **parse_engine_args(args.engine_arg)}
    try:
        settings = CaptureSettings(
            batch_size=args.batch_size,
            shard_rows=args.shard_rows,
            shard_bytes=int(args.shard_mib * MIB),
            max_shards=args.max_shards,
            writers=args.writers,
            direct_io=args.direct_io,
        )
        manifest = run_capture(
            args.prompts, args.model, args.layers, args.out, settings=settings, max_model_len=args.max_model_len, engine_args=engine_args
        )
    except CaptureStopped as exc:
        print(f"lens-evals capture: {exc}", file=sys.stderr)
        return 3
    except CaptureError as exc:
        print(f"lens-evals capture: {exc}", file=sys.stderr)
        return 2
    n_bytes = sum(shard.n_bytes for shard in manifest.shards)
    print(f"{len(manifest.rows)} prompts, {len(manifest.shards)} shards, {n_bytes / MIB:.1f} MiB in {args.out}")
    return 0
