"""The fitting runs behind ``lens-evals readouts``: model + prompt set in, the contract's files out.
Every run splits the prompt set the same way for a given seed and held-out fraction, so ``kl``
reads the prompts the fits left out."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lens_evals.readouts.hf_parts import ModelParts, capture_streams, check_head, load_hf_model, model_parts
from lens_evals.readouts.jacobian import JacobianSettings, fit_jacobian_lens
from lens_evals.readouts.kl import kl_per_layer, markdown_table, plot_kl
from lens_evals.readouts.lens_files import AffineLensWeights, load_affine_lens, save_affine_lens
from lens_evals.readouts.prompts import prompt_token_ids, split
from lens_evals.readouts.sae_files import save_sae
from lens_evals.readouts.sae_train import SaeReport, SaeSettings, capture_tokens, evaluate_sae, train_sae
from lens_evals.readouts.tuned import TunedLensSettings, fit_tuned_lens, top_mass_tokens


@dataclass(frozen=True)
class PromptSet:
    path: str | None = None  # None: the built-in passages
    n_prompts: int = 200
    max_tokens: int = 64
    held_out: float = 0.2
    seed: int = 0
    skip_first: int = 1  # positions of each prompt left out of training and evaluation


@dataclass
class Loaded:
    name: str
    parts: ModelParts
    train: list[list[int]]
    held_out: list[list[int]]


def load(model: str, prompts: PromptSet) -> Loaded:
    hf, tokenizer = load_hf_model(model)
    parts = model_parts(hf)
    ids = prompt_token_ids(tokenizer, prompts.path, prompts.n_prompts, prompts.max_tokens, prompts.seed)
    check_head(parts, ids[0])
    train, held = split(ids, prompts.held_out, prompts.seed)
    return Loaded(model, parts, train, held)


def _layers(parts: ModelParts, layers: Sequence[int] | None) -> list[int]:
    chosen = list(range(parts.num_layers)) if layers is None else sorted(set(layers))
    bad = [layer for layer in chosen if not 0 <= layer < parts.num_layers]
    if bad:
        raise ValueError(f"layers {bad} are not in 0..{parts.num_layers - 1}")
    return chosen


def fit_tuned(
    loaded: Loaded,
    out: str | Path,
    layers: Sequence[int] | None,
    settings: TunedLensSettings,
    skip_first: int = 1,
    progress: bool = True,
    vocab: int | None = None,
) -> tuple[Path, list[float]]:
    parts, last = loaded.parts, loaded.parts.num_layers - 1
    chosen = [layer for layer in _layers(parts, layers) if layer != last]
    streams = capture_streams(parts, loaded.train, [*chosen, last], skip_first=skip_first, progress=progress)
    final = streams.pop(last)
    unembed = parts.unembed
    if vocab is not None:  # train on the tokens carrying the most final-distribution mass (a CPU saving)
        kept = top_mass_tokens(final, parts.head, vocab)
        unembed = parts.unembed_subset(kept)
    lens, history = fit_tuned_lens(streams, final, parts.final_norm, unembed, settings, progress, last_layer=last)
    lens.meta["n_prompts"], lens.meta["n_tokens"] = str(len(loaded.train)), str(final.shape[0])
    lens.meta["train_vocab"] = "all" if vocab is None else str(vocab)
    return save_affine_lens(out, lens, loaded.name, parts.num_layers), history


def fit_jacobian(loaded: Loaded, out: str | Path, layers: Sequence[int] | None, settings: JacobianSettings, progress: bool = True) -> Path:
    parts = loaded.parts
    lens = fit_jacobian_lens(parts, loaded.train, _layers(parts, layers), settings, progress)
    return save_affine_lens(out, lens, loaded.name, parts.num_layers)


def kl_report(
    loaded: Loaded,
    lenses: Mapping[str, str | Path],
    skip_first: int = 1,
    plot: str | Path | None = None,
    title: str = "",
    layers: Sequence[int] | None = None,
    progress: bool = False,
) -> dict[str, dict[int, float]]:
    """``{"logit": {layer: KL}, <name>: ...}`` on the held-out prompts; a PNG at ``plot``."""
    parts, last = loaded.parts, loaded.parts.num_layers - 1
    loaded_lenses: dict[str, AffineLensWeights | None] = {"logit": None}
    for name, path in lenses.items():
        lens = load_affine_lens(path)
        if lens.meta.get("model") not in (None, loaded.name):
            raise ValueError(f"{path} was fitted on {lens.meta.get('model')!r}, not {loaded.name!r}")
        loaded_lenses[name] = lens
    chosen = sorted({*_layers(parts, layers), last})
    streams = capture_streams(parts, loaded.held_out, chosen, skip_first=skip_first, progress=progress)
    curves = kl_per_layer(parts, streams, streams[last], loaded_lenses, progress=progress)
    if plot is not None:
        n_tokens = streams[last].shape[0]
        plot_kl(curves, plot, title or f"{loaded.name}: {len(loaded.held_out)} held-out prompts, {n_tokens} tokens")
    return curves


def kl_markdown(curves: Mapping[str, Mapping[int, float]]) -> str:
    return markdown_table(curves, sorted(set().union(*(set(c) for c in curves.values()))))


def sae_from_capture(
    capture_dir: str | Path,
    layer: int,
    out: str | Path,
    settings: SaeSettings,
    skip_first: int = 1,
    held_out: float = 0.1,
    progress: bool = True,
) -> SaeReport:
    """Train, evaluate on held-out prompts, write the SAE-Lens folder (with ``report.json``)."""
    from lens_evals.capture.loader import CaptureReader

    model = CaptureReader(capture_dir).manifest.model
    train, held = capture_tokens(capture_dir, layer, skip_first, held_out, settings.seed)
    sae = train_sae(train, layer, settings, progress)
    report = evaluate_sae(sae, held, int(train.shape[0]))
    extra: dict[str, Any] = {"training": {**settings.__dict__, "capture": str(capture_dir), "skip_first": skip_first}}
    folder = save_sae(out, sae, model, extra)
    (folder / "report.json").write_text(json.dumps(report.as_dict(), indent=2) + "\n", encoding="utf-8")
    return report


def threads(n: int | None) -> None:
    if n:
        torch.set_num_threads(n)
