"""A fetch's results on the worker: each released request's result and where its rows are
(``Fetch.take`` -> ``TakenResult``), then the rows written out (optionally on several threads)."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from lens_evals import settings, wire
from lens_evals.engine import handoff
from lens_evals.engine.ledger import RequestLedger
from lens_evals.engine.step_stores import StepStores
from lens_evals.engine.store import RowBlocks, row_blocks


@dataclass
class TakenResult:
    """A released request's result and its row parts (name, ids name, ids, rows) to write."""

    result: dict[str, Any]
    parts: list[tuple[str, str, list[int], RowBlocks]] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return sum(rows.nbytes for *_, rows in self.parts)

    def write(self, sink: handoff.Sink) -> dict[str, Any] | None:
        for name, ids_name, ids, rows in self.parts:
            self.result[name] = rows.write(sink)
            self.result[ids_name] = ids
        return self.result or None


_writers: dict[int, ThreadPoolExecutor] = {}
PARALLEL_WRITE_BYTES = 32 * 2**20
THREADS_ENV = settings.WRITE_THREADS.name


def writer_threads() -> int:
    """1 unless ``LENS_EVALS_WRITE_THREADS`` says more. Measured on the H200's host
    (``scripts/fetch_path_bench.py``, 258 MiB): into memory touched before (the pool's steady
    state) one thread writes in ~80 ms and 4-8 threads in 180-270 ms; only into fresh files do
    threads help (4-8 threads 57-84 ms, one 170-196 ms)."""
    return max(1, settings.WRITE_THREADS.get())


def write_results(taken: dict[str, TakenResult], sink: handoff.Sink, threads: int | None = None) -> dict[str, dict[str, Any] | None]:
    """Write the fetched rows; a large fetch of several requests on ``threads`` threads (default
    ``writer_threads()``): the copies into hand-off files release the GIL."""
    threads = threads or writer_threads()
    if threads == 1 or len(taken) < 2 or sum(t.nbytes for t in taken.values()) < PARALLEL_WRITE_BYTES:
        return {key: t.write(sink) for key, t in taken.items()}
    pool = _writers.get(threads)
    if pool is None:
        pool = _writers[threads] = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="lens_evals-write")
    return dict(zip(taken, pool.map(lambda t: t.write(sink), taken.values())))


class Fetch:
    """Releasing fetched requests on the worker: the ledger forgets them, the stores give up
    their pieces, and each one's result comes back without its rows (``TakenResult``)."""

    def __init__(self, ledger: RequestLedger, stores: StepStores, capture_here: bool, local_layers: set[int],
                 max_saved_chars: int) -> None:
        self.ledger = ledger
        self.stores = stores
        self.capture_here = capture_here
        self.local_layers = local_layers
        self.max_saved_chars = max_saved_chars

    def take(self, key: str) -> TakenResult:
        """Release one request: its result without the rows, and where the rows are (the
        writing may happen on another thread: nothing here is touched by it)."""
        captured, scored = self.stores.release(key)
        req, error = self.ledger.take(key)
        if error is not None:
            return TakenResult({"error": error})
        result: dict[str, Any] = {}
        if req is not None and self.capture_here:
            try:
                if req.hooks:
                    result["saved"] = self._encode_saved(req.saved, "saved")
                if req.hook_set:
                    result["set_saved"] = self._encode_saved(req.set_saved, "hook set saved")
            except ValueError as exc:
                return TakenResult({"error": str(exc)})
        parts = []
        for pieces, name, ids_name, ids in (
            (captured, "residual_stream", "layers", [layer for layer in (req.capture_layers if req else []) if layer in self.local_layers]),
            (scored, "probe_scores", "probe_index", [probe.index for probe in (req.probes if req else []) if probe.layer in self.local_layers]),
        ):
            if not pieces:
                continue
            rows = row_blocks(pieces)
            if rows.gaps:
                return TakenResult({"error": f"{name} has gaps at positions {rows.gaps} (prefix cache or scheduling defect)"})
            parts.append((name, ids_name, ids, rows))
        return TakenResult(result, parts)

    def _encode_saved(self, saved: dict[str, Any], what: str) -> dict[str, Any]:
        encoded = wire.encode_tree(saved, "saved")
        size = len(json.dumps(encoded))
        if size > self.max_saved_chars:
            raise ValueError(
                f"{what} is {size / 2**20:.1f} MiB encoded, over the per-request limit of "
                f"{self.max_saved_chars / 2**20:.1f} MiB (LENS_EVALS_MAX_SAVED_MIB)"
            )
        return encoded
