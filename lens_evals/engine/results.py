"""A fetch's results on the worker: each released request's result and where its rows are
(``TakenResult``, made by ``worker_core.Fetch``), then the rows written out (optionally on several
threads)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from lens_evals import settings
from lens_evals.engine import handoff
from lens_evals.engine.host_store import RowBlocks
from lens_evals.engine.protocol import FetchResult


@dataclass
class TakenResult:
    """A released request's result and its row parts (name, ids name, ids, rows) to write."""

    result: FetchResult
    parts: list[tuple[str, str, list[int], RowBlocks]] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return sum(rows.nbytes for *_, rows in self.parts)

    def write(self, sink: handoff.Sink) -> FetchResult | None:
        for name, ids_name, ids, rows in self.parts:
            self.result[name] = rows.write(sink)  # type: ignore[literal-required]  # a ROW_PARTS name
            self.result[ids_name] = ids  # type: ignore[literal-required]
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
