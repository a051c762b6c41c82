"""The frontend's end of a request: fetch its results from every worker by key (after
``LLM._run_engine`` for all outputs of the call in one fetch; served requests that finish
together in one fetch too, ``fetch_batch``), check and trim them to prompt + generated - 1
positions and attach them as ``output.activations`` / ``output.hook_results`` (a hook set's
results go to its store). As an offline call starts, the hand-off pool regions freed since the
last fetch go back first."""

from __future__ import annotations

import asyncio
import contextvars
import logging
from dataclasses import dataclass
from typing import Any

import torch

from lens_evals.engine import compat
from lens_evals.engine.frontend import budget as frontend_budget
from lens_evals.engine.frontend.hooks import forget_local, union_of
from lens_evals.engine.frontend.pending import PendingLensRequest, ServedCall
from lens_evals.engine.frontend.readouts import readout_outputs
from lens_evals.engine.frontend.rows import decode_saved, merge_rank_results
from lens_evals.engine.frontend.state import frontend_state
from lens_evals.engine.transport import timing
from lens_evals.engine.transport.handoff import HandoffTarget, claim_all
from lens_evals.engine.transport.protocol import FETCH_METHOD, RELEASE_METHOD, FetchReply

logger = logging.getLogger("lens_evals")


@dataclass(frozen=True)
class HttpResult:
    """What the HTTP middleware adds to a response for one request: ``activations`` (or
    ``error``), ``hook_results`` (hook index -> saved) and the encoding the request asked for."""

    request_id: str
    activations: dict[str, Any] | None
    hook_results: dict[str, Any] | None
    encoding: str
    error: str | None = None


# Set by the HTTP middleware for the duration of one HTTP request; results land here too.
HTTP_SINK: contextvars.ContextVar[list[HttpResult] | None] = contextvars.ContextVar("lens_evals_http_sink", default=None)
# Likewise: the bytes its results were charged (frontend_budget.RESPONSES), released once written.
HTTP_HELD: contextvars.ContextVar[list[int] | None] = contextvars.ContextVar("lens_evals_http_held", default=None)


class LensRequestError(RuntimeError):
    """A lens request failed inside the engine (after validation). ``outputs`` holds every
    output of the call, so other requests' results are not lost."""

    def __init__(self, message: str, outputs: list[Any] | None = None) -> None:
        super().__init__(message)
        self.outputs = outputs


def _apply(
    processor: Any, request_id: str, output: Any, pending: PendingLensRequest, rank_results: list[FetchReply], generated: int | None = None
) -> str | None:
    """Attach the capture, probe scores and hook results to ``output`` (a hook set's results go
    to its store); return an error message if the request failed. ``generated``: the request's
    generated tokens when ``output`` holds only the last delta (streaming)."""
    forget_local(list(pending.local_ids))
    merged, error = merge_rank_results(rank_results, pending.key)
    output.activations = None
    output.hook_results = None
    if error is not None:
        return error
    if generated is None:
        generated = len(output.outputs[0].token_ids) if output.outputs else 0
    expected = len(output.prompt_token_ids or []) + generated - 1
    activations: dict[str, Any] = {}
    if pending.capture_layers:
        missing = [layer for layer in pending.capture_layers if layer not in merged.layers]
        if missing:
            return f"no capture came back for layers {missing}"
        whole = [block for layers, block in merged.streams if layers == list(pending.capture_layers)]
        stream = whole[0] if whole else torch.stack([merged.layers[layer] for layer in pending.capture_layers])
        if stream.shape[1] < expected:
            return f"capture is short: {stream.shape[1]} positions, expected {expected}"
        activations["residual_stream"] = stream[:, :expected]
    if pending.probe_names:
        missing_probes = [name for i, name in enumerate(pending.probe_names) if i not in merged.probes]
        if missing_probes:
            return f"no scores came back for probes {missing_probes}"
        short = [name for i, name in enumerate(pending.probe_names) if merged.probes[i].shape[0] < expected]
        if short:
            return f"probe scores are short for {short}: expected {expected} positions"
        activations["probe_scores"] = {name: merged.probes[i][:expected] for i, name in enumerate(pending.probe_names)}
    if pending.readouts:
        readouts, error = readout_outputs(rank_results, pending.key, pending.readouts, expected)
        if error is not None:
            return error
        activations["readouts"] = readouts
    if pending.has_hooks:
        output.hook_results = decode_saved(merged.saved)
        activations["saved"] = union_of(output.hook_results)
    if pending.hook_set is not None:
        error = frontend_state(processor).hook_sets.add_result(pending.hook_set, request_id, merged.set_saved or {})
        if error is not None:
            return error
    output.activations = activations
    return None


