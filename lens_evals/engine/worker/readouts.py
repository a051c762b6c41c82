"""Readouts on the worker (``output_readouts``, request/readouts.py): lens readouts through the
model's own final norm and logits (``compat.worker.readout_head``) and SAE encoders, computed in
the step on the requests' rows after steering and hooks, like probes. Each (request, readout,
layer) of a step is a job; the jobs of a layer that read the same way (kind, weights, top_k) are
one group: one gather of their rows, one head or encoder matmul, one top-k on the device; only
the ids and values of the top-k leave it, as one float32 block per step
``[ids as float32 | values]`` (ids are exact in float32 below 2**24, checked at admission).

Weights are decoded once per digest onto the device and kept in a least-recently-used cache
bounded in bytes (``LENS_EVALS_READOUT_CACHE_MIB``, kept out of vLLM's KV cache beside the lens
budget, which charges a running request's own weights). Lens logits and SAE latents are made
for ``LOGIT_CHUNK_ROWS`` rows at a time, so what a readout makes at once is bounded as the
frontend's budget charges it."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from lens_evals import settings
from lens_evals.engine.transport import readout_files
from lens_evals.engine.worker.spans import rows_of, span_of
from lens_evals.engine.worker.transfer import to_device
from lens_evals.request.readouts import LOGIT_CHUNK_ROWS, AffineLens, LensReadout, SaeEncoder, SaeReadout, parse_readout

Head = Callable[[torch.Tensor], torch.Tensor | None]  # stream rows -> the model's logits (None: on a TP rank > 0)


@dataclass(frozen=True)
class WorkerLens:
    weights: dict[int, torch.Tensor]  # layer -> (d, d) float32 on the device
    biases: dict[int, torch.Tensor]  # layer -> (d,)


@dataclass(frozen=True)
class WorkerSae:
    W_enc: torch.Tensor  # (d, n) float32
    b_enc: torch.Tensor  # (n,)
    b_dec: torch.Tensor | None  # subtracted from the input first, when given
    threshold: torch.Tensor | None
    activation: str
    k: int | None


@dataclass(frozen=True)
class WorkerReadout:
    """One readout of a request: ``index`` its place in the request's list, ``digest`` names
    its weights ("" for the logit lens), ``layers`` the layers it reads."""

    index: int
    kind: str  # "lens" | "sae"
    layers: tuple[int, ...]
    top_k: int
    digest: str
    lens: WorkerLens | None = None
    sae: WorkerSae | None = None

    @property
    def width(self) -> int:
        return 2 * self.top_k


class DeviceWeights:
    """Readout weights on the device by (digest, device), least recently used first out, at
    most ``max_bytes`` kept between requests (a request's own weights stay alive while it runs,
    charged to the lens budget; weights larger than the cache are not kept)."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.entries: OrderedDict[tuple[str, str], tuple[Any, int]] = OrderedDict()
        self.held = 0

    def get(self, key: tuple[str, str]) -> Any | None:
        entry = self.entries.get(key)
        if entry is None:
            return None
        self.entries.move_to_end(key)
        return entry[0]

    def put(self, key: tuple[str, str], value: Any, nbytes: int) -> None:
        self.entries[key] = (value, nbytes)
        self.held += nbytes
        while self.held > self.max_bytes and self.entries:
            _, (_, dropped) = self.entries.popitem(last=False)
            self.held -= dropped


_cache = DeviceWeights(settings.READOUT_CACHE_MIB.in_bytes())


def _tensor(array: np.ndarray, device: torch.device) -> torch.Tensor:
    return to_device(np.ascontiguousarray(array, dtype=np.float32), device)


def _optional(array: np.ndarray | None, device: torch.device) -> torch.Tensor | None:
    return None if array is None else _tensor(array, device)


def _decode_lens(lens: AffineLens, device: torch.device) -> WorkerLens:
    weights = lens.weights
    biases = lens.biases if lens.biases is not None else np.zeros(weights.shape[:2], dtype=np.float32)
    layers = list(lens.layers or [])
    return WorkerLens(
        {layer: _tensor(weights[i], device) for i, layer in enumerate(layers)},
        {layer: _tensor(biases[i], device) for i, layer in enumerate(layers)},
    )


