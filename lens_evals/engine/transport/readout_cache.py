"""Readout weights (affine lenses, SAE encoders: request/readouts.py) sent once: the frontend
keeps each by its digest, so a later request may name them by ``{"digest": ...}`` alone, and
passes each once to the workers (which decode each once onto the device by the same digest:
worker/readouts.py): in a file they read when they share the frontend's host
(``readout_files.py``), else inline with every request, encoded once. Bounded in bytes
(``LENS_EVALS_DEVICE_BUDGET_MIB``), least recently used first out; a digest not (or no longer)
held is a clear 400. A file outlives its digest's eviction while requests in flight name it
(``hold`` / ``release``, from the frontend's budget ledger)."""

from __future__ import annotations

import atexit
import threading
from collections import Counter, OrderedDict
from dataclasses import dataclass
from typing import Any

from lens_evals import settings
from lens_evals.engine.transport import readout_files
from lens_evals.engine.transport.handoff_files import remove_if_own
from lens_evals.request.readouts import AffineLens, LensReadout, Readout, SaeEncoder, SaeReadout


@dataclass
class _Entry:
    weights: AffineLens | SaeEncoder
    wire: dict[str, Any] | None = None  # the inline wire dict, encoded once when first sent inline
    file: str | None = None  # the hand-off file holding them (readout_files.py), once written


class WeightsByDigest:
    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.entries: OrderedDict[str, _Entry] = OrderedDict()
        self.held = 0
        self.users: Counter[str] = Counter()  # digest -> requests in flight naming it (their files stay)
        self.dropped_files: dict[str, str] = {}  # digest -> file of weights dropped while in use
        self.lock = threading.Lock()
        atexit.register(self.remove_files)

    def resolve(self, weights: AffineLens | SaeEncoder, directory: str | None = None) -> tuple[AffineLens | SaeEncoder, dict[str, Any]]:
        """(the inline weights, their wire dict for the workers) for weights given inline or by
        digest: the weights themselves, encoded once, or (``directory``: the workers read files
        of the frontend's hand-off directory) ``{"digest", "file"}`` naming a file written once."""
        digest = weights.content_digest()
        with self.lock:
            entry = self.entries.get(digest)
            if entry is not None:
                self.entries.move_to_end(digest)
        if (entry is None and not weights.inline) or (entry is not None and not isinstance(entry.weights, type(weights))):
            what = "affine lens" if isinstance(weights, AffineLens) else "SAE encoder"
            raise ValueError(
                f"unknown {what} digest {digest!r}: this engine does not hold those weights (never sent, or evicted "
                f"past {settings.DEVICE_BUDGET_MIB.name}); send the weights inline once"
            )
        if entry is None:
            entry = self._add(digest, _Entry(weights))
        if directory is None:
            if entry.wire is None:
                entry.wire = entry.weights.to_wire()
            return entry.weights, entry.wire
        if entry.file is None:  # the hand-off directory is the process's (HandoffTarget): one file per digest
            entry.file = readout_files.write(directory, entry.weights)
        return entry.weights, {"digest": digest, "file": entry.file}

    def _add(self, digest: str, entry: _Entry) -> _Entry:
        with self.lock:
            entry.file = self.dropped_files.pop(digest, None)  # dropped while in use: its file is still there
            self.entries[digest] = entry
            self.held += entry.weights.nbytes()
            while self.held > self.max_bytes and len(self.entries) > 1:
                gone_digest, gone = self.entries.popitem(last=False)
                self.held -= gone.weights.nbytes()
                if gone.file is not None:
                    if self.users[gone_digest] > 0:
                        self.dropped_files[gone_digest] = gone.file
                    else:
                        remove_if_own(gone.file)
        return entry

    def hold(self, digest: str) -> None:
        """A request in flight names ``digest``: its file stays until :meth:`release`."""
        with self.lock:
            self.users[digest] += 1

    def release(self, digest: str) -> None:
        with self.lock:
            self.users[digest] -= 1
            if self.users[digest] > 0:
                return
            del self.users[digest]
            path = self.dropped_files.pop(digest, None)
        if path is not None:
            remove_if_own(path)

    def files(self) -> list[str]:
        with self.lock:
            return [e.file for e in self.entries.values() if e.file is not None] + list(self.dropped_files.values())

    def remove_files(self) -> None:
        for path in self.files():
            remove_if_own(path)


_weights = WeightsByDigest(settings.DEVICE_BUDGET_MIB.in_bytes())


def hold(digest: str) -> None:
    _weights.hold(digest)


def release(digest: str) -> None:
    _weights.release(digest)


def held_files() -> list[str]:
    """The weights files this process's frontend keeps (diagnostics and tests)."""
    return _weights.files()


def normalise(readouts: list[Readout], num_layers: int, directory: str | None = None) -> list[tuple[Readout, dict[str, Any]]]:
    """Each readout with its weights resolved (digest -> weights held here) and its wire dict
    for the worker (layers resolved; weights inline, encoded once per digest, or with
    ``directory`` in a file of it written once per digest)."""
    out: list[tuple[Readout, dict[str, Any]]] = []
    for readout in readouts:
        if isinstance(readout, LensReadout):
            lens, encoded = _weights.resolve(readout.lens, directory) if readout.lens is not None else (None, None)
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
            sae, encoded = _weights.resolve(readout.sae, directory)
            resolved = readout.model_copy(update={"sae": sae})
            item = {"kind": "sae", "name": readout.name, "layer": readout.layer, "top_k": readout.top_k, "sae": encoded}
        out.append((resolved, item))
    return out