def release_offline(llm: Any) -> None:
    """As an offline call starts: the pool regions freed since the last fetch (the outputs of
    earlier calls the user dropped, e.g. ``out = llm.generate(...)`` in a loop) go to the workers
    now, not with this call's fetch at its end, so its early writes reuse them: a loop then needs
    a pool of two calls' rows, not three. Nothing to send (a plain call, nothing freed): no call."""
    source = id(compat.frontend.input_processor(llm.llm_engine))
    if not HandoffTarget.has_freed(source):
        return
    target = HandoffTarget.for_this_process(source)
    if target is None:
        return
    try:
        with timing.phase("release: worker round trip"):
            compat.rpc.offline_collective_rpc(llm, RELEASE_METHOD, (target,))
    except Exception as exc:  # the call itself may still run: its fetch frees nothing of these
        logger.warning(
            "lens_evals: giving %d freed hand-off regions back before the call failed (%s: %s); they stay taken in the worker's pool",
            len(target.get("free", [])),
            type(exc).__name__,
            exc,
        )


# Idle releases in flight (asyncio keeps only weak references to tasks)
_ORPHANS: set[asyncio.Future[Any]] = set()
IDLE_RELEASE_S = 2.0  # a server quiet this long gives its workers the regions freed since its last fetch
_idle_release: dict[int, asyncio.TimerHandle] = {}  # by source: the release pending


def release_when_idle(engine: Any) -> None:
    """After a served lens response (its tensors die as it goes out): once no other response has
    followed for ``IDLE_RELEASE_S``, the regions freed since the last fetch go to the workers,
    whose pools can then give idle segments' memory back (``handoff_pool``); a busy server sends
    them with its next fetch instead. Called on the event loop."""
    source = id(compat.frontend.input_processor(engine))
    pending = _idle_release.pop(source, None)
    if pending is not None:
        pending.cancel()
    loop = asyncio.get_running_loop()
    _idle_release[source] = loop.call_later(IDLE_RELEASE_S, _start_release, engine, source)


def _start_release(engine: Any, source: int) -> None:
    _idle_release.pop(source, None)
    if HandoffTarget.has_freed(source):
        release = asyncio.ensure_future(_release_async(engine, source))
        _ORPHANS.add(release)
        release.add_done_callback(_ORPHANS.discard)


async def _release_async(engine: Any, source: int) -> None:
    target = HandoffTarget.for_this_process(source)
    if target is None:
        return
    try:
        await compat.rpc.async_collective_rpc(engine, RELEASE_METHOD, (target,))
    except Exception as exc:  # the engine may be shutting down: the regions stay taken there
        logger.warning(
            "lens_evals: giving %d freed hand-off regions back failed (%s: %s)", len(target.get("free", [])), type(exc).__name__, exc
        )


def attach_offline(llm: Any, outputs: list[Any]) -> None:
    processor = compat.frontend.input_processor(llm.llm_engine)
    registry = frontend_state(processor).pending
    pending = {o.request_id: found for o in outputs if (found := registry.take_offline(o.request_id)) is not None}
    if not pending:
        return
    with timing.phase("fetch: worker round trip"):
        target = HandoffTarget.for_this_process(id(processor))
        rank_results = compat.rpc.offline_collective_rpc(llm, FETCH_METHOD, ([p.key for p in pending.values()], target))
        claim_all(rank_results, id(processor))
    errors = []
    with timing.phase("fetch: attach to outputs"):
        for output in outputs:
            if output.request_id in pending:
                error = _apply(processor, output.request_id, output, pending[output.request_id], rank_results)
                if error is not None:
                    errors.append(f"request {output.request_id}: {error}")
    timing.log_and_reset("frontend")
    if errors:
        raise LensRequestError("; ".join(errors), outputs)


async def attach_async(engine: Any, output: Any, generated: int, call: ServedCall) -> None:
    processor = compat.frontend.input_processor(engine)
    pending = call.take(frontend_state(processor).pending)
    if pending is None:
        return
    rank_results = await frontend_state(processor).batcher(engine).fetch(pending.key)  # claimed even if this request is cancelled
    error = _apply(processor, output.request_id, output, pending, rank_results, generated)
    sink, held = HTTP_SINK.get(), HTTP_HELD.get()
    if sink is not None:
        sink.append(HttpResult(output.request_id, output.activations, output.hook_results, pending.encoding, error))
        if held is not None:
            charge = frontend_budget.response_charge([output.activations, output.hook_results], pending.encoding)
            frontend_budget.RESPONSES.add(charge)
            held.append(charge)
    if error is not None:
        raise LensRequestError(f"request {output.request_id}: {error}")


def discard_offline(engine: Any, request_ids: list[str]) -> None:
    """Requests aborted offline (e.g. an ``LLM.generate`` refused part-way: vLLM aborts those it
    had added): forget them here (their hooks' callables too) and release their worker rows."""
    registry = frontend_state(compat.frontend.input_processor(engine)).pending
    dropped = [found for request_id in request_ids if (found := registry.take_offline(request_id)) is not None]
    for pending in dropped:
        forget_local(list(pending.local_ids))
    if dropped:
        compat.rpc.offline_collective_rpc(engine, FETCH_METHOD, ([pending.key for pending in dropped], None))  # rows inline, dropped


async def discard_async(engine: Any, call: ServedCall) -> None:
    """A request ended without a final output (abort, disconnect): release its worker rows."""
    pending = call.take(frontend_state(compat.frontend.input_processor(engine)).pending)
    if pending is not None:
        forget_local(list(pending.local_ids))
        await compat.rpc.async_collective_rpc(engine, FETCH_METHOD, ([pending.key], None))  # rows inline, dropped
