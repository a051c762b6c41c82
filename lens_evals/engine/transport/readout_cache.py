"""Readout weights (affine lenses, SAE encoders: request/readouts.py) sent once: the frontend
keeps each by its digest, so a later request may name them by ``{"digest": ...}`` alone, and
encodes each once for the workers (which decode each once onto the device by the same digest:
worker/readouts.py). Bounded in bytes (``LENS_EVALS_DEVICE_BUDGET_MIB``), least recently used
first out; a digest not (or no longer) held is a clear 400."""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any

from lens_evals import settings
from lens_evals.request.readouts import AffineLens, LensReadout, Readout, SaeEncoder, SaeReadout


class WeightsByDigest:
    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.entries: OrderedDict[str, tuple[AffineLens | SaeEncoder, dict[str, Any]]] = OrderedDict()
        self.held = 0
        self.lock = threading.Lock()

    def resolve(self, weights: AffineLens | SaeEncoder) -> tuple[AffineLens | SaeEncoder, dict[str, Any]]:
        """(the inline weights, their wire dict encoded once) for weights given inline or by digest."""
        digest = weights.content_digest()
        with self.lock:
            entry = self.entries.get(digest)
            if entry is not None:
                self.entries.move_to_end(digest)
                if isinstance(entry[0], type(weights)):
                    return entry
        if entry is not None or not weights.inline:
            what = "affine lens" if isinstance(weights, AffineLens) else "SAE encoder"
            raise ValueError(
                f"unknown {what} digest {digest!r}: this engine does not hold those weights (never sent, or evicted "
                f"past {settings.DEVICE_BUDGET_MIB.name}); send the weights inline once"
            )
        entry = (weights, weights.to_wire())
        with self.lock:
            self.entries[digest] = entry
            self.held += weights.nbytes()
            while self.held > self.max_bytes and len(self.entries) > 1:
                _, (dropped, _) = self.entries.popitem(last=False)
                self.held -= dropped.nbytes()
        return entry


_weights = WeightsByDigest(settings.DEVICE_BUDGET_MIB.in_bytes())


def normalise(readouts: list[Readout], num_layers: int) -> list[tuple[Readout, dict[str, Any]]]:
    """Each readout with its weights resolved (digest -> weights held here) and its wire dict
    for the worker (layers resolved, weights inline, encoded once per digest)."""
    out: list[tuple[Readout, dict[str, Any]]] = []
    for readout in readouts:
        if isinstance(readout, LensReadout):
            lens, encoded = _weights.resolve(readout.lens) if readout.lens is not None else (None, None)
            resolved: Readout = readout.model_copy(update={"lens": lens})
            assert isinstance(resolved, LensReadout)
            item = {
                "kind": "lens",
                "name": readout.name,
                "layers": resolved.layers_for(num_layers),
                "top_k": readout.top_k,
                "lens": encoded,
            }
        else:
            assert isinstance(readout, SaeReadout)
            sae, encoded = _weights.resolve(readout.sae)
            resolved = readout.model_copy(update={"sae": sae})
            item = {"kind": "sae", "name": readout.name, "layer": readout.layer, "top_k": readout.top_k, "sae": encoded}
        out.append((resolved, item))
    return out
