"""What the frontend remembers of an admitted lens request until its results are fetched
(``PendingLensRequest``), the engine's set of them (``PendingLensRequests``, in the frontend state), and
the served ``AsyncLLM.generate`` call a request's key is bound to (``ServedCall``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from lens_evals.engine.frontend import budget as frontend_budget
from lens_evals.wire import formats as wire


@dataclass(frozen=True)
class PendingLensRequest:
    key: str
    capture_layers: tuple[int, ...]
    probe_names: tuple[str, ...]
    prompt_len: int
    has_hooks: bool = False
    hook_set: str | None = None
    local_ids: tuple[str, ...] = ()
    encoding: str = wire.DEFAULT_RESPONSE_ENCODING
    charge: frontend_budget.Charge | None = None  # on the device budget while it runs
    readouts: tuple[tuple[str, str, tuple[int, ...]], ...] = ()  # (name, kind, layers) per readout, in request order


@dataclass
class PendingLensRequests:
    """The lens requests of one input processor between admission and their fetch."""

    by_key: dict[str, PendingLensRequest] = field(default_factory=dict)
    offline: dict[str, str] = field(default_factory=dict)  # client request id -> lens key (LLM's own ids)
    budget: frontend_budget.Ledger | None = None  # made at the first lens request (it needs the engine's facts)

    def __len__(self) -> int:
        return len(self.by_key)

    def admit(self, pending: PendingLensRequest) -> None:
        self.by_key[pending.key] = pending

    def take(self, key: str | None) -> PendingLensRequest | None:
        pending = None if key is None else self.by_key.pop(key, None)
        if pending is not None and pending.charge is not None and self.budget is not None:
            self.budget.release(pending.charge)
        return pending

    def take_offline(self, request_id: str) -> PendingLensRequest | None:
        return self.take(self.offline.pop(request_id, None))


@dataclass
class ServedCall:
    """One ``AsyncLLM.generate`` call: the client's request id it was given and, once vLLM
    assigned the engine's id to the request it added, that request's lens key."""

    request_id: str
    key: str | None = None

    def take(self, registry: PendingLensRequests) -> PendingLensRequest | None:
        if self.key is None:  # added as a prebuilt request under another id: bound by client id
            return registry.take_offline(self.request_id)
        return registry.take(self.key)
