"""The frontend's admission of a request (in ``InputProcessor.process_inputs``): validate its
lens keys against the model and the engine, normalise them into ``extra_args[INTERNAL_KEY]``
(``protocol.LensRequestWire``), set its cache salt, and remember what to fetch when it ends
(``PendingLensRequest``, in the engine's frontend state).

A request's lens state is keyed by its lens key (a fresh uuid per admission), never by the
client's request id: clients, gateways and retries repeat ids, which vLLM accepts. Once vLLM
has given the request its engine-unique id, the key is bound to whoever will read the results:
the served ``AsyncLLM.generate`` call that added it (``ServedCall``, found through a context
variable set in that call), or, for the offline ``LLM`` (ids unique per engine), its client id."""

from __future__ import annotations

import uuid
from contextvars import ContextVar
from typing import Any

from lens_evals.engine import compat
from lens_evals.engine.frontend import budget as frontend_budget
from lens_evals.engine.frontend.hook_set_store import CALLER, UnknownHookSet
from lens_evals.engine.frontend.hooks import encode_hooks
from lens_evals.engine.frontend.pending import PendingLensRequest, ServedCall
from lens_evals.engine.frontend.self_check_run import refusal_of
from lens_evals.engine.frontend.state import frontend_state, max_capture_bytes
from lens_evals.engine.transport import timing
from lens_evals.engine.transport.graph_layers import refusal
from lens_evals.engine.transport.handoff import HandoffTarget
from lens_evals.engine.transport.probe_cache import encode_probe, encode_steering
from lens_evals.engine.transport.protocol import LensRequestWire
from lens_evals.engine.transport.readout_cache import normalise as normalise_readouts
from lens_evals.request.args import LensLimits, parse_lens_args, refuse_misspelled_keys, remember_probes
from lens_evals.request.hooks import check_hook_args
from lens_evals.request.readouts import check_readouts
from lens_evals.request.spec import HOOK_SET_KEY, INTERNAL_KEY, LENS_KEYS, PROBE_KEY, LensRequest

_CALL: ContextVar[ServedCall | None] = ContextVar("lens_evals_served_call", default=None)


def open_call(request_id: str) -> ServedCall:
    """Called by ``AsyncLLM.generate`` before it adds its request (compat.frontend.patch_async_results).
    Each step of a served stream may run in a task of its own, so the call object itself, not
    the context variable, is what the attach and discard steps are given."""
    call = ServedCall(request_id)
    _CALL.set(call)
    return call


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
    registry = frontend_state(processor).pending
    if client_id in registry.offline:
        registry.take(key)
        raise ValueError(
            f"request id {client_id!r} is already in flight with lens work on this engine: give each concurrent request its own id"
        )
    registry.offline[client_id] = key


def on_request(processor: Any, request_id: str, request: Any) -> None:
    """Validate and normalise one request's lens keys (raises ValueError -> HTTP 400)."""
    with timing.phase("admit: frontend"):
        _on_request(processor, request_id, request)


def _on_request(processor: Any, request_id: str, request: Any) -> None:
    params = compat.admission.request_sampling_params(request)
    if params is not None and (auto_set := frontend_state(processor).hook_sets.auto_set) is not None:
        params.extra_args = {HOOK_SET_KEY: auto_set, **(params.extra_args or {})}  # offline LLM.register_hooks
    extra = getattr(params, "extra_args", None)
    if not extra:
        return
    if INTERNAL_KEY in extra:
        raise ValueError(f"extra_args key {INTERNAL_KEY!r} is reserved for lens_evals")
    refuse_misspelled_keys(extra)
    if not any(key in extra for key in LENS_KEYS):
        return
    state = frontend_state(processor)
    facts = state.facts  # first: the model's shape bounds what parsing may decode
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
    if (failed := refusal_of(processor)) is not None:
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
    address = HandoffTarget.address() if lens.readouts and facts.workers_share_host else None
    weights_dir = address["dir"] if address is not None else None  # weights by file, once per digest
    readouts = normalise_readouts(lens.readouts, shape.num_layers, weights_dir)  # digests resolved: unknown -> 400
    check_readouts([readout for readout, _ in readouts], shape.num_layers, shape.hidden_size, {probe.name for probe in lens.probes})
    if lens.hook_set is not None:
        try:
            state.hook_sets.record(lens.hook_set, CALLER.get())  # only its owner's requests find it
        except UnknownHookSet as exc:
            raise ValueError(str(exc.args[0])) from None
    frontend_budget.RESPONSES.admit()  # 429 while unread responses hold too much
    registry = state.pending
    if registry.budget is None:
        registry.budget = frontend_budget.Ledger(facts.step)
    charge = frontend_budget.charge_of(lens, max(max_positions, 1), facts.step, readouts)
    registry.budget.admit(charge)  # 400 if it never fits, 429 if not now; released by take()
    try:
        registry.admit(_normalise(request, params, extra, lens, charge, readouts))
    except BaseException:
        registry.budget.release(charge)
        raise


def _normalise(
    request: Any,
    params: Any,
    extra: dict[str, Any],
    lens: LensRequest,
    charge: frontend_budget.Charge,
    readouts: list[tuple[Any, dict[str, Any]]],
) -> PendingLensRequest:
    """An accepted request's lens keys as ``extra_args[INTERNAL_KEY]`` under a fresh key, and
    what to fetch when it ends."""
    prompt_len = len(request.prompt_token_ids or [])
    hooks, local_ids = encode_hooks(lens.hooks)
    probes = [encode_probe(probe) for probe in lens.probes]  # once per distinct probe
    steering = [encode_steering(vec) for vec in lens.steering]  # once per distinct vector
    remember_probes(extra, lens.probes)  # accepted: its probe strings are parsed once from now on
    key = uuid.uuid4().hex
    normalised = {k: v for k, v in extra.items() if k not in LENS_KEYS}
    spec: LensRequestWire = {
        "key": key,
        "capture_layers": lens.capture_layers,
        "steering": [wire_form for wire_form, _ in steering],
        "steering_digests": [digest for _, digest in steering],
        "probes": [wire_form for wire_form, _ in probes],
        "probe_digests": [digest for _, digest in probes],
        "hooks": hooks,
        "hook_set": lens.hook_set,
    }
    if readouts:
        spec["readouts"] = [item for _, item in readouts]
    if lens.capture_layers or lens.probes:
        address = HandoffTarget.address()
        if address is not None:  # the worker may write the rows here as soon as they are final
            spec["handoff"] = address
    normalised[INTERNAL_KEY] = spec
    params.extra_args = normalised  # a fresh dict: the caller's params stay untouched
    compat.admission.set_request_cache_salt(request, key)
    if lens.hooks or lens.hook_set is not None:
        compat.admission.recompute_from_scratch(params)
    return PendingLensRequest(
        key,
        tuple(lens.capture_layers),
        tuple(probe.name for probe in lens.probes),
        prompt_len,
        has_hooks=bool(lens.hooks),
        hook_set=lens.hook_set,
        local_ids=tuple(local_ids),
        encoding=lens.encoding,
        charge=charge,
        readouts=tuple(
            (item["name"], item["kind"], tuple(item["layers"]) if item["kind"] == "lens" else (item["layer"],)) for _, item in readouts
        ),
    )
