"""Everything that crosses between the frontend (the process of ``LLM`` / ``AsyncLLM``) and the
workers, in one place: the ``collective_rpc`` method names, the lens request the frontend puts into a
request's ``extra_args``, the hand-off target a fetch sends, a fetch's results and the packed rows
inside them.

Only plain values cross (str, int, float, bool, None, lists, dicts, and bytes / bytearray for
rows), so vLLM's msgpack transport carries them as they are: nothing here is pickled by us. The
types are TypedDicts: at run time they are the same dicts as before, so no process sees a change.
"""

from __future__ import annotations

import mmap
from typing import Any, NotRequired, TypedDict

import numpy as np
import torch

# ----------------------------------------------------------------- collective_rpc methods
# (added to vLLM's worker class by ``compat.rpc.add_worker_methods``; the frontend calls them by name)
FETCH_METHOD = "lens_evals_fetch"  # (keys, HandoffTargetWire | None) -> FetchReply
MEMORY_METHOD = "lens_evals_memory"  # () -> MemoryReport
REGISTER_SET_METHOD = "lens_evals_register_hook_set"  # (set id, list[HookWire]) -> error text or None
CLEAR_SET_METHOD = "lens_evals_clear_hook_set"  # (set id,) -> whether the set was there
COPY_METHOD = "lens_evals_copy"  # (overlap: bool | None,) -> CopyReport (the bench's paired rounds, tests)
RELEASE_METHOD = "lens_evals_release"  # (HandoffTargetWire,) -> pool regions given back (an offline call's start)


# ----------------------------------------------------------------- request payloads
class HookWire(TypedDict):
    """One hook as the worker receives it (``hook_refs`` says what ``ref`` may be)."""

    ref: str  # registered:NAME, import:MODULE:QUALNAME or local:ID
    name: str
    layers: list[int]
    pre: bool
    module: str | None
    args: dict[str, Any]  # a ``wire`` tree: arrays encoded


class LensRequestWire(TypedDict):
    """``extra_args[spec.INTERNAL_KEY]``: a request's lens features, validated and normalised by
    the frontend, decoded once on the worker (``requests.decode_worker_request``)."""

    key: str  # the request's lens key (a UUID; vLLM may rewrite request ids)
    capture_layers: list[int]
    steering: list[dict[str, Any]]  # SteeringVector.to_wire()
    steering_digests: NotRequired[list[str]]  # each vector's digest (``probe_cache``): the worker decodes a vector once
    probes: list[dict[str, Any]]  # LinearProbe.to_wire()
    probe_digests: list[str]  # each probe's digest (``probe_cache``): the worker decodes a probe once
    hooks: list[HookWire]
    hook_set: str | None
    readouts: NotRequired[list[dict[str, Any]]]  # request/readouts.py wire dicts, layers resolved, weights inline or by digest
    # where the worker may write the request's rows as soon as it finishes, before the fetch
    # (``early_write``); absent: the hand-off is off, the rows are written at the fetch
    handoff: NotRequired[HandoffAddressWire]


class HandoffAddressWire(TypedDict):
    """The frontend's hand-off directory (``handoff``)."""

    dir: str
    token: str  # names the frontend's marker file, which proves the directory is shared
    pid: int


class HandoffTargetWire(HandoffAddressWire):
    """What a fetch tells the workers: the hand-off directory and the pool regions freed."""

    free: list[list[Any]]  # pool regions the frontend's tensors no longer use


# ----------------------------------------------------------------- fetch results
class PackedRowsWire(TypedDict):
    """A request's rows: dtype name and shape, then where the bytes are: ``data`` inline, or
    after the worker wrote them to shared memory ``pool`` + ``offset`` or ``file``, with
    ``nbytes`` (``handoff.claim`` turns those into ``data`` on the frontend)."""

    dtype: str
    shape: list[int]
    data: NotRequired[Any]  # bytearray / bytes inline; a mapping or ndarray once claimed
    pool: NotRequired[str]
    offset: NotRequired[int]
    file: NotRequired[str]
    nbytes: NotRequired[int]


