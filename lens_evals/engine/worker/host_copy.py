"""The worker's device-to-host copy of each step's captures and probe scores, and the pinned host
memory it goes into. The copy is chosen once per worker, by its device (``host_copier``):

* CPU: no copy. The step's tensor is already a tensor of its own in host memory (the taps'
  gather made it), so the store keeps it as it is (``PlainCopy``).
* CUDA, overlapped (``LENS_EVALS_COPY_OVERLAP=1``, the default; ``StreamCopy``): the copy is
  queued on a side stream that first waits for what the compute stream has queued so far (the
  gathers that made the tensor); the compute stream goes straight on to the next step's kernels
  while the copy runs. The source tensor is marked as used by the side stream
  (``record_stream``), so the caching allocator gives its memory to later kernels only once the
  copy has read it. The host rows are read only after the copy's event (recorded on the side
  stream) has completed: ``StepBuffer.array`` waits for it, at fetch or when a buffer is
  compacted, never in the step.
* CUDA, not overlapped (``LENS_EVALS_COPY_OVERLAP=0``): the copy on the compute stream, as
  before: the next step's kernels queue behind it.

Graph mode needs nothing more: what is copied is never the static capture buffer that the next
replay overwrites, but the step's gather of its rows (``taps._gather_stream``: a clone, an
index_select or the step's block), a tensor of its own queued on the compute stream before the
next replay.

All copies of one worker go on one stream (the side stream, or the compute stream), in order: a
pinned region given back and reused is written only after earlier copies into it. Switching the
mode (``set_overlap``, the bench's paired rounds) waits for the copies queued so far first."""

from __future__ import annotations

import math
from typing import Any

import torch

from lens_evals import settings
from lens_evals.engine.transport import timing


class _Chunk:
    __slots__ = ("data", "used", "live")

    def __init__(self, nbytes: int, pin: bool) -> None:
        self.data = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
        self.used = 0
        self.live = 0

    @property
    def nbytes(self) -> int:
        return self.data.numel()


