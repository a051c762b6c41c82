"""``lens-evals readouts``: fit the readouts that need fitting (``lens_evals.readouts``): a tuned
lens, a Jacobian lens, a TopK SAE from a capture directory; and ``kl``, each lens against the
logit lens on held-out prompts (docs/readouts.md, "Fitting")."""

from __future__ import annotations

import argparse
import json
import sys

from lens_evals.cli.checks import layer_index, model_name_or_dir, positive_float, positive_int

HELP = "fit a tuned / Jacobian lens or an SAE; compare lenses by KL per layer"


def _layers(text: str) -> list[int]:
    try:
        return sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"--layers takes comma-separated integers, e.g. 0,4,8; got {text!r}") from None


def _fraction(text: str) -> float:
    value = float(text)
    if not 0 < value < 1:
        raise argparse.ArgumentTypeError(f"expected a fraction between 0 and 1, got {text}")
    return value


def _named_lens(text: str) -> tuple[str, str]:
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"--lens takes NAME=PATH, e.g. tuned=tuned.safetensors; got {text!r}")
    return name, path


def _prompt_options(parser: argparse.ArgumentParser, n_prompts: int) -> None:
    parser.add_argument("--model", type=model_name_or_dir, default="smollm2-135m-instruct", help="embedded model name or a model directory")
    parser.add_argument("--prompts", default=None, help="prompt file (as `lens-evals capture` reads); default: built-in passages")
    parser.add_argument("--n-prompts", type=positive_int, default=n_prompts, help="prompts read (train + held out)")
    parser.add_argument("--max-tokens", type=positive_int, default=64, help="each prompt cut to this many tokens")
    parser.add_argument("--held-out", type=_fraction, default=0.2, help="fraction of prompts held out of fitting (what `kl` reads)")
    parser.add_argument("--skip-first", type=int, default=1, help="positions of each prompt left out (attention sink)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=positive_int, default=None, help="torch CPU threads")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    commands = parser.add_subparsers(dest="readouts_command", required=True)
    tuned = commands.add_parser("fit-tuned", help="tuned lens: affine translator per layer, trained on KL to the final distribution")
    _prompt_options(tuned, 200)
    tuned.add_argument("--layers", type=_layers, default=None, help="layers to fit (default: all)")
    tuned.add_argument("--steps", type=positive_int, default=200)
    tuned.add_argument("--batch-tokens", type=positive_int, default=256)
    tuned.add_argument("--lr", type=positive_float, default=1e-3)
    tuned.add_argument(
        "--vocab",
        type=positive_int,
        default=None,
        help="train on the N tokens with the most final-distribution mass (default: all; CPU saving)",
    )
    tuned.add_argument("--out", required=True, help="the lens file (.safetensors)")

    jacobian = commands.add_parser("fit-jacobian", help="Jacobian lens: average same-position Jacobian to the last layer")
    _prompt_options(jacobian, 200)
    jacobian.add_argument("--layers", type=_layers, default=None, help="source layers (default: all)")
    jacobian.add_argument("--fit-prompts", type=positive_int, default=None, help="use only the first N training prompts")
    jacobian.add_argument("--probes", choices=("rademacher", "basis"), default="rademacher")
    jacobian.add_argument("--copies", type=positive_int, default=8, help="cotangent copies per backward")
    jacobian.add_argument("--jacobian-skip-first", type=int, default=4, help="positions of each prompt left out of the average")
    jacobian.add_argument("--out", required=True, help="the lens file (.safetensors)")

    sae = commands.add_parser("train-sae", help="TopK SAE on one layer of a `lens-evals capture` directory")
    sae.add_argument("capture", help="a `lens-evals capture` directory")
    sae.add_argument("--layer", type=layer_index, required=True)
    sae.add_argument("--d-sae", type=positive_int, default=2048)
    sae.add_argument("--k", type=positive_int, default=32)
    sae.add_argument("--steps", type=positive_int, default=2000)
    sae.add_argument("--batch-tokens", type=positive_int, default=512)
    sae.add_argument("--lr", type=positive_float, default=1e-3)
    sae.add_argument("--held-out", type=_fraction, default=0.1)
    sae.add_argument("--skip-first", type=int, default=1)
    sae.add_argument("--seed", type=int, default=0)
    sae.add_argument("--threads", type=positive_int, default=None)
    sae.add_argument("--quiet", action="store_true")
    sae.add_argument("--out", required=True, help="the SAE folder (SAE-Lens layout)")

    kl = commands.add_parser("kl", help="KL(final || lens) per layer on the held-out prompts, logit lens and each --lens")
    _prompt_options(kl, 200)
    kl.add_argument("--lens", type=_named_lens, action="append", default=[], help="NAME=PATH of an affine-lens file (repeatable)")
    kl.add_argument("--layers", type=_layers, default=None, help="layers to evaluate (default: all)")
    kl.add_argument("--plot", default=None, help="write a PNG plot here")
    kl.add_argument("--json", dest="json_out", default=None, help="write the curves as JSON here")


def run(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    from lens_evals.readouts import runs

    runs.threads(args.threads)
    progress = not args.quiet
    if args.readouts_command == "train-sae":
        from lens_evals.readouts.sae_train import SaeSettings

        settings = SaeSettings(d_sae=args.d_sae, k=args.k, steps=args.steps, batch_tokens=args.batch_tokens, lr=args.lr, seed=args.seed)
        if args.k > args.d_sae:
            parser.error(f"--k {args.k} exceeds --d-sae {args.d_sae}")
        report = runs.sae_from_capture(args.capture, args.layer, args.out, settings, args.skip_first, args.held_out, progress)
        print(json.dumps(report.as_dict(), indent=2))
        return 0
    prompts = runs.PromptSet(args.prompts, args.n_prompts, args.max_tokens, args.held_out, args.seed, args.skip_first)
    loaded = runs.load(args.model, prompts)
    if args.readouts_command == "fit-tuned":
        from lens_evals.readouts.tuned import TunedLensSettings

        settings_t = TunedLensSettings(steps=args.steps, batch_tokens=args.batch_tokens, lr=args.lr, seed=args.seed)
        path, history = runs.fit_tuned(loaded, args.out, args.layers, settings_t, args.skip_first, progress, args.vocab)
        print(f"tuned lens -> {path} (training KL summed over layers: {history[0]:.3f} -> {history[-1]:.3f})")
    elif args.readouts_command == "fit-jacobian":
        from lens_evals.readouts.jacobian import JacobianSettings

        if args.fit_prompts:
            loaded.train = loaded.train[: args.fit_prompts]
        settings_j = JacobianSettings(probes=args.probes, copies=args.copies, skip_first=args.jacobian_skip_first, seed=args.seed)
        print(f"jacobian lens -> {runs.fit_jacobian(loaded, args.out, args.layers, settings_j, progress)}")
    else:
        curves = runs.kl_report(loaded, dict(args.lens), args.skip_first, args.plot, layers=args.layers, progress=progress)
        print(runs.kl_markdown(curves))
        if args.json_out:
            with open(args.json_out, "w", encoding="utf-8") as handle:
                json.dump({name: {str(k): v for k, v in curve.items()} for name, curve in curves.items()}, handle, indent=2)
    sys.stdout.flush()
    return 0
