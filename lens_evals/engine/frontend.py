"""Frontend side (the process that owns LLM / AsyncLLM): validate lens requests before they
reach the engine, then fetch each finished request's results from the workers and attach them
to its RequestOutput as ``output.activations``."""

from __future__ import annotations

import contextvars
import uuid
from dataclasses import dataclass, field
from typing import Any

import torch

from lens_evals import settings, wire
from lens_evals.engine import compat, timing
from lens_evals.engine.graph_taps import configured_layers, refusal
from lens_evals.engine.handoff import HandoffTarget, claim_all
from lens_evals.engine.hook_sets import UnknownHookSet, store_of
from lens_evals.engine.hooks import encode_hooks, forget_local, union_of
from lens_evals.engine.store import result_tensors
from lens_evals.engine.worker import FETCH_METHOD
from lens_evals.hooks import check_registered_args
from lens_evals.request_args import parse_lens_args, refuse_misspelled_keys
from lens_evals.spec import HOOK_SET_KEY, INTERNAL_KEY, LENS_KEYS

REGISTRY_ATTR = "_lens_evals_pending"
TAPPED_ATTR = "_lens_evals_graph_layers"
REFUSAL_ATTR = "_lens_evals_refusal"


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
HTTP_SINK: contextvars.ContextVar[list[HttpResult] | None] = contextvars.ContextVar(
    "lens_evals_http_sink", default=None
)


class LensRequestError(RuntimeError):
    """A lens request failed inside the engine (after validation). ``outputs`` holds every
    output of the call, so other requests' results are not lost."""

    def __init__(self, message: str, outputs: list[Any] | None = None) -> None:
        super().__init__(message)
        self.outputs = outputs


@dataclass(frozen=True)
class PendingRequest:
    key: str
    capture_layers: tuple[int, ...]
    probe_names: tuple[str, ...]
    prompt_len: int
    has_hooks: bool = False
    hook_set: str | None = None
    local_ids: tuple[str, ...] = ()
    encoding: str = wire.DEFAULT_RESPONSE_ENCODING


def max_capture_bytes() -> int:
    return settings.MAX_CAPTURE_GIB.in_bytes()


def _registry(processor: Any) -> dict[str, PendingRequest]:
    registry = getattr(processor, REGISTRY_ATTR, None)
    if registry is None:
        registry = {}
        setattr(processor, REGISTRY_ATTR, registry)
    return registry


def _tapped_layers(processor: Any, num_layers: int) -> list[int] | None:
    """The engine's graph-mode layers (None: eager mode), read from its config once."""
    if not hasattr(processor, TAPPED_ATTR):
        setattr(processor, TAPPED_ATTR, configured_layers(processor.vllm_config, num_layers))
    return getattr(processor, TAPPED_ATTR)


def _engine_refusal(processor: Any) -> str | None:
    """Why this engine takes no lens requests (its configuration, or an unverified
    architecture; None: it takes them), read once."""
    if not hasattr(processor, REFUSAL_ATTR):
        config = processor.vllm_config
        setattr(processor, REFUSAL_ATTR, compat.engine_refusal(config) or compat.frontend_refusal(config.model_config))
    return getattr(processor, REFUSAL_ATTR)


def on_request(processor: Any, request_id: str, request: Any) -> None:
    """Validate and normalise one request's lens keys (raises ValueError -> HTTP 400)."""
    params = compat.request_sampling_params(request)
    if params is not None and (auto_set := store_of(processor).auto_set) is not None:
        params.extra_args = {HOOK_SET_KEY: auto_set, **(params.extra_args or {})}  # offline LLM.register_hooks
    extra = getattr(params, "extra_args", None)
    if not extra:
        return
    if INTERNAL_KEY in extra:
        raise ValueError(f"extra_args key {INTERNAL_KEY!r} is reserved for lens_evals")
    refuse_misspelled_keys(extra)
    if not any(key in extra for key in LENS_KEYS):
        return
    lens = parse_lens_args(extra)
    if not lens.active:
        return
    if (engine_refusal := _engine_refusal(processor)) is not None:
        raise ValueError(engine_refusal)
    if getattr(params, "n", 1) != 1:
        raise ValueError(f"{'/'.join(LENS_KEYS)} need n=1 (send n separate requests)")
    shape = compat.model_shape(processor.vllm_config)
    lens = lens.for_model(shape.num_layers)
    prompt_len = len(request.prompt_token_ids or [])
    max_positions = prompt_len + int(params.max_tokens or 1) - 1
    lens.check_model(shape.num_layers, shape.hidden_size, max(max_positions, 1), max_capture_bytes())
    tapped = _tapped_layers(processor, shape.num_layers)
    if tapped is not None and (reason := refusal(lens, tapped)) is not None:
        raise ValueError(reason)
    for hook in lens.hooks:
        if hook.registered:
            check_registered_args(str(hook.fn), hook.args)
    if lens.hook_set is not None:
        try:
            store_of(processor).record(lens.hook_set)
        except UnknownHookSet as exc:
            raise ValueError(str(exc.args[0])) from None
    hooks, local_ids = encode_hooks(lens.hooks)
    key = uuid.uuid4().hex
    normalised = {k: v for k, v in extra.items() if k not in LENS_KEYS}
    normalised[INTERNAL_KEY] = {
        "key": key,
        "capture": lens.capture_layers,
        "steer": [vec.to_wire() for vec in lens.steering],
        "probes": [probe.to_wire() for probe in lens.probes],
        "hooks": hooks,
        "hook_set": lens.hook_set,
    }
    params.extra_args = normalised  # a fresh dict: the caller's params stay untouched
    compat.set_request_cache_salt(request, key)
    _registry(processor)[request_id] = PendingRequest(
        key, tuple(lens.capture_layers), tuple(probe.name for probe in lens.probes), prompt_len,
        has_hooks=bool(lens.hooks), hook_set=lens.hook_set, local_ids=tuple(local_ids), encoding=lens.encoding,
    )


