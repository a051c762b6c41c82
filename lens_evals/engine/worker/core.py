"""The worker's data path without a model: the request ledger, the step planner with its plan
cache, the step stores with their memory bound, and the fetch (``Fetch``). ``LensWorkerState`` (the model
runner's side) drives it around each forward pass; ``benchmarks.host_path`` and the tests
drive it directly."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any

import torch

from lens_evals import settings
from lens_evals.engine import compat
from lens_evals.engine.transport import handoff, timing
from lens_evals.engine.transport.protocol import FetchResult
from lens_evals.engine.worker import stream_write
from lens_evals.engine.worker.early_write import EarlyWrites
from lens_evals.engine.worker.hooks import HookCall, HookContext
from lens_evals.engine.worker.host_copy import host_copier
from lens_evals.engine.worker.ledger import RequestLedger
from lens_evals.engine.worker.plan import StepPlan
from lens_evals.engine.worker.planners import StepPlanner
from lens_evals.engine.worker.readout_store import ReadoutStore
from lens_evals.engine.worker.readout_store import assemble as assemble_readouts
from lens_evals.engine.worker.readouts import Head
from lens_evals.engine.worker.requests import WorkerLensRequest
from lens_evals.engine.worker.results import RowPart, TakenResult, write_results
from lens_evals.engine.worker.step_stores import StepStores
from lens_evals.engine.worker.stream_write import StreamWrites
from lens_evals.engine.worker.taps import StepContext
from lens_evals.wire import formats as wire

logger = logging.getLogger("lens_evals")


def _no_hook_context(call: HookCall, layer: int) -> HookContext:
    raise RuntimeError("hooks need a model runner (LensWorkerState)")


class Fetch:
    """Releasing fetched requests on the worker: the ledger forgets them, the stores give up
    their pieces, and each one's result comes back without its rows (``TakenResult``)."""

    def __init__(
        self,
        ledger: RequestLedger,
        stores: StepStores,
        capture_here: bool,
        local_layers: set[int],
        max_saved_chars: int,
        readouts: ReadoutStore | None = None,
    ) -> None:
        self.ledger = ledger
        self.stores = stores
        self.readouts = readouts if readouts is not None else ReadoutStore()
        self.capture_here = capture_here
        self.local_layers = local_layers
        self.max_saved_chars = max_saved_chars
        self.streams = StreamWrites(stores.captures)

    def take(self, key: str, hold: bool = False) -> TakenResult:
        """Release one request: its result without the rows, and where the rows are (the
        writing may happen on another thread: nothing here is touched by it; ``hold``: then
        their buffers stay until ``EarlyWrites.done_with``); with the block of its rows
        written while it ran, if any (``stream_write``)."""
        block = self.streams.take(key)
        taken = self._take(key, hold, block is not None)
        if block is not None:
            if "error" in taken.result:
                self.streams.discard_block(block)
            else:
                taken.stream = block
        return taken

    def _take(self, key: str, hold: bool, streamed: bool) -> TakenResult:
        captured, scored = self.stores.release(key, hold)
        read = self.readouts.release(key)
        held = (captured, scored) if hold else None
        req, error = self.ledger.take(key)
        if error is not None:
            return TakenResult({"error": error}, held=held)
        result: FetchResult = {}
        if req is not None and read:
            readouts, error = assemble_readouts(read, {r.index: r.layers for r in req.readouts})
            if error is not None:
                return TakenResult({"error": error}, held=held)
            result["readouts"] = readouts
        if req is not None and self.capture_here:
            try:
                if req.hooks:
                    result["saved"] = self._encode_saved(req.saved, "saved")
                if req.hook_set:
                    result["set_saved"] = self._encode_saved(req.set_saved, "hook set saved")
            except ValueError as exc:
                return TakenResult({"error": str(exc)}, held=held)
        parts: list[RowPart] = []
        for pieces, name, ids_name, ids in (
            (captured, "residual_stream", "layers", [layer for layer in (req.capture_layers if req else []) if layer in self.local_layers]),
            (
                scored,
                "probe_scores",
                "probe_index",
                [probe.index for probe in (req.probes if req else []) if probe.layer in self.local_layers],
            ),
        ):
            if pieces or (streamed and name == "residual_stream"):
                parts.append((name, ids_name, ids, pieces))
        return TakenResult(result, parts, held)

    def _encode_saved(self, saved: dict[str, Any], what: str) -> dict[str, Any]:
        encoded: dict[str, Any] = wire.encode_tree(saved, "saved")
        size = len(json.dumps(encoded))
        if size > self.max_saved_chars:
            raise ValueError(
                f"{what} is {size / 2**20:.1f} MiB encoded, over the per-request limit of "
                f"{self.max_saved_chars / 2**20:.1f} MiB (LENS_EVALS_MAX_SAVED_MIB)"
            )
        return encoded


