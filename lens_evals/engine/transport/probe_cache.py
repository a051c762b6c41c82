"""Probes and steering vectors sent again and again (an eval sends the same few with every
request) are encoded once on the frontend and decoded once on each worker, by their digest; the
caches are bounded (least recently used goes first).

A probe's digest is SHA-256 of the float32 weights and the float64 bias: the frontend computes it
with the encoding and sends it beside the probe (``LensRequestWire.probe_digests``); the worker keys
its device tensors by it and its step planner stacks each distinct digest once. A steering
vector's is SHA-256 of everything its wire form says (``steering_wire_digest``), sent in
``LensRequestWire.steering_digests``: the worker decodes a vector once per digest."""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, Generic, TypeVar

import numpy as np

from lens_evals.request.spec import LinearProbe, SteeringVector

K = TypeVar("K")
V = TypeVar("V")
CACHED_PROBES = 256  # per cache: a few MiB of weights at hidden 4096


class LRU(Generic[K, V]):
    """A dict of at most ``size`` entries; the least recently used one is dropped first."""

    def __init__(self, size: int = CACHED_PROBES) -> None:
        self.size = size
        self.entries: OrderedDict[K, V] = OrderedDict()

    def get(self, key: K) -> V | None:
        """The value kept for ``key`` (now the most recently used), or None."""
        value = self.entries.get(key)
        if value is not None:
            self.entries.move_to_end(key)
        return value

    def get_or_make(self, key: K, make: Callable[[], V]) -> V:
        value = self.get(key)
        if value is not None:
            return value
        value = self.entries[key] = make()
        if len(self.entries) > self.size:
            self.entries.popitem(last=False)
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
    memo = probe.memo()  # the same probe object (or a copy of it) encoded before
    if (encoded := memo.get("encoded")) is None:
        weights = np.ascontiguousarray(probe.weights, dtype=np.float32).tobytes()
        bias = np.float64(probe.bias).tobytes()
        encoded = memo["encoded"] = _encoded.get_or_make(
            (probe.name, probe.layer, bias, weights), lambda: (probe.to_wire(), probe_digest(probe.weights, probe.bias))
        )
    return encoded


def steering_wire_digest(vec: SteeringVector) -> str:
    """What identifies a steering vector's wire form: its float32 activations (shape included),
    layers, positions, scale and norm matching."""
    memo = vec.memo()  # the same vector object (or a copy of it) digested before
    if (digest := memo.get("digest")) is None:
        digest = memo["digest"] = _steering_digest(vec)
    return digest


def _steering_digest(vec: SteeringVector) -> str:
    acts = np.ascontiguousarray(vec.array, dtype=np.float32)
    digest = hashlib.sha256(np.asarray(acts.shape, dtype=np.int64).tobytes() + acts.tobytes())
    digest.update(np.asarray(vec.layer_indices, dtype=np.int64).tobytes())
    if vec.position_indices is not None:
        digest.update(b"positions" + np.asarray(vec.position_indices, dtype=np.int64).tobytes())
    digest.update(np.float64(vec.scale).tobytes() + bytes([vec.norm_match]))
    return digest.hexdigest()


# digest -> wire dict, for vectors of at most CACHED_STEERING_BYTES (a vector per layer and
# position may be tens of MiB: those are encoded per request, as before)
_encoded_steering: LRU[str, dict[str, Any]] = LRU(32)
CACHED_STEERING_BYTES = 4 << 20


def encode_steering(vec: SteeringVector) -> tuple[dict[str, Any], str]:
    """(``vec.to_wire()``, its digest), the wire dict made once per distinct vector. The key is
    the vector's content, not the object: a vector changed in place is a new vector. The wire
    dict is shared by the requests that send the vector: it is only read."""
    digest = steering_wire_digest(vec)
    if vec.array.nbytes > CACHED_STEERING_BYTES:
        return vec.to_wire(), digest
    return _encoded_steering.get_or_make(digest, vec.to_wire), digest
