"""The frontend's half of the row store: a fetch reply's rows as tensors (``result_tensors``)
and one request's results merged over the workers that sent them (tensor-parallel ranks send
nothing or the same rows; pipeline stages send their own layers and hook results)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from lens_evals.engine.transport.protocol import ROW_PARTS, FetchReply, FetchResult, PackedRows
from lens_evals.wire import formats as wire


def result_tensors(result: FetchResult | dict[str, Any]) -> dict[str, Any]:
    """A worker's fetch result as tensors: ``residual_stream`` / ``probe_scores`` and their ids
    (``layers`` / ``probe_index``, lists), for the parts present."""
    out: dict[str, Any] = {}
    for name, ids_name in ROW_PARTS:
        if name in result:
            out[name] = PackedRows.decode(result[name])  # type: ignore[literal-required]
            out[ids_name] = [int(i) for i in result[ids_name]]  # type: ignore[literal-required]
    return out


@dataclass
class Merged:
    layers: dict[int, torch.Tensor]  # capture layer -> (n_positions, hidden)
    probes: dict[int, torch.Tensor]  # probe index -> (n_positions,)
    saved: dict[str, Any] | None = None  # hook results, encoded (merged over pipeline stages)
    # (layers, (n_layers, n_positions, hidden)) as each rank sent them: one rank's block in the
    # request's layer order is used as it is, without stacking again
    streams: list[tuple[list[int], torch.Tensor]] = field(default_factory=list)
    set_saved: dict[str, Any] | None = None


def _merge_saved(into: dict[str, Any] | None, part: dict[str, Any] | None) -> dict[str, Any] | None:
    """Per-hook saved dicts ({hook index: saved}) of two pipeline stages, joined per hook."""
    if part is None:
        return into
    merged = {index: dict(saved) for index, saved in (into or {}).items()}
    for index, saved in part.items():
        clash = sorted(set(merged.get(index, {})) & set(saved))
        if clash:
            raise ValueError(f"hook {index}: saved keys {clash} were written on two pipeline stages")
        merged[index] = {**merged.get(index, {}), **saved}
    return merged


def merge_rank_results(rank_results: list[FetchReply], key: str) -> tuple[Merged, str | None]:
    merged = Merged({}, {})
    for per_rank in rank_results:
        result = per_rank.get(key) if per_rank else None
        if not result:
            continue
        if "error" in result:
            return merged, str(result["error"])
        try:
            merged.saved = _merge_saved(merged.saved, result.get("saved"))
            merged.set_saved = _merge_saved(merged.set_saved, result.get("set_saved"))
        except ValueError as exc:
            return merged, str(exc)
        try:
            tensors = result_tensors(result)
        except ValueError as exc:
            return merged, f"could not read the worker's rows: {exc}"
        if "residual_stream" in tensors:
            merged.streams.append((tensors["layers"], tensors["residual_stream"]))
        for i, layer in enumerate(tensors.get("layers", [])):
            merged.layers[layer] = tensors["residual_stream"][i]
        for i, index in enumerate(tensors.get("probe_index", [])):
            merged.probes[index] = tensors["probe_scores"][i]
    return merged, None


def decode_saved(saved: dict[str, Any] | None) -> dict[str, Any]:
    decoded: dict[str, Any] = wire.decode_tree_native(saved or {})
    return decoded