class FetchResult(TypedDict, total=False):
    """One request's result from one worker: ``error``, or any of its hook results (encoded
    ``wire`` trees, per hook index), its captured rows (``residual_stream``, shape
    ``(n_layers, n_positions, hidden)``, layer ids in ``layers``) and probe scores
    (``probe_scores``, ``(n_probes, n_positions)``, probe indices in ``probe_index``)."""

    error: str
    saved: dict[str, Any]
    set_saved: dict[str, Any]
    residual_stream: PackedRowsWire
    layers: list[int]
    probe_scores: PackedRowsWire
    probe_index: list[int]
    readouts: dict[str, ReadoutWire]  # readout index in the request -> its results (worker/readout_store.py)


class ReadoutWire(TypedDict):
    """One readout's results: float32 rows ``(n_layers, n_positions, 2 * top_k)``, each row the
    top-k ids (as float32, exact below 2**24) then their values; always inline (small)."""

    layers: list[int]
    rows: PackedRowsWire


FetchReply = dict[str, FetchResult]  # one worker's results by lens key (requests it holds nothing of are absent)
ROW_PARTS = (("residual_stream", "layers"), ("probe_scores", "probe_index"))  # (rows, their ids) in a FetchResult


class MemoryReport(TypedDict):
    held_bytes: int
    requests: int  # requests with rows held
    tracked: int  # vLLM requests the worker follows
    early_written: int  # requests whose rows were written before their fetch (``early_write``), so far
    early_unfetched: int  # ... of them not fetched yet
    streamed_writes: int  # writes of running requests' rows (``stream_write``), so far
    pool_bytes: int  # the hand-off pool segments this worker holds (``handoff_pool``), all frontends
    pool_allocated_bytes: int  # the pages their files hold (idle pools give free regions' back)


class CopyReport(TypedDict):
    """The worker's device-to-host copies of step rows (``host_copy``), after the call set the
    mode: ``overlap`` whether they go on a side stream now (False on CPU), ``copies`` made so far,
    ``overlapped`` of them on the side stream, and the pinned bytes of the captures' arena."""

    overlap: bool
    copies: int
    overlapped: int
    pinned_bytes: int
    spare_bytes: int


class PackedRows:
    """The codec of ``PackedRowsWire``: the worker writes ``header`` and the bytes, the frontend
    ``decode``s them into a tensor. Writable, so the frontend's tensor shares the buffer
    without a copy (bytes from msgpack are copied once)."""

    DTYPES = {"float32": (np.float32, torch.float32), "float16": (np.float16, torch.float16), "bfloat16": (np.int16, torch.bfloat16)}

    @staticmethod
    def header(dtype: torch.dtype, shape: tuple[int, ...]) -> PackedRowsWire:
        return {"dtype": str(dtype).removeprefix("torch."), "shape": list(shape)}

    @classmethod
    def decode(cls, packed: PackedRowsWire | dict[str, Any]) -> torch.Tensor:
        if packed.get("dtype") not in cls.DTYPES:
            raise ValueError(f"unexpected row dtype {packed.get('dtype')!r}")
        numpy_dtype, torch_dtype = cls.DTYPES[packed["dtype"]]
        shape = [int(n) for n in packed["shape"]]
        data = packed.get("data")
        if (
            not isinstance(data, (bytearray, bytes, mmap.mmap, np.ndarray))
            or len(data) != int(np.prod(shape)) * np.dtype(numpy_dtype).itemsize
        ):
            raise ValueError("row data does not match its shape")
        # bytes (from msgpack) are read-only: one copy makes the tensor writable; a bytearray or
        # a claimed hand-off mapping or pool region (``handoff.claim``) is used as it is
        array = np.frombuffer(bytearray(data) if isinstance(data, bytes) else data, dtype=numpy_dtype).reshape(shape)
        tensor = torch.from_numpy(array)
        return tensor.view(torch_dtype) if torch_dtype == torch.bfloat16 else tensor