def _decode_sae(sae: SaeEncoder, device: torch.device) -> WorkerSae:
    b_dec = sae.b_dec if sae.apply_b_dec_to_input else None
    return WorkerSae(
        _tensor(sae.W_enc, device),
        _tensor(sae.b_enc, device),
        _optional(b_dec, device),
        _optional(sae.threshold, device),
        sae.activation,
        sae.k,
    )


def decode_readouts(items: list[dict[str, Any]], device: torch.device) -> list[WorkerReadout]:
    """A request's readouts (the frontend's normalised wire dicts, weights inline, by the
    digest of weights this worker holds, or by digest and the frontend's file of them)."""
    out = []
    for index, item in enumerate(items):
        field_name = "lens" if item.get("kind") == "lens" else "sae"
        sent = item.get(field_name)
        digest = str(sent.get("digest") or "") if isinstance(sent, dict) else ""
        key = (digest, str(device))
        decoded: Any = _cache.get(key) if digest else None
        if decoded is not None:  # held: the weights are not decoded again
            item = {**item, field_name: {"digest": digest}}
        elif isinstance(sent, dict) and "file" in sent:  # written once by the frontend (transport/readout_files.py)
            item = {**item, field_name: readout_files.read(str(sent["file"]), digest)}
        readout = parse_readout(item)
        nested = readout.lens if isinstance(readout, LensReadout) else readout.sae
        if nested is not None:
            digest = nested.content_digest()
            if decoded is None:
                if not nested.inline:
                    raise ValueError(
                        f"readout {readout.name!r}: weights {digest[:12]}... are not on this worker (evicted): send them inline again"
                    )
                decoded = _decode_lens(nested, device) if isinstance(nested, AffineLens) else _decode_sae(nested, device)
                _cache.put((digest, str(device)), decoded, nested.nbytes())
        if isinstance(readout, LensReadout):
            layers = tuple(readout.layers_for(0))  # the frontend sent the layers resolved
            out.append(WorkerReadout(index, "lens", layers, readout.top_k, digest, lens=decoded))
        else:
            assert isinstance(readout, SaeReadout)
            out.append(WorkerReadout(index, "sae", (readout.layer,), readout.top_k, digest, sae=decoded))
    return out


# ----------------------------------------------------------------- the math, on the device
def lens_topk(stream: torch.Tensor, head: Head, lens: WorkerLens | None, layer: int, k: int) -> torch.Tensor | None:
    """(n, 2k) float32 ``[ids | log-probs]`` of the top ``k`` tokens of each row read through the
    (affine) lens and the model's head; None on ranks the gathered logits do not reach. Every
    rank must call it with the same rows (the head's logits gather is a collective)."""
    if lens is not None:
        stream = (stream.float() @ lens.weights[layer].T + lens.biases[layer]).to(stream.dtype)
    pieces = []
    for start in range(0, max(stream.shape[0], 1), LOGIT_CHUNK_ROWS):
        logits = head(stream[start : start + LOGIT_CHUNK_ROWS])
        if logits is None:
            continue
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        values, ids = torch.topk(logprobs, k, dim=-1)
        pieces.append(torch.cat([ids.float(), values], dim=-1))
    if not pieces:
        return None
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces)


def sae_topk(stream: torch.Tensor, sae: WorkerSae, k: int) -> torch.Tensor:
    """(n, 2k) float32 ``[ids | activations]`` of the ``k`` largest latents per row; a latent
    that is not active (0) has id -1. ``LOGIT_CHUNK_ROWS`` rows at a time."""
    pieces = [_sae_chunk(stream[start : start + LOGIT_CHUNK_ROWS], sae, k) for start in range(0, stream.shape[0], LOGIT_CHUNK_ROWS)]
    if len(pieces) == 1:
        return pieces[0]
    return torch.cat(pieces) if pieces else torch.empty((0, 2 * k), dtype=torch.float32, device=stream.device)


def _sae_chunk(stream: torch.Tensor, sae: WorkerSae, k: int) -> torch.Tensor:
    x = stream.float()
    if sae.b_dec is not None:
        x = x - sae.b_dec
    pre = x @ sae.W_enc + sae.b_enc
    if sae.activation == "jumprelu":
        assert sae.threshold is not None
        acts = pre * (pre > sae.threshold)
    elif sae.activation == "topk":
        assert sae.k is not None
        kept, where = torch.topk(pre, sae.k, dim=-1)
        acts = torch.zeros_like(pre).scatter_(-1, where, torch.relu(kept))
    else:
        acts = torch.relu(pre)
    values, ids = torch.topk(acts, k, dim=-1)
    ids = torch.where(values > 0, ids, torch.full_like(ids, -1))
    return torch.cat([ids.float(), values], dim=-1)


