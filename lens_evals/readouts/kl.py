"""How well a lens reads each layer: ``KL(p_final || p_lens)`` per layer, in nats, averaged over
the tokens of held-out prompts; and the plot of several lenses against layer."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

from lens_evals.readouts.hf_parts import ModelParts
from lens_evals.readouts.lens_files import AffineLensWeights
from lens_evals.readouts.reference import translate
from lens_evals.readouts.tuned import kl_to_target


@torch.no_grad()
def kl_per_layer(
    parts: ModelParts,
    streams: Mapping[int, torch.Tensor],
    final_stream: torch.Tensor,
    lenses: Mapping[str, AffineLensWeights | None],
    chunk: int = 512,
    progress: bool = False,
) -> dict[str, dict[int, float]]:
    """lens name -> layer -> mean over tokens of ``KL(final || lens)`` (a lens of None is the logit
    lens); layers a lens has no translator for are left out. The final distribution is computed
    once per chunk of tokens for every lens and layer."""
    from tqdm.auto import tqdm

    n = final_stream.shape[0]
    sums: dict[str, dict[int, float]] = {name: {} for name in lenses}
    bar = tqdm(total=-(-n // chunk) * len(lenses) * len(streams), desc="kl", disable=not progress)
    for begin in range(0, n, chunk):
        rows = slice(begin, min(begin + chunk, n))
        target = torch.log_softmax(parts.head(final_stream[rows]), dim=-1)
        for name, lens in lenses.items():
            for layer in sorted(streams):
                bar.update()
                if lens is not None and layer not in lens.weights:
                    continue
                kl = kl_to_target(target, parts.head(translate(streams[layer][rows], lens, layer))).item()
                sums[name][layer] = sums[name].get(layer, 0.0) + kl * (rows.stop - rows.start)
    bar.close()
    return {name: {layer: total / n for layer, total in curve.items()} for name, curve in sums.items()}


def plot_kl(curves: Mapping[str, Mapping[int, float]], path: str | Path, title: str) -> Path:
    """A PNG: KL to the final distribution against layer, one line per lens (log scale). Zeros
    (the last layer, where every lens is the model's own output) have no place on a log scale:
    left out, and the axis label says so."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    zero_layers: set[int] = set()
    for name, curve in curves.items():
        layers = [i for i in sorted(curve) if curve[i] > 0]
        zero_layers |= set(curve) - set(layers)
        ax.plot(layers, [curve[i] for i in layers], marker="o", markersize=3, label=name)
    ax.set_yscale("log")
    left_out = f"; KL 0 at layer {', '.join(map(str, sorted(zero_layers)))}, not drawn" if zero_layers else ""
    ax.set_xlabel(f"layer (decoder layer output){left_out}")
    ax.set_ylabel("KL(final || lens), nats")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


def markdown_table(curves: Mapping[str, Mapping[int, float]], layers: Sequence[int]) -> str:
    names = list(curves)
    lines = ["| layer | " + " | ".join(names) + " |", "|---:|" + "---:|" * len(names)]
    for layer in layers:
        cells = [f"{curves[name][layer]:.3f}" if layer in curves[name] else "" for name in names]
        lines.append(f"| {layer} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
