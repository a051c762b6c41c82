"""Probes sent again and again (an eval sends the same few probes with every request) are
encoded once on the frontend and decoded once on each worker, by the probe's digest; both
caches are bounded (least recently used goes first).

The digest is SHA-256 of the float32 weights and the float64 bias: the frontend computes it with
the encoding and sends it beside the probe (``LensRequestWire.probe_digests``); the worker keys its
device tensors by it and its step planner stacks each distinct digest once."""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, Generic, TypeVar

import numpy as np

from lens_evals.request.spec import LinearProbe

K = TypeVar("K")
V = TypeVar("V")
CACHED_PROBES = 256  # per cache: a few MiB of weights at hidden 4096


class LRU(Generic[K, V]):
    """A dict of at most ``size`` entries; the least recently used one is dropped first."""

    def __init__(self, size: int = CACHED_PROBES) -> None:
        self.size = size
        self.entries: OrderedDict[K, V] = OrderedDict()

    def get_or_make(self, key: K, make: Callable[[], V]) -> V:
        entries = self.entries
        value = entries.get(key)
        if value is not None:
            entries.move_to_end(key)
            return value
        value = entries[key] = make()
        if len(entries) > self.size:
            entries.popitem(last=False)
        return value

    def __len__(self) -> int:
        return len(self.entries)


def probe_digest(weights: np.ndarray, bias: float) -> str:
    """What identifies a probe's read-out: its float32 weights and its bias."""
    return hashlib.sha256(np.ascontiguousarray(weights, dtype=np.float32).tobytes() + np.float64(bias).tobytes()).hexdigest()


_encoded: LRU[tuple[str, int, bytes, bytes], tuple[dict[str, Any], str]] = LRU()


def encode_probe(probe: LinearProbe) -> tuple[dict[str, Any], str]:
    """(``probe.to_wire()``, its digest), made once per distinct probe. The key is the probe's
    content, not the object: a probe whose weights array was changed in place is a new probe.
    The wire dict is shared by the requests that send the probe: it is only read."""
    weights = np.ascontiguousarray(probe.weights, dtype=np.float32).tobytes()
    bias = np.float64(probe.bias).tobytes()
    return _encoded.get_or_make(
        (probe.name, probe.layer, bias, weights), lambda: (probe.to_wire(), probe_digest(probe.weights, probe.bias))
    )