class WorkerCore:
    def __init__(self, device: torch.device, dtype: torch.dtype, local_layers: set[int], capture_here: bool = True) -> None:
        """``capture_here``: False on ranks that do not keep captures (tensor-parallel rank > 0)."""
        self.device = device
        self.dtype = dtype
        self.capture_here = capture_here
        self.local_layers = local_layers
        self.ledger = RequestLedger()
        self.planner = StepPlanner(device, dtype, capture_here, local_layers)
        self.stores = StepStores(settings.MAX_HELD_CAPTURE_GIB.in_bytes(), host_copier(device))
        self.readouts = ReadoutStore(self.stores.copier)
        self.head: Head | None = None  # the model's final norm + logits (set by LensWorkerState), for lens readouts
        max_saved_chars = settings.MAX_SAVED_MIB.in_bytes()
        self.device_budget = settings.DEVICE_BUDGET_MIB.in_bytes()
        self.fetch = Fetch(self.ledger, self.stores, capture_here, local_layers, max_saved_chars, self.readouts)
        self.decode_runs = True  # a decode run's steps kept as one piece per request (``decode_runs``); off: one per step
        self.early = EarlyWrites(self.stores)
        self.streams = self.fetch.streams  # running requests' rows written as they come (``stream_write``)
        if settings.HANDOFF.get():  # else nothing is written while requests run: segments as long as they may be
            self.stores.capture_run.max_steps = stream_write.STREAM_STEPS

    @property
    def held_bytes(self) -> int:
        """Host bytes of rows not fetched yet: the step buffers, and rows written early as
        inline bytes (a frontend in this process whose pool had no room)."""
        return self.stores.held_bytes + self.early.inline_bytes + self.streams.inline_bytes + self.readouts.held_bytes

    def _over_bound(self) -> bool:
        return self.held_bytes > self.stores.max_held_bytes

    # ----------------------------------------------------------------- one step
    def plan_step(self, layout: compat.worker.BatchLayout, input_ids: torch.Tensor | None) -> StepPlan | None:
        """The step's plan (None: no lens request in it), reused from the last step when it can be."""
        requests = self.ledger.requests
        hooked = False
        rows_of_requests = zip(layout.req_ids, layout.num_rows, layout.start_positions) if self.ledger.hooked else ()
        for req_id, num_rows, first_position in rows_of_requests:  # a decode step without hooks: no loop over its requests
            req = requests.get(req_id)
            if req is not None and num_rows and (req.hooks or req.set_hooks):
                hooked = True
                self._fail_hooked(req, req.hook_rows(first_position, num_rows) or req.saved_over(self.fetch.max_saved_chars))
        if hooked:
            self._bound_saved_in_flight()
        return self.planner.plan(layout, self.ledger.requests, input_ids, set(self.ledger.errors))

    def _fail_hooked(self, req: WorkerLensRequest, error: str | None) -> None:
        if error is not None and not self.ledger.has_failed(req.key):
            self.ledger.fail_key(req.key, error)
            req.saved.clear()  # its device memory back now
            req.set_saved.clear()

    def _bound_saved_in_flight(self) -> None:
        """What the hooks of every request in flight hold stays within the lens device budget
        (``LENS_EVALS_DEVICE_BUDGET_MIB``): past it, the requests admitted last fail, oldest kept."""
        total = 0
        for req in list(self.ledger.requests.values()):
            if req is None or not (req.hooks or req.set_hooks) or self.ledger.has_failed(req.key):
                continue
            total += (held := req.saved_bytes())
            if total > self.device_budget:
                total -= held
                self._fail_hooked(
                    req,
                    f"the hooks of the requests in flight would hold {(total + held) / 2**20:.1f} MiB on the device, over the "
                    f"lens budget of {self.device_budget / 2**20:.1f} MiB (LENS_EVALS_DEVICE_BUDGET_MIB); this request's "
                    f"{held / 2**20:.1f} MiB were dropped: save less per request or send fewer such requests at once",
                )

    def begin_step(self, plan: StepPlan, hook_context: Callable[[HookCall, int], HookContext] = _no_hook_context) -> StepContext:
        """What the taps get for this step (see ``taps.StepContext``)."""
        return StepContext(plan, hook_context, self.ledger.fail_key, self.ledger.has_failed, head=self.head)

    def store_step(self, step: StepContext) -> None:
        """One device-to-host copy for the step's captures and one for its probe scores; each
        request keeps a Piece (where its rows are), nothing is cut per request here."""
        with timing.phase("store"):
            self.stores.store(
                step.plan,
                step.captures,
                step.scores,
                self.ledger.keeps,
                step.capture_block,
                self.ledger.version if self.decode_runs else -1,
            )
            if step.plan.readouts is not None:
                self.readouts.store(step.plan.readouts, step.readout_results, step.plan.start_positions, self.ledger.keeps)
            if step.plan.capture_slots and self.streams.due(self.stores.capture_run.closed):
                with timing.phase(timing.DETAIL + "stream rows"):
                    self._stream_rows()
            with timing.phase(timing.DETAIL + "memory bound"):
                self._enforce_memory_bound()

    def _stream_rows(self) -> None:
        """Write the final rows of the running requests whose lens request says where
        (``stream_write``): every piece but the open decode-run segment's."""
        ledger, open_segment = self.ledger, self.stores.capture_run.segment

        def final(pieces: list[Any]) -> list[Any]:
            return [piece for piece in pieces if piece.buffer is not open_segment]

        running = (
            (key, req.handoff, req.rows_at_most)
            for key, req in ledger.by_key.items()
            if req.handoff is not None and ledger.keeps(key) and key not in ledger.finished_unfetched
        )
        self.streams.write_round(running, final)

    def _enforce_memory_bound(self) -> None:
        """Over the bound: wait for the rows being written for the frontend first (they leave
        when written into its pool), then drop the oldest finished but unfetched captures, then
        fail the requests in flight; each of those gets an error naming the bound and the bytes."""
        self.early.reap()
        self.streams.reap()
        if not self._over_bound():
            return
        self.early.reap(wait_while=self._over_bound)
        self.streams.reap(wait_while=self._over_bound)
        message: str | None = None
        while self._over_bound() and (key := self.ledger.oldest_unfetched() or self.early.drop_oldest()) is not None:
            message = message or self._bound_message("its capture was dropped before it was fetched")
            logger.warning("lens_evals: dropping unfetched capture %s: %s", key, message)
            self._drop(key, message)
        if self.stores.over_bound():
            keys = list(self.stores.keys())
            self.ledger.fail_keys(keys, self._bound_message("it failed while running"))
            for key in keys:
                self.stores.release(key)
                self.streams.discard(key)

    def _bound_message(self, what: str) -> str:
        """Why a request lost its capture to the memory bound, and what to change."""
        bound = self.stores.max_held_bytes
        return (
            f"{what}: the worker held {self.held_bytes / 2**30:.3g} GiB of captured rows not yet fetched, over "
            f"{settings.MAX_HELD_CAPTURE_GIB.name} ({bound / 2**30:.3g} GiB = {bound} bytes); raise it in the engine's "
            "environment (default a quarter of the host's memory), or capture fewer layers or prompts per call"
        )

    # ----------------------------------------------------------------- finishing and fetching
    def finish(self, req_id: str) -> None:
        """vLLM finished the request: drop it if fetched already, else its rows are final: write
        them for the frontend now if its lens request says where (``early_write``), or keep them for the
        fetch."""
        req = self.ledger.requests.get(req_id)
        key = self.ledger.finish(req_id)
        if key is not None:
            self._drop(key)
        elif (
            req is not None
            and req.handoff is not None
            and any(req.key in held for held in (self.stores.captures.by_key, self.stores.scores.by_key, self.streams.blocks))
        ):
            sink = handoff.early_sink_for(req.handoff)
            if sink is not None:
                self.early.submit(req.key, self.fetch.take(req.key, hold=True), sink, req.handoff)

    def _drop(self, key: str, dropped: str | None = None) -> None:
        """Forget ``key`` (``dropped``: unfetched, and what its fetch will say)."""
        self.stores.release(key)
        self.streams.discard(key)
        self.readouts.release(key)
        self.ledger.forget(key, dropped)

    def take_result(self, key: str, target: dict[str, Any] | None = None) -> TakenResult:
        """Release one request (see ``Fetch.take``), or take what was written of it early for
        the frontend at ``target`` (``EarlyWrites.take``)."""
        early = self.early.take(key, target)
        if early is not None:
            return early
        taken = self.fetch.take(key)
        if taken.stream is not None:  # its block may stay in the pool of the frontend it was made for
            taken.keep_in_pool = target is not None and target.get("token") == taken.stream.token
        return taken

    def fetch_results(self, keys: list[str], target: dict[str, Any] | None = None) -> dict[str, FetchResult | None]:
        """A fetch: release the requests and write their rows (what was not written early) for
        the frontend at ``target`` (None: inline)."""
        sink = handoff.sink_for(target)
        with timing.phase("fetch: release"):
            taken = {key: self.take_result(key, target) for key in keys}
        try:
            with timing.phase("fetch: write rows"):
                return write_results(taken, sink)
        finally:
            for result in taken.values():
                self.early.done_with(result)
            self.early.reap()
            self.streams.reap()

    def pop_result(self, key: str, sink: handoff.Sink = handoff.inline) -> FetchResult | None:
        """Release one request and return its capture, probe scores and hook results (rows
        placed by absolute position, written by ``sink``; ``saved`` JSON-safe, arrays encoded)."""
        taken = self.take_result(key)
        try:
            return taken.write(sink)
        finally:
            self.early.done_with(taken)
            self.streams.reap()
