"""The frontend's admission of a request (in ``InputProcessor.process_inputs``): validate its
lens keys against the model and the engine, normalise them into ``extra_args[INTERNAL_KEY]``
(``protocol.LensSpecWire``), set its cache salt, and remember what to fetch when it ends
(``PendingRequest``, per input processor).

A request's lens state is keyed by its lens key (a fresh uuid per admission), never by the
client's request id: clients, gateways and retries repeat ids, which vLLM accepts. Once vLLM
has given the request its engine-unique id, the key is bound to whoever will read the results:
the served ``AsyncLLM.generate`` call that added it (``ServedCall``, found through a context
variable set in that call), or, for the offline ``LLM`` (ids unique per engine), its client id."""

from __future__ import annotations

import uuid
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

from lens_evals import settings
from lens_evals.engine import compat
from lens_evals.engine.frontend import budget as frontend_budget
from lens_evals.engine.frontend import self_check
from lens_evals.engine.frontend.hook_sets import CALLER, UnknownHookSet, store_of
from lens_evals.engine.frontend.hooks import encode_hooks
from lens_evals.engine.transport.graph_layers import configured_layers, refusal
from lens_evals.engine.transport.handoff import HandoffTarget
from lens_evals.engine.transport.probe_cache import encode_probe
from lens_evals.engine.transport.protocol import LensSpecWire
from lens_evals.request.args import LensLimits, parse_lens_args, refuse_misspelled_keys, remember_probes
from lens_evals.request.hooks import check_hook_args
from lens_evals.request.spec import HOOK_SET_KEY, INTERNAL_KEY, LENS_KEYS, PROBE_KEY, LensRequest
from lens_evals.wire import formats as wire

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
    charge: frontend_budget.Charge | None = None  # on the device budget while it runs


def max_capture_bytes() -> int:
    return settings.MAX_CAPTURE_GIB.in_bytes()


@dataclass
class PendingRequests:
    """The lens requests of one input processor between admission and their fetch."""

    by_key: dict[str, PendingRequest] = field(default_factory=dict)
    offline: dict[str, str] = field(default_factory=dict)  # client request id -> lens key (LLM's own ids)
    budget: frontend_budget.Ledger | None = None  # made at the first lens request (it needs the engine's facts)

    def __len__(self) -> int:
        return len(self.by_key)

    def admit(self, pending: PendingRequest) -> None:
        self.by_key[pending.key] = pending

    def take(self, key: str | None) -> PendingRequest | None:
        pending = None if key is None else self.by_key.pop(key, None)
        if pending is not None and pending.charge is not None and self.budget is not None:
            self.budget.release(pending.charge)
        return pending

    def take_offline(self, request_id: str) -> PendingRequest | None:
        return self.take(self.offline.pop(request_id, None))


@dataclass
class ServedCall:
    """One ``AsyncLLM.generate`` call: the client's request id it was given and, once vLLM
    assigned the engine's id to the request it added, that request's lens key."""

    request_id: str
    key: str | None = None

    def take(self, registry: PendingRequests) -> PendingRequest | None:
        if self.key is None:  # added as a prebuilt request under another id: bound by client id
            return registry.take_offline(self.request_id)
        return registry.take(self.key)


_CALL: ContextVar[ServedCall | None] = ContextVar("lens_evals_served_call", default=None)


def open_call(request_id: str) -> ServedCall:
    """Called by ``AsyncLLM.generate`` before it adds its request (compat.frontend.patch_async_results).
    Each step of a served stream may run in a task of its own, so the call object itself, not
    the context variable, is what the attach and discard steps are given."""
    call = ServedCall(request_id)
    _CALL.set(call)
    return call


def pending_of(processor: Any) -> PendingRequests:
    registry = getattr(processor, REGISTRY_ATTR, None)
    if registry is None:
        registry = PendingRequests()
        setattr(processor, REGISTRY_ATTR, registry)
    return registry


def lens_key_of(request: Any) -> str | None:
    extra = getattr(compat.admission.request_sampling_params(request), "extra_args", None) or {}
    spec = extra.get(INTERNAL_KEY)
    return spec.get("key") if isinstance(spec, dict) else None


def on_assigned(processor: Any, request: Any) -> None:
    """After vLLM gave ``request`` its engine-unique id: bind its lens key to the served call
    that added it, or (offline) to its client id, which the offline ``LLM`` keeps unique; a
    repeated client id there, with the first still in flight, is refused (ValueError -> 400)."""
    key = lens_key_of(request)
    if key is None:
        return
    client_id = getattr(request, "external_req_id", None) or request.request_id
    call = _CALL.get()
    if call is not None and call.key is None and call.request_id == client_id:
        call.key = key
        _CALL.set(None)
        return
    registry = pending_of(processor)
    if client_id in registry.offline:
        registry.take(key)
        raise ValueError(
            f"request id {client_id!r} is already in flight with lens work on this engine: give each concurrent request its own id"
        )
    registry.offline[client_id] = key


