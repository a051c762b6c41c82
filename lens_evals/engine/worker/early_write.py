"""A finished request's rows written for the frontend while the engine still runs.

Without this, every request's rows wait in the step buffers until the frontend fetches them, and
the fetch writes them all (for a prefill batch of 1,000 captured prompts, 1.4 GB into the shared
pool after the last step, ~0.45 s on the H200's host, overlapped with nothing). Yet a request's
rows are final as soon as vLLM finishes it (``WorkerCore.finish``, at the next step's start). So
then the worker releases it as a fetch would (``Fetch.take``, its pieces held: their buffers and
pinned memory are not reused while they are read) and writes its rows on one writer thread into
the place its lens request names (``handoff.early_sink_for``: the frontend's pool; for a frontend in
the worker's process, inline bytes where the pool has no room) while the next steps run. The fetch then waits for that write
(normally long done) and replies with the regions already written; anything the early sink did
not take (a small block, a full pool, a frontend that does not share the directory) is written by
the fetch's sink as before. A fetch that wants the rows elsewhere than they were written (an
abort's fetch sends no target) gets them inline and the pool region is free again
(``handoff.recall``); an entry dropped for the memory bound frees its region the same way.

Entries are touched on the worker's main thread only; the writer thread touches only the
``TakenResult`` it was given, handed over through its future.
"""

from __future__ import annotations

import logging
from collections import OrderedDict, deque
from collections.abc import Callable
from concurrent.futures import Future, wait
from dataclasses import dataclass
from typing import Any, cast

from lens_evals.engine.transport import handoff, timing
from lens_evals.engine.transport.protocol import PackedRowsWire
from lens_evals.engine.worker.results import TakenResult
from lens_evals.engine.worker.step_stores import StepStores
from lens_evals.engine.worker.stream_write import writer

logger = logging.getLogger("lens_evals")


@dataclass
class _Entry:
    taken: TakenResult  # its ``held`` pieces: until the rows are written (``done_with``)
    address: dict[str, Any]  # the frontend's ``HandoffAddressWire`` the rows were written for
    done: Future[None]
    inline_bytes: int = 0  # rows written inline (a frontend in this process), once reaped
    gone: bool = False  # taken by a fetch or dropped


def _inline_bytes(result: Any) -> int:
    return sum(
        len(packed["data"])
        for name in ("residual_stream", "probe_scores")
        if isinstance(packed := result.get(name), dict) and "data" in packed
    )


class EarlyWrites:
    """The worker's early writes by request key, oldest first."""

    def __init__(self, stores: StepStores) -> None:
        self.stores = stores
        self.entries: OrderedDict[str, _Entry] = OrderedDict()
        self._writing: deque[_Entry] = deque()  # submitted, not reaped yet (written in this order)
        self.written = 0  # requests whose rows were all written early (counted on the writer thread only)
        self.inline_bytes = 0  # rows written early as inline bytes and not fetched yet (reaped entries)

    def submit(self, key: str, taken: TakenResult, sink: handoff.PartialSink, address: dict[str, Any]) -> None:
        """Write ``taken`` (released with its pieces held) on the writer thread."""
        entry = self.entries[key] = _Entry(taken, address, writer().submit(self._write, taken, sink))
        self._writing.append(entry)

    def _write(self, taken: TakenResult, sink: handoff.PartialSink) -> None:
        with timing.phase("early: write rows"):
            taken.write_some(sink)
        if not taken.parts:
            self.written += 1

    def reap(self, wait_while: Callable[[], bool] | None = None) -> None:
        """Give back the pieces of the entries written since the last reap whose rows are all
        written (worker's main thread; what is left of the others is written by the fetch).
        ``wait_while``: while it holds (the memory bound is exceeded), wait for the writes still
        running rather than stop at the first: rows on their way to the frontend's pool are not
        worth dropping (issue #47: a writer behind the steps had every request after the 347th
        of an 11 GB capture dropped at an 8 GiB bound)."""
        while self._writing:
            entry = self._writing[0]
            if not entry.done.done():
                if wait_while is None or not wait_while():
                    return
                with timing.phase("early: wait for the writer (memory bound)"):
                    wait([entry.done])
            self._writing.popleft()
            if entry.gone:
                continue
            if entry.done.exception() is not None or not entry.taken.parts:
                self.done_with(entry.taken)
            entry.inline_bytes = _inline_bytes(entry.taken.result)
            self.inline_bytes += entry.inline_bytes

    def done_with(self, taken: TakenResult) -> None:
        """Nothing reads ``taken``'s held pieces any more: their buffers may be freed."""
        if taken.held is not None:
            captured, scored = taken.held
            self.stores.captures.unhold(captured)
            self.stores.scores.unhold(scored)
            taken.held = None

    def take(self, key: str, target: dict[str, Any] | None) -> TakenResult | None:
        """A fetch of ``key``: its result as written so far (the fetch writes the rest, then
        calls ``done_with``), None if it was not written early. Rows in the pool of another
        frontend than ``target``'s come back inline."""
        entry = self.entries.pop(key, None)
        if entry is None:
            return None
        self._forget(entry)
        with timing.phase("fetch: wait for early writes"):
            error = entry.done.exception()
        taken = entry.taken
        if error is not None:
            logger.warning("lens_evals: writing the rows of %s early failed (%s: %s)", key, type(error).__name__, error)
            self.done_with(taken)
            return TakenResult({"error": f"writing the rows failed: {type(error).__name__}: {error}"})
        if not target or target.get("token") != entry.address.get("token"):
            self._recall(entry)
        if not taken.parts:
            self.done_with(taken)
        return taken

    def _forget(self, entry: _Entry) -> None:
        entry.gone = True
        self.inline_bytes -= entry.inline_bytes

    def _recall(self, entry: _Entry, keep: bool = True) -> None:
        """Rows of ``entry`` in the frontend's pool back inline (``keep=False``: freed unread)."""
        result = entry.taken.result
        for name in ("residual_stream", "probe_scores"):
            packed = result.get(name)
            if isinstance(packed, dict):
                result[name] = cast(PackedRowsWire, handoff.recall(packed, entry.address, keep))

    def drop_oldest(self) -> str | None:
        """For the memory bound: forget the oldest entry that still holds rows here, in its
        pieces or as inline bytes (its pool regions free again); its key, or None when none does."""
        for key, entry in self.entries.items():
            if entry.taken.held is not None or entry.inline_bytes:
                del self.entries[key]
                self._forget(entry)
                entry.done.exception()  # wait: the writer may be reading its rows
                self._recall(entry, keep=False)  # dropped: reading the pooled rows back would only add memory
                self.done_with(entry.taken)
                return key
        return None

    def __len__(self) -> int:
        return len(self.entries)
