"""The frontend's admission of a request (in ``InputProcessor.process_inputs``): validate its
lens keys against the model and the engine, normalise them into ``extra_args[INTERNAL_KEY]``
(``protocol.LensSpecWire``), set its cache salt, and remember what to fetch when it ends
(``PendingRequest``, per input processor)."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from lens_evals import settings, wire
from lens_evals.engine import compat
from lens_evals.engine.frontend_hooks import encode_hooks
from lens_evals.engine.graph_taps import configured_layers, refusal
from lens_evals.engine.handoff import HandoffTarget
from lens_evals.engine.hook_sets import UnknownHookSet, store_of
from lens_evals.engine.probe_cache import encode_probe
from lens_evals.engine.protocol import LensSpecWire
from lens_evals.hooks import check_hook_args
from lens_evals.request_args import parse_lens_args, refuse_misspelled_keys
from lens_evals.spec import HOOK_SET_KEY, INTERNAL_KEY, LENS_KEYS

REGISTRY_ATTR = "_lens_evals_pending"
FACTS_ATTR = "_lens_evals_engine_facts"


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


def pending_of(processor: Any) -> dict[str, PendingRequest]:
    registry = getattr(processor, REGISTRY_ATTR, None)
    if registry is None:
        registry = {}
        setattr(processor, REGISTRY_ATTR, registry)
    return registry


@dataclass(frozen=True)
class EngineFacts:
    """What admission needs of the engine, read from its config once per input processor: the
    model's shape, the graph-mode layers (None: eager mode) and why the engine takes no lens
    requests (its configuration, or an unverified architecture; None: it takes them). The
    limits (``LENS_EVALS_MAX_CAPTURE_GIB``) are read per request: they may change while it runs."""

    shape: compat.ModelShape
    tapped: list[int] | None
    refusal: str | None


def engine_facts(processor: Any) -> EngineFacts:
    facts = getattr(processor, FACTS_ATTR, None)
    if facts is None:
        config = processor.vllm_config
        shape = compat.model_shape(config)
        refused = compat.engine_refusal(config) or compat.frontend_refusal(config.model_config)
        facts = EngineFacts(shape, configured_layers(config, shape.num_layers), refused)
        setattr(processor, FACTS_ATTR, facts)
    return facts


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
    facts = engine_facts(processor)
    if facts.refusal is not None:
        raise ValueError(facts.refusal)
    if getattr(params, "n", 1) != 1:
        raise ValueError(f"{'/'.join(LENS_KEYS)} need n=1 (send n separate requests)")
    shape = facts.shape
    lens = lens.for_model(shape.num_layers)
    prompt_len = len(request.prompt_token_ids or [])
    max_positions = prompt_len + int(params.max_tokens or 1) - 1
    lens.check_model(shape.num_layers, shape.hidden_size, max(max_positions, 1), max_capture_bytes())
    tapped = facts.tapped
    if tapped is not None and (reason := refusal(lens, tapped)) is not None:
        raise ValueError(reason)
    for hook in lens.hooks:
        check_hook_args(hook, shape.hidden_size, max(max_positions, 1), shape.vocab_size)
    if lens.hook_set is not None:
        try:
            store_of(processor).record(lens.hook_set)
        except UnknownHookSet as exc:
            raise ValueError(str(exc.args[0])) from None
    hooks, local_ids = encode_hooks(lens.hooks)
    probes = [encode_probe(probe) for probe in lens.probes]  # once per distinct probe
    key = uuid.uuid4().hex
    normalised = {k: v for k, v in extra.items() if k not in LENS_KEYS}
    spec: LensSpecWire = {
        "key": key,
        "capture": lens.capture_layers,
        "steer": [vec.to_wire() for vec in lens.steering],
        "probes": [wire_form for wire_form, _ in probes],
        "probe_digests": [digest for _, digest in probes],
        "hooks": hooks,
        "hook_set": lens.hook_set,
    }
    if lens.capture_layers or lens.probes:
        address = HandoffTarget.address()
        if address is not None:  # the worker may write the rows here as soon as they are final
            spec["handoff"] = address
    normalised[INTERNAL_KEY] = spec
    params.extra_args = normalised  # a fresh dict: the caller's params stay untouched
    compat.set_request_cache_salt(request, key)
    if lens.hooks or lens.hook_set is not None:
        compat.recompute_from_scratch(params)
    pending_of(processor)[request_id] = PendingRequest(
        key,
        tuple(lens.capture_layers),
        tuple(probe.name for probe in lens.probes),
        prompt_len,
        has_hooks=bool(lens.hooks),
        hook_set=lens.hook_set,
        local_ids=tuple(local_ids),
        encoding=lens.encoding,
    )
