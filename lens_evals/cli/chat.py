"""``lens-evals chat --server URL``: a local web page to chat with a lens server's model and watch
its activations (docs/chat.md)."""

from __future__ import annotations

import argparse
import sys

from lens_evals.cli.checks import existing_file, layer_index, positive_int

HELP = "a local web page: chat with a lens server's model, probe colours, lens, steering, oracle"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--server", required=True, help="the lens server's URL, e.g. http://127.0.0.1:8000")
    parser.add_argument("--model", help="the served model's name (default: the server's first)")
    parser.add_argument("--probe", action="append", default=[], type=existing_file, help="a probe file (repeatable)")
    parser.add_argument(
        "--vector", action="append", default=[], type=existing_file, help="a steering vector .npy/.safetensors (repeatable)"
    )
    parser.add_argument("--sae", help="an SAE-Lens folder (cfg.json + sae_weights.safetensors)")
    parser.add_argument(
        "--lens", type=existing_file, help="an affine lens file (tuned / Jacobian, docs/readouts-fitting.md); default: the logit lens"
    )
    parser.add_argument("--lens-layer", action="append", type=layer_index, dest="lens_layers", help="a layer the lens shows (default: all)")
    parser.add_argument("--top-k", type=positive_int, default=5, help="the lens's tokens per layer")
    parser.add_argument("--num-layers", type=positive_int, help="the model's layer count, where its config is not a local file")
    parser.add_argument("--oracle-lora", default="oracle", help="the served activation-oracle adapter's name")
    parser.add_argument("--oracle-card", help="a trained oracle's name or directory: its target layer and settings")
    parser.add_argument("--oracle-layer", type=layer_index, help="the oracle's target layer without a card (default 15)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=positive_int, default=8765)


def run(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    import uvicorn

    from lens_evals.chat.app import build_app
    from lens_evals.chat.setup import ChatOptions, open_backend
    from lens_evals.chat.upstream import UpstreamError

    options = ChatOptions(
        server=args.server,
        model=args.model,
        probes=args.probe,
        vectors=args.vector,
        sae=args.sae,
        lens=args.lens,
        lens_layers=args.lens_layers,
        top_k=args.top_k,
        num_layers=args.num_layers,
        oracle_lora=args.oracle_lora,
        oracle_card=args.oracle_card,
        oracle_layer=args.oracle_layer,
    )
    try:
        backend = open_backend(options)
    except (UpstreamError, ValueError, FileNotFoundError) as exc:
        print(f"lens-evals chat: {exc}", file=sys.stderr)
        return 2
    print(f"lens-evals chat: http://{args.host}:{args.port}/ (model {backend.model} at {backend.upstream.url})", flush=True)
    uvicorn.run(build_app(backend), host=args.host, port=args.port, log_level="warning")
    return 0
