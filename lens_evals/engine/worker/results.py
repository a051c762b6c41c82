"""A fetch's results on the worker: each released request's result and where its rows are
(``TakenResult``, made by ``worker.core.Fetch``), then the rows written out (optionally on several
threads; a finished request's rows perhaps before the fetch, ``early_write``)."""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from lens_evals import settings
from lens_evals.engine.transport import handoff
from lens_evals.engine.transport.protocol import FetchResult
from lens_evals.engine.worker.host_store import Piece, gaps_error, row_blocks
from lens_evals.engine.worker.stream_write import StreamedRows

logger = logging.getLogger("lens_evals")
# (name, ids name, ids, pieces): one part of a result's rows, not yet written
RowPart = tuple[str, str, list[int], list[Piece]]


@dataclass
class TakenResult:
    """A released request's result and its row parts still to write. The rows are read out of
    the pieces only when written (``row_blocks``: on a CUDA host that waits for the step's copy),
    so the writing may happen on another thread. ``held``: pieces released with ``hold`` (their
    buffers are kept until ``PieceStore.unhold``)."""

    result: FetchResult
    parts: list[RowPart] = field(default_factory=list)
    held: tuple[list[Piece], list[Piece]] | None = None
    stream: StreamedRows | None = None  # the captures' block written while it ran (``stream_write``)
    keep_in_pool: bool = True  # the block may stay in the pool it is in (the fetch's frontend's)

    @property
    def nbytes(self) -> int:
        return sum(piece.nbytes for *_, pieces in self.parts for piece in pieces)

    def write(self, sink: handoff.Sink) -> FetchResult | None:
        self.write_some(sink)
        return self.result or None

    def write_some(self, sink: handoff.PartialSink) -> None:
        """Write the parts ``sink`` takes (returns where it put them; None: not here, the part
        stays for a later sink); a part with gaps turns the whole result into an error."""
        pending = []
        for part in self.parts:
            name, ids_name, ids, pieces = part
            if name == "residual_stream" and self.stream is not None:
                try:
                    packed = self.stream.close(pieces, self.keep_in_pool)
                except Exception as exc:  # noqa: BLE001 - this request's rows are lost, not the fetch's other requests'
                    logger.exception("lens_evals: closing the rows of %s written as it ran failed", self.stream.key)
                    packed = {"error": f"writing the rows failed: {type(exc).__name__}: {exc}"}
                self.stream = None
                if "error" in packed:
                    self.result, self.parts = {"error": packed["error"]}, []
                    return
                self.result[name] = packed  # type: ignore[literal-required]  # a ROW_PARTS name
                self.result[ids_name] = ids  # type: ignore[literal-required]
                continue
            rows = row_blocks(pieces)
            if rows.gaps:
                self.result, self.parts = {"error": gaps_error(name, rows.gaps)}, []
                return
            where = sink(rows)
            if where is None:
                pending.append(part)
                continue
            self.result[name] = rows.header | where  # type: ignore[literal-required]  # a ROW_PARTS name
            self.result[ids_name] = ids  # type: ignore[literal-required]
        self.parts = pending


_writers: dict[int, ThreadPoolExecutor] = {}
PARALLEL_WRITE_BYTES = 32 * 2**20
THREADS_ENV = settings.WRITE_THREADS.name


def writer_threads() -> int:
    """1 unless ``LENS_EVALS_WRITE_THREADS`` says more. Measured on the H200's host
    (``scripts/fetch_path_bench.py``, 258 MiB): into memory touched before (the pool's steady
    state) one thread writes in ~80 ms and 4-8 threads in 180-270 ms; only into fresh files do
    threads help (4-8 threads 57-84 ms, one 170-196 ms)."""
    return max(1, settings.WRITE_THREADS.get())


def write_results(taken: dict[str, TakenResult], sink: handoff.Sink, threads: int | None = None) -> dict[str, FetchResult | None]:
    """Write the fetched rows; a large fetch of several requests on ``threads`` threads (default
    ``writer_threads()``): the copies into hand-off files release the GIL."""
    threads = threads or writer_threads()
    if threads == 1 or len(taken) < 2 or sum(t.nbytes for t in taken.values()) < PARALLEL_WRITE_BYTES:
        return {key: t.write(sink) for key, t in taken.items()}
    pool = _writers.get(threads)
    if pool is None:
        pool = _writers[threads] = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="lens_evals-write")
    return dict(zip(taken, pool.map(lambda t: t.write(sink), taken.values())))
