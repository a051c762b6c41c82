"""A request's lens features as the worker holds them: decoded once, tensors on the device."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from lens_evals.engine.transport.probe_cache import CACHED_STEERING_BYTES, LRU, probe_digest
from lens_evals.engine.transport.protocol import LensRequestWire
from lens_evals.engine.worker.hooks import WorkerHook, decode_hooks
from lens_evals.engine.worker.readouts import WorkerReadout, decode_readouts
from lens_evals.engine.worker.transfer import to_device
from lens_evals.request.spec import INTERNAL_KEY, LinearProbe, SteeringVector
from lens_evals.wire import formats as wire


@dataclass(frozen=True)
class WorkerSteering:
    """One steering vector: per layer a (n_vectors, hidden) device tensor, where n_vectors is 1
    (every position) or one row per entry of ``positions`` (sorted). ``digest`` names the
    vectors' content (:func:`steering_digest`), so the step planner sees that requests share a
    vector without comparing device tensors (a comparison on a GPU waits for the device).
    Only read once made: the requests that send the same vector share one."""

    vectors: dict[int, torch.Tensor]
    positions: np.ndarray | None
    scale: float
    norm_match: bool
    digest: str | None = None


@dataclass(frozen=True)
class WorkerProbe:
    """One linear probe of a request. ``index`` is its place in the request's probe list;
    ``digest`` identifies equal probes across requests, so a step stacks each distinct probe once."""

    index: int
    layer: int
    digest: str
    weights: torch.Tensor  # (hidden,) float32 on the device
    bias: float


@dataclass
class WorkerLensRequest:
    key: str
    capture_layers: list[int]
    steering: list[WorkerSteering] = field(default_factory=list)
    probes: list[WorkerProbe] = field(default_factory=list)
    hooks: list[WorkerHook] = field(default_factory=list)
    saved: dict[str, Any] = field(default_factory=dict)  # hook index -> that hook's ctx.saved
    hook_set: str | None = None  # a persistent hook set the request opted into
    set_hooks: list[WorkerHook] = field(default_factory=list)
    set_saved: dict[str, Any] = field(default_factory=dict)  # the same for the set's hooks
    handoff: dict[str, Any] | None = None  # the frontend's ``HandoffAddressWire`` (``early_write``)
    hooked_until: int = 0  # one past the last position the hooks have run on
    readouts: list[WorkerReadout] = field(default_factory=list)
    rows_at_most: int | None = None  # its positions at most (prompt + max_tokens): a streamed block's room at most (``stream_write``)

    def hook_rows(self, first_position: int, num_rows: int) -> str | None:
        """Note the positions the hooks run on this step. A step at positions already seen is a
        recompute after preemption: from position 0 the hooks start over with empty ``saved``
        dicts (as the request run alone); from a later position (its own prefix KV read back)
        the hooks would see those positions twice, so the error text is returned."""
        if first_position < self.hooked_until:
            if first_position > 0:
                return (
                    f"recomputed from position {first_position} after preemption, below {self.hooked_until}: "
                    "its hooks would see those positions twice"
                )
            self.saved.clear()
            self.set_saved.clear()
        self.hooked_until = first_position + num_rows
        return None

    def saved_bytes(self) -> int:
        """Bytes of the arrays its hooks hold (``saved`` and a hook set's)."""
        return wire.array_bytes(self.saved) + wire.array_bytes(self.set_saved)

    def saved_over(self, limit: int) -> str | None:
        """The error text when the arrays the hooks hold already pass ``limit`` (bytes): their
        encoded form (base64, 4/3 of the bytes or more) would pass LENS_EVALS_MAX_SAVED_MIB at
        the fetch, so the request fails now instead of filling the device until it ends."""
        for what, saved in (("saved", self.saved), ("hook set saved", self.set_saved)):
            if (held := wire.array_bytes(saved)) > limit:
                return (
                    f"{what} holds {held / 2**20:.1f} MiB of arrays, over the per-request limit of "
                    f"{limit / 2**20:.1f} MiB (LENS_EVALS_MAX_SAVED_MIB)"
                )
        return None


def decode_worker_request(
    extra_args: Mapping[str, Any] | None, device: torch.device, dtype: torch.dtype, hook_sets: Mapping[str, list[WorkerHook]]
) -> WorkerLensRequest | None:
    """The frontend put a normalised, validated spec under INTERNAL_KEY; None for plain requests."""
    if not extra_args or INTERNAL_KEY not in extra_args:
        return None
    spec: LensRequestWire = extra_args[INTERNAL_KEY]
    vectors = spec.get("steering", [])
    sent_steering = spec.get("steering_digests")
    if sent_steering is not None and len(sent_steering) != len(vectors):
        raise ValueError(f"{len(vectors)} steering vectors but {len(sent_steering)} steering digests")
    steering = [_steering(item, sent_steering[n] if sent_steering else None, device, dtype) for n, item in enumerate(vectors)]
    items = spec.get("probes", [])
    sent = spec.get("probe_digests")
    digests: list[str | None] = list(sent) if sent else [None] * len(items)
    if len(digests) != len(items):
        raise ValueError(f"{len(items)} probes but {len(digests)} probe digests")
    probes = [_decode_probe(i, item, digest, device) for i, (item, digest) in enumerate(zip(items, digests))]
    hook_set = spec.get("hook_set")
    if hook_set is not None and hook_set not in hook_sets:
        raise ValueError(f"hook set {hook_set!r} is not registered on the worker (cleared?)")
    return WorkerLensRequest(
        key=str(spec["key"]),
        capture_layers=list(spec.get("capture_layers", [])),
        steering=steering,
        probes=probes,
        hooks=decode_hooks(spec.get("hooks", []), device),
        hook_set=hook_set,
        set_hooks=list(hook_sets.get(hook_set, [])) if hook_set else [],
        handoff=dict(spec["handoff"]) if spec.get("handoff") else None,
        readouts=decode_readouts(spec.get("readouts", []), device),
    )


_device_probes: LRU[tuple[str, str], tuple[torch.Tensor, float]] = LRU()  # (digest, device) -> weights, bias


def _decode_probe(index: int, item: dict[str, Any], digest: str | None, device: torch.device) -> WorkerProbe:
    """A probe of the request, its weights on the device decoded once per digest (the frontend's;
    computed here when a spec comes without it)."""
    parsed = LinearProbe.from_wire(item) if digest is None else None
    if parsed is not None:
        digest = probe_digest(parsed.weights, parsed.bias)
    assert digest is not None

    def decode() -> tuple[torch.Tensor, float]:
        probe = parsed if parsed is not None else LinearProbe.from_wire(item)
        return to_device(np.ascontiguousarray(probe.weights, dtype=np.float32), device), float(probe.bias)

    weights, bias = _device_probes.get_or_make((digest, str(device)), decode)
    return WorkerProbe(index=index, layer=int(item["layer"]), digest=digest, weights=weights, bias=bias)


def steering_digest(acts: np.ndarray, layers: list[int], positions: np.ndarray | None, norm_match: bool) -> str:
    """What identifies a steering vector's additions (its scale aside): the float32 vectors per
    layer, the layers, the positions and norm matching."""
    digest = hashlib.sha256(np.ascontiguousarray(acts, dtype=np.float32).tobytes())
    digest.update(np.asarray(layers, dtype=np.int64).tobytes() + bytes([norm_match]))
    if positions is not None:
        digest.update(b"positions" + np.asarray(positions, dtype=np.int64).tobytes())
    return digest.hexdigest()


# (digest, device, dtype) -> vectors. Kept: small vectors only (a vector per position and layer
# can be tens of MiB), at most 32 of them: <= 128 MiB of device memory besides the requests' own.
_device_steering: LRU[tuple[str, str, str], torch.Tensor] = LRU(32)


# the frontend's steering digest (``probe_cache.steering_wire_digest``), device, dtype -> the
# decoded vector; small vectors only, as ``_device_steering`` (whose tensors these share)
_worker_steering: LRU[tuple[str, str, str], WorkerSteering] = LRU(32)


def _steering(item: Any, sent: str | None, device: torch.device, dtype: torch.dtype) -> WorkerSteering:
    """A steering vector of the request, decoded once per digest the frontend sent with it (its
    wire form parsed and checked, its digest and device tensor made), else decoded here."""
    if sent is None:
        return _decode_steering(SteeringVector.from_wire(item), device, dtype)
    key = (sent, str(device), str(dtype))
    cached = _worker_steering.get(key)
    if cached is not None:
        return cached
    decoded = _decode_steering(SteeringVector.from_wire(item), device, dtype)
    if _kept(sum(table.numel() for table in decoded.vectors.values())):
        _worker_steering.get_or_make(key, lambda: decoded)
    return decoded


def _kept(elements: int) -> bool:
    """Whether a steering vector of ``elements`` float32 values is small enough to keep on the device."""
    return elements * 4 <= CACHED_STEERING_BYTES


def _decode_steering(vec: SteeringVector, device: torch.device, dtype: torch.dtype) -> WorkerSteering:
    """A steering vector of the request, on the device once per content (an eval sends the same
    vector with every request: they then share one tensor)."""
    acts = vec.per_position()  # (n_layers, n_pos or 1, hidden)
    positions = None
    if vec.position_indices is not None:
        if vec.array.ndim == 2:  # one vector per layer, added at each of the given positions
            acts = np.repeat(acts, len(vec.position_indices), axis=1)
        order = np.argsort(vec.position_indices)
        positions = np.asarray(vec.position_indices, dtype=np.int64)[order]
        acts = acts[:, order, :]
    digest = steering_digest(acts, list(vec.layer_indices), positions, vec.norm_match)

    def decode() -> torch.Tensor:
        array = np.asarray(acts, dtype=np.float32)
        if vec.norm_match:  # in float64: float32 squares overflow past ~1e19 and underflow below ~1e-19
            wide = array.astype(np.float64)
            array = (wide / np.linalg.norm(wide, axis=-1, keepdims=True)).astype(np.float32)
        return to_device(array, device).to(dtype)

    tensor = _device_steering.get_or_make((digest, str(device), str(dtype)), decode) if _kept(acts.size) else decode()
    vectors = {layer: tensor[i] for i, layer in enumerate(vec.layer_indices)}
    return WorkerSteering(vectors=vectors, positions=positions, scale=float(vec.scale), norm_match=vec.norm_match, digest=digest)
