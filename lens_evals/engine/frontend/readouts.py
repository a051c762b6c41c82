"""A request's readouts (``output_readouts``) as the frontend attaches them: the workers' float32
blocks ``(n_layers, n_positions, 2 * top_k)`` (worker/readout_store.py; pipeline stages each send
their layers) split into ids and values and trimmed to the request's positions::

    lens: {"layers": [...], "token_ids": int32 (n_layers, n_positions, top_k), "logprobs": float32 (same)}
    sae:  {"layer": i, "latent_ids": int32 (n_positions, top_k), "values": float32 (same)}
"""

from __future__ import annotations

from typing import Any

import torch

from lens_evals.engine.transport.protocol import FetchReply, PackedRows


def readout_outputs(
    rank_results: list[FetchReply], key: str, wanted: tuple[tuple[str, str, tuple[int, ...]], ...], expected: int
) -> tuple[dict[str, Any], str | None]:
    """(name -> output, None) or ({}, the error)."""
    by_layer: dict[int, dict[int, torch.Tensor]] = {}  # readout index -> layer -> (n_positions, 2k)
    for per_rank in rank_results:
        result = per_rank.get(key) if per_rank else None
        for index, part in ((result or {}).get("readouts") or {}).items():
            try:
                block = PackedRows.decode(part["rows"])
            except (KeyError, ValueError) as exc:
                return {}, f"could not read the worker's readouts: {exc}"
            for i, layer in enumerate(part["layers"]):
                by_layer.setdefault(int(index), {})[int(layer)] = block[i]
    out: dict[str, Any] = {}
    for n, (name, kind, layers) in enumerate(wanted):
        got = by_layer.get(n, {})
        missing = [layer for layer in layers if layer not in got]
        if missing:
            return {}, f"no readout {name!r} came back for layers {missing}"
        rows = torch.stack([got[layer] for layer in layers])
        if rows.shape[1] < expected:
            return {}, f"readout {name!r} is short: {rows.shape[1]} positions, expected {expected}"
        rows = rows[:, :expected]
        k = rows.shape[-1] // 2
        ids, values = rows[..., :k].to(torch.int32), rows[..., k:].contiguous()
        if kind == "lens":
            out[name] = {"layers": list(layers), "token_ids": ids, "logprobs": values}
        else:
            out[name] = {"layer": layers[0], "latent_ids": ids[0], "values": values[0]}
    return out, None