@dataclass(frozen=True)
class EngineFacts:
    """What admission needs of the engine, read from its config once per input processor: the
    model's shape, the graph-mode layers (None: eager mode) and why the engine takes no lens
    requests (its configuration, or an unverified architecture; None: it takes them). The
    limits (``LENS_EVALS_MAX_CAPTURE_GIB``) are read per request: they may change while it runs."""

    shape: compat.config.ModelShape
    tapped: list[int] | None
    refusal: str | None
    step: frontend_budget.StepFacts


def engine_facts(processor: Any) -> EngineFacts:
    facts = getattr(processor, FACTS_ATTR, None)
    if facts is None:
        config = processor.vllm_config
        shape = compat.config.model_shape(config)
        refused = compat.frontend.engine_refusal(config) or compat.architectures.frontend_refusal(config.model_config)
        act_bytes, step_rows = compat.frontend.step_limits(config)
        step = frontend_budget.StepFacts(shape.hidden_size, act_bytes, step_rows)
        facts = EngineFacts(shape, configured_layers(config, shape.num_layers), refused, step)
        setattr(processor, FACTS_ATTR, facts)
    return facts


def on_request(processor: Any, request_id: str, request: Any) -> None:
    """Validate and normalise one request's lens keys (raises ValueError -> HTTP 400)."""
    params = compat.admission.request_sampling_params(request)
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
    facts = engine_facts(processor)  # first: the model's shape bounds what parsing may decode
    shape = facts.shape
    prompt_len = len(request.prompt_token_ids or [])
    max_positions = prompt_len + int(params.max_tokens or 1) - 1
    if isinstance(probes := extra.get(PROBE_KEY), list):  # counted before any is parsed (each costs ~80 us)
        frontend_budget.refuse_alone(frontend_budget.probes_charge(len(probes), max(max_positions, 1), facts.step))
    lens = parse_lens_args(extra, LensLimits.for_model(shape.num_layers, shape.hidden_size, max_positions))
    if not lens.active:
        return
    if facts.refusal is not None:
        raise ValueError(facts.refusal)
    if (failed := self_check.refusal_of(processor)) is not None:
        raise ValueError(failed)
    if getattr(params, "n", 1) != 1:
        raise ValueError(f"{'/'.join(LENS_KEYS)} need n=1 (send n separate requests)")
    lens = lens.for_model(shape.num_layers)
    lens.check_model(shape.num_layers, shape.hidden_size, max(max_positions, 1), max_capture_bytes())
    tapped = facts.tapped
    if tapped is not None and (reason := refusal(lens, tapped)) is not None:
        raise ValueError(reason)
    for hook in lens.hooks:
        check_hook_args(hook, shape.hidden_size, max(max_positions, 1), shape.vocab_size)
    if lens.hook_set is not None:
        try:
            store_of(processor).record(lens.hook_set, CALLER.get())  # only its owner's requests find it
        except UnknownHookSet as exc:
            raise ValueError(str(exc.args[0])) from None
    frontend_budget.RESPONSES.admit()  # 429 while unread responses hold too much
    registry = pending_of(processor)
    if registry.budget is None:
        registry.budget = frontend_budget.Ledger(facts.step)
    charge = frontend_budget.charge_of(lens, max(max_positions, 1), facts.step)
    registry.budget.admit(charge)  # 400 if it never fits, 429 if not now; released by take()
    try:
        registry.admit(_normalise(request, params, extra, lens, charge))
    except BaseException:
        registry.budget.release(charge)
        raise


def _normalise(request: Any, params: Any, extra: dict[str, Any], lens: LensRequest, charge: frontend_budget.Charge) -> PendingRequest:
    """An accepted request's lens keys as ``extra_args[INTERNAL_KEY]`` under a fresh key, and
    what to fetch when it ends."""
    prompt_len = len(request.prompt_token_ids or [])
    hooks, local_ids = encode_hooks(lens.hooks)
    probes = [encode_probe(probe) for probe in lens.probes]  # once per distinct probe
    remember_probes(extra, lens.probes)  # accepted: its probe strings are parsed once from now on
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
    compat.admission.set_request_cache_salt(request, key)
    if lens.hooks or lens.hook_set is not None:
        compat.admission.recompute_from_scratch(params)
    return PendingRequest(
        key,
        tuple(lens.capture_layers),
        tuple(probe.name for probe in lens.probes),
        prompt_len,
        has_hooks=bool(lens.hooks),
        hook_set=lens.hook_set,
        local_ids=tuple(local_ids),
        encoding=lens.encoding,
        charge=charge,
    )