@dataclass
class _Merged:
    layers: dict[int, torch.Tensor]  # capture layer -> (n_positions, hidden)
    probes: dict[int, torch.Tensor]  # probe index -> (n_positions,)
    saved: dict[str, Any] | None = None  # hook results, encoded (merged over pipeline stages)
    # (layers, (n_layers, n_positions, hidden)) as each rank sent them: one rank's block in the
    # request's layer order is used as it is, without stacking again
    streams: list[tuple[list[int], torch.Tensor]] = field(default_factory=list)
    set_saved: dict[str, Any] | None = None


def _merge_saved(into: dict[str, Any] | None, part: dict[str, Any] | None) -> dict[str, Any] | None:
    """Per-hook saved dicts ({hook index: saved}) of two pipeline stages, joined per hook."""
    if part is None:
        return into
    merged = {index: dict(saved) for index, saved in (into or {}).items()}
    for index, saved in part.items():
        clash = sorted(set(merged.get(index, {})) & set(saved))
        if clash:
            raise ValueError(f"hook {index}: saved keys {clash} were written on two pipeline stages")
        merged[index] = {**merged.get(index, {}), **saved}
    return merged



def _merge_rank_results(rank_results: list[dict[str, dict[str, Any]]], key: str) -> tuple[_Merged, str | None]:
    merged = _Merged({}, {})
    for per_rank in rank_results:
        result = per_rank.get(key) if per_rank else None
        if not result:
            continue
        if "error" in result:
            return merged, str(result["error"])
        try:
            merged.saved = _merge_saved(merged.saved, result.get("saved"))
            merged.set_saved = _merge_saved(merged.set_saved, result.get("set_saved"))
        except ValueError as exc:
            return merged, str(exc)
        try:
            tensors = result_tensors(result)
        except ValueError as exc:
            return merged, f"could not read the worker's rows: {exc}"
        if "residual_stream" in tensors:
            merged.streams.append((tensors["layers"], tensors["residual_stream"]))
        for i, layer in enumerate(tensors.get("layers", [])):
            merged.layers[layer] = tensors["residual_stream"][i]
        for i, index in enumerate(tensors.get("probe_index", [])):
            merged.probes[index] = tensors["probe_scores"][i]
    return merged, None


def _decode_saved(saved: dict[str, Any] | None) -> dict[str, Any]:
    return wire.decode_tree_native(saved or {})


def _apply(processor: Any, request_id: str, output: Any, pending: PendingRequest, rank_results: list[dict[str, Any]],
           generated: int | None = None) -> str | None:
    """Attach the capture, probe scores and hook results to ``output`` (a hook set's results go
    to its store); return an error message if the request failed. ``generated``: the request's
    generated tokens when ``output`` holds only the last delta (streaming)."""
    forget_local(list(pending.local_ids))
    merged, error = _merge_rank_results(rank_results, pending.key)
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
    if pending.has_hooks:
        output.hook_results = _decode_saved(merged.saved)
        activations["saved"] = union_of(output.hook_results)
    if pending.hook_set is not None:
        error = store_of(processor).add_result(pending.hook_set, request_id, merged.set_saved or {})
        if error is not None:
            return error
    output.activations = activations
    return None


def attach_offline(llm: Any, outputs: list[Any]) -> None:
    processor = compat.offline_input_processor(llm)
    registry = _registry(processor)
    pending = {o.request_id: registry.pop(o.request_id) for o in outputs if o.request_id in registry}
    if not pending:
        return
    with timing.phase("fetch: worker round trip"):
        target = HandoffTarget.for_this_process(id(processor))
        rank_results = compat.offline_collective_rpc(llm, FETCH_METHOD, ([p.key for p in pending.values()], target))
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


async def attach_async(engine: Any, output: Any, generated: int) -> None:
    processor = compat.async_input_processor(engine)
    pending = _registry(processor).pop(output.request_id, None)
    if pending is None:
        return
    target = HandoffTarget.for_this_process(id(processor))
    rank_results = await compat.async_collective_rpc(engine, FETCH_METHOD, ([pending.key], target))
    claim_all(rank_results, id(processor))
    error = _apply(processor, output.request_id, output, pending, rank_results, generated)
    sink = HTTP_SINK.get()
    if sink is not None:
        sink.append(HttpResult(output.request_id, output.activations, output.hook_results, pending.encoding, error))
    if error is not None:
        raise LensRequestError(f"request {output.request_id}: {error}")


async def discard_async(engine: Any, request_id: str) -> None:
    """A request ended without a final output (abort, disconnect): release its worker rows."""
    pending = _registry(compat.async_input_processor(engine)).pop(request_id, None)
    if pending is not None:
        forget_local(list(pending.local_ids))
        await compat.async_collective_rpc(engine, FETCH_METHOD, ([pending.key], None))  # rows inline, dropped