# ----------------------------------------------------------------- one step's plan
@dataclass
class ReadoutJob:
    """One readout of one request on one layer in a step: its place in the step's flat result
    (``offset``, ``num_rows * width`` floats) and what it belongs to."""

    key: str
    readout: WorkerReadout
    layer: int
    num_rows: int
    batch_index: int
    offset: int = 0


@dataclass
class ReadoutGroup:
    """The jobs of one layer that read the same way (kind, weights, top_k): one gather of their
    rows (a slice when contiguous), one head / encoder call, one top-k. ``stored``: False on
    tensor-parallel ranks > 0 (lens groups run there for the head's collective, nothing kept)."""

    readout: WorkerReadout
    layer: int
    jobs: list[ReadoutJob]
    spans: list[tuple[int, int]]  # (first row, rows) of each job, in order
    stored: bool
    rows: torch.Tensor | None = None
    span: tuple[int, int] | None = None


@dataclass
class StepReadouts:
    """Per layer the step's readout groups; the flat size of the step's results (stored groups'
    jobs, layer after layer, group after group)."""

    groups: dict[int, list[ReadoutGroup]] = field(default_factory=dict)
    total: int = 0

    def stored_jobs(self) -> list[ReadoutJob]:
        return [job for layer in sorted(self.groups) for group in self.groups[layer] if group.stored for job in group.jobs]


def plan_readouts(
    entries: list[tuple[Any, int, int, int]], device: torch.device, keep_here: bool, local_layers: set[int]
) -> StepReadouts | None:
    """The step's readout groups from (request, batch index, first row, rows) of each request
    with readouts; ``keep_here``: this rank keeps results (else only lens groups run, for the
    collective inside the head)."""
    by_layer: dict[int, dict[tuple[str, str, int], ReadoutGroup]] = {}
    for req, batch_index, start, n in entries:
        for readout in req.readouts:
            if readout.kind == "sae" and not keep_here:
                continue
            for layer in readout.layers:
                if layer not in local_layers:
                    continue
                groups = by_layer.setdefault(layer, {})
                sig = (readout.kind, readout.digest, readout.top_k)
                if sig not in groups:
                    groups[sig] = ReadoutGroup(readout, layer, [], [], keep_here)
                group = groups[sig]
                group.jobs.append(ReadoutJob(req.key, readout, layer, n, batch_index))
                group.spans.append((start, n))
    if not by_layer:
        return None
    step = StepReadouts({layer: list(by_layer[layer].values()) for layer in sorted(by_layer)})
    for layer_groups in step.groups.values():  # the flat result is laid out as the taps run
        for group in layer_groups:
            group.span = span_of(group.spans)
            if group.span is None:
                group.rows = to_device(rows_of(group.spans), device)
            if group.stored:
                for job in group.jobs:
                    job.offset, step.total = step.total, step.total + job.num_rows * job.readout.width
    return step


def run_layer_readouts(
    groups: list[ReadoutGroup], hidden: torch.Tensor, residual: torch.Tensor | None, head: Head | None
) -> list[torch.Tensor]:
    """The results of one layer's groups (flattened, stored groups only, in order: each group's
    rows are its jobs' rows one after another)."""
    out = []
    for group in groups:
        if group.span is not None:
            start, stop = group.span
            stream = hidden[start:stop] + residual[start:stop] if residual is not None else hidden[start:stop]
        else:
            assert group.rows is not None
            stream = hidden.index_select(0, group.rows)
            if residual is not None:
                stream = stream + residual.index_select(0, group.rows)
        readout = group.readout
        if readout.kind == "lens":
            if head is None:
                raise RuntimeError("lens readouts need the model's final norm and logits, not found on this model")
            result = lens_topk(stream, head, readout.lens, group.layer, readout.top_k)
        else:
            assert readout.sae is not None
            result = sae_topk(stream, readout.sae, readout.top_k)
        if group.stored and result is not None:
            out.append(result.reshape(-1))
    return out