class PinnedArena:
    """Pinned host memory for the per-step device-to-host copies, in large chunks: pinning is
    slow (page locking, and the driver may wait for the device), so a chunk is pinned once and
    reused once every step buffer carved out of it is freed.

    Spare chunks (pinned, nothing in them) are kept by bytes: up to the most bytes in use at once
    during the last run (a run: from the first chunk taken until none is in use any more), at most
    ``max_spare_bytes`` (``LENS_EVALS_PINNED_SPARE_GIB``). So a run like the last one pins nothing
    afresh, and a large run's memory goes back after a smaller run has ended."""

    ALIGN = 512

    def __init__(self, chunk_bytes: int = 64 * 2**20, pin: bool = True, max_spare_bytes: int | None = None) -> None:
        self.chunk_bytes = chunk_bytes
        self.pin = pin
        self.max_spare_bytes = settings.PINNED_SPARE_GIB.in_bytes() if max_spare_bytes is None else max_spare_bytes
        self.current: _Chunk | None = None
        self.spare: list[_Chunk] = []
        self.pinned_bytes = 0  # every chunk: in use, current, spare
        self.used_bytes = 0  # chunks with live regions
        self.run_peak = 0  # the most ``used_bytes`` in this run
        self.last_peak = 0  # ... and in the last run that ended

    @property
    def spare_bytes(self) -> int:
        return sum(chunk.nbytes for chunk in self.spare)

    def keep_bytes(self) -> int:
        """How many bytes of spare chunks are kept now."""
        return min(self.max_spare_bytes, max(self.run_peak, self.last_peak))

    def take(self, nbytes: int) -> tuple[torch.Tensor, _Chunk]:
        size = -(-nbytes // self.ALIGN) * self.ALIGN
        chunk = self.current
        if chunk is None or chunk.used + size > chunk.nbytes:
            chunk = self._fresh(size)
        region = chunk.data[chunk.used : chunk.used + nbytes]
        chunk.used += size
        if chunk.live == 0:
            self.used_bytes += chunk.nbytes
            self.run_peak = max(self.run_peak, self.used_bytes)
        chunk.live += 1
        return region, chunk

    def _fresh(self, size: int) -> _Chunk:
        old = self.current
        self.current = None
        if old is not None and old.live == 0:
            self._retire(old)
        fits = [c for c in self.spare if c.nbytes >= size]
        if fits:
            chunk = min(fits, key=lambda c: c.nbytes)
            self.spare.remove(chunk)
        else:
            with timing.phase(timing.DETAIL + "pin new host memory"):
                chunk = _Chunk(max(self.chunk_bytes, size), self.pin)
            self.pinned_bytes += chunk.nbytes
        self.current = chunk
        return chunk

    def give_back(self, chunk: _Chunk) -> None:
        chunk.live -= 1
        if chunk.live:
            return
        chunk.used = 0
        self.used_bytes -= chunk.nbytes
        if self.used_bytes == 0:  # the run has ended: keep what the next one like it needs
            self.last_peak, self.run_peak = self.run_peak, 0
            if self.current is not None:
                chunk, self.current = self.current, None
                self._retire(chunk)
            self._trim()
        elif chunk is not self.current:
            self._retire(chunk)

    def _retire(self, chunk: _Chunk) -> None:
        """A chunk nothing is in: kept as a spare while the spares fit ``keep_bytes``, else
        dropped (back to PyTorch's pinned-memory cache, which waits for copies into it)."""
        if self.spare_bytes + chunk.nbytes <= self.keep_bytes():
            self.spare.append(chunk)
        else:
            self.pinned_bytes -= chunk.nbytes

    def _trim(self) -> None:
        keep = self.keep_bytes()
        self.spare.sort(key=lambda c: c.nbytes)
        while self.spare and self.spare_bytes > keep:
            self.pinned_bytes -= self.spare.pop().nbytes


class PlainCopy:
    """CPU: the step's tensor is kept as it is (the taps' gather already made it a new tensor)."""

    overlap = False

    def __init__(self) -> None:
        self.copies = 0
        self.overlapped = 0

    def to_host(self, tensor: torch.Tensor, arena: PinnedArena) -> tuple[torch.Tensor, Any, Any]:
        """(host tensor, the copy's event or None, the arena chunk it is in or None)."""
        if tensor.device.type != "cpu":
            raise ValueError(f"a {tensor.device.type} tensor needs the copier of its device (host_copy.host_copier)")
        self.copies += 1
        return tensor, None, None

    def set_overlap(self, on: bool) -> bool:
        return False  # nothing to overlap on the host

    # On CPU a decode run's segment costs a copy of each step's rows (the step's tensor is kept as
    # it is otherwise): segments only for small steps (probe scores), not for captured rows
    segment_step_bytes: int | None = 4 * 2**10

    def host_segment(self, shape: tuple[int, ...], dtype: torch.dtype, arena: PinnedArena) -> tuple[torch.Tensor, Any]:
        """Host memory for several steps' copies (a decode run's segment): (tensor, arena chunk or None)."""
        return torch.empty(shape, dtype=dtype), None

    def copy_into(self, tensor: torch.Tensor, host: torch.Tensor) -> Any:
        """Copy one step's tensor into ``host`` (part of a segment): the copy's event, or None."""
        self.copies += 1
        host.copy_(tensor)
        return None


class StreamCopy(PlainCopy):
    """CUDA: one asynchronous copy into pinned memory from the arena, on a side stream
    (``overlap``) or on the compute stream."""

    segment_step_bytes = None  # the device-to-host copy is made anyway: a segment costs nothing more

    def __init__(self, device: torch.device, overlap: bool) -> None:
        super().__init__()
        self.device = device
        self.overlap = overlap
        self._side: torch.cuda.Stream | None = None

    def side_stream(self) -> torch.cuda.Stream:
        if self._side is None:
            self._side = torch.cuda.Stream(self.device)
        return self._side

    def to_host(self, tensor: torch.Tensor, arena: PinnedArena) -> tuple[torch.Tensor, Any, Any]:
        host, chunk = self.host_segment(tuple(tensor.shape), tensor.dtype, arena)
        return host, self.copy_into(tensor, host), chunk

    def host_segment(self, shape: tuple[int, ...], dtype: torch.dtype, arena: PinnedArena) -> tuple[torch.Tensor, Any]:
        region, chunk = arena.take(math.prod(shape) * dtype.itemsize)
        return region.view(dtype).view(shape), chunk

    def copy_into(self, tensor: torch.Tensor, host: torch.Tensor) -> Any:
        ready = torch.cuda.Event()
        self.copies += 1
        if not self.overlap:
            host.copy_(tensor, non_blocking=True)
            ready.record()
            return ready
        side = self.side_stream()
        side.wait_stream(torch.cuda.current_stream(self.device))  # the gathers that made ``tensor``
        with torch.cuda.stream(side):
            host.copy_(tensor, non_blocking=True)
            ready.record(side)
        tensor.record_stream(side)  # its memory is reused only once the side stream has read it
        self.overlapped += 1
        return ready

    def set_overlap(self, on: bool) -> bool:
        if on != self.overlap:
            # copies of the other mode may still write regions the next copies reuse
            (self.side_stream() if self.overlap else torch.cuda.current_stream(self.device)).synchronize()
            self.overlap = on
        return self.overlap


def host_copier(device: torch.device, overlap: bool | None = None) -> PlainCopy:
    """The one place the copy is chosen: plain on CPU, a CUDA stream copy on a GPU, overlapped
    unless ``LENS_EVALS_COPY_OVERLAP=0`` (or ``overlap`` says otherwise)."""
    if device.type != "cuda":
        return PlainCopy()
    return StreamCopy(device, settings.COPY_OVERLAP.get() if overlap is None else overlap)
