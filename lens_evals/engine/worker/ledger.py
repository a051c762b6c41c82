"""The worker's request ledger: which vLLM request is which lens request, which failed (and why),
which finished before the frontend fetched it (oldest first, for the memory bound) and which were
fetched before vLLM finished them. Bookkeeping only: rows live in the step stores."""

from __future__ import annotations

import time
from collections import OrderedDict

from lens_evals.engine.worker.requests import WorkerLensRequest

MAX_DROPPED = 65536  # dropped keys whose error a later fetch still gets (one message string per drop)


class RequestLedger:
    def __init__(self) -> None:
        self.requests: dict[str, WorkerLensRequest | None] = {}  # vLLM request id -> decoded (None: plain or failed)
        self.req_keys: dict[str, str] = {}  # vLLM request id -> lens key, for lens requests
        self.by_key: dict[str, WorkerLensRequest] = {}
        self.errors: dict[str, str] = {}  # lens key -> the first error
        self.fetched: set[str] = set()  # fetched before vLLM finished them
        self.finished_unfetched: OrderedDict[str, float] = OrderedDict()  # key -> when it finished
        self.dropped: OrderedDict[str, str] = OrderedDict()  # key -> why its rows were dropped unfetched
        self.hooked: set[str] = set()  # vLLM request ids with generic hooks (a step checks their bounds)
        self.version = 0  # changes whenever ``keeps`` may answer otherwise (a failure, a fetch)

    def known(self, req_id: str) -> bool:
        return req_id in self.requests

    @property
    def any_lens_request(self) -> bool:
        return bool(self.req_keys)

    def track(self, req_id: str, req: WorkerLensRequest | None, failed_key: str | None = None) -> None:
        """Follow a (decoded) request from now on; None: a plain request, or a lens request
        that already failed (``failed_key``: its key, so its error is released with it)."""
        self.requests[req_id] = req
        if req is not None:
            self.req_keys[req_id] = req.key
            self.by_key[req.key] = req
            if req.hooks or req.set_hooks:
                self.hooked.add(req_id)
        elif failed_key is not None:
            self.req_keys[req_id] = failed_key

    def refuse(self, req_id: str, key: str, message: str) -> None:
        """A lens request that fails before it runs (not decodable, or refused by this worker)."""
        self.errors[key] = message
        self.version += 1
        self.track(req_id, None, key)

    def fail_key(self, key: str, message: str) -> None:
        self.errors.setdefault(key, message)
        self.version += 1

    def fail_keys(self, keys: list[str], message: str) -> None:
        for key in keys:
            self.fail_key(key, message)

    def has_failed(self, key: str) -> bool:
        return key in self.errors

    def keeps(self, key: str) -> bool:
        """Whether a step's rows of ``key`` are still wanted (not fetched, not failed)."""
        return key not in self.fetched and key not in self.errors

    def finish(self, req_id: str) -> str | None:
        """vLLM finished the request: its key when it was fetched already (drop it now), else
        None (a lens request's rows wait for the fetch)."""
        self.requests.pop(req_id, None)
        self.hooked.discard(req_id)
        key = self.req_keys.pop(req_id, None)
        if key is None:
            return None
        if key in self.fetched:
            self.fetched.discard(key)
            return key
        self.finished_unfetched[key] = time.monotonic()
        return None

    def forget(self, key: str, dropped: str | None = None) -> None:
        """Forget ``key``; ``dropped``: its rows were dropped before it was fetched, and this is
        what its fetch says (the last :data:`MAX_DROPPED` such keys are remembered)."""
        self.by_key.pop(key, None)
        self.errors.pop(key, None)
        if dropped is not None:
            self.dropped[key] = dropped
            if len(self.dropped) > MAX_DROPPED:
                self.dropped.popitem(last=False)

    def oldest_unfetched(self) -> str | None:
        """The key that finished longest ago and was not fetched, taken off the ledger's queue."""
        if not self.finished_unfetched:
            return None
        return self.finished_unfetched.popitem(last=False)[0]

    def take(self, key: str) -> tuple[WorkerLensRequest | None, str | None]:
        """A fetch of ``key``: its request (None if unknown here) and its error; a request still
        running is remembered as fetched (its later rows are not kept)."""
        self.version += 1
        dropped = self.dropped.pop(key, None)
        if dropped is not None:
            return None, dropped
        error = self.errors.get(key)
        req = self.by_key.pop(key, None)
        if key in self.finished_unfetched:
            self.finished_unfetched.pop(key)
            self.errors.pop(key, None)
        else:
            self.fetched.add(key)
        return req, error
