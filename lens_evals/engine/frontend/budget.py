"""What lens work may hold on the device, counted at admission (the frontend side of the budget).

Each lens request is charged, before the engine sees it, the device memory the plugin takes for
it: its steering vectors and probes (decoded on the device for its whole run), its capture's
rows, gathered on the device in each step before their copy to the host, and its readouts'
weights (once per digest in flight), results and the full-vocabulary logits or SAE latents a
readout makes for a chunk of rows at a time (``Ledger``). The charges
of the requests in flight add up against ``LENS_EVALS_DEVICE_BUDGET_MIB``: a request that would
pass it is refused with HTTP 429 (retry later) and never reaches a step, where running out of
memory would fail every lens request of the batch, or kill the engine inside vLLM's kernels. A
request that alone passes the budget can never run: a 400 saying what to lower. What hooks save
on the device grows as a request runs: the worker bounds its total over the requests in flight
by the same budget (``worker.core``). On a GPU the budget is taken out of vLLM's KV cache when
the engine sizes it (``compat.worker.reserve_lens_memory``), so what is charged here exists.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from lens_evals import settings
from lens_evals.engine.transport import readout_cache
from lens_evals.request.readouts import LOGIT_CHUNK_ROWS, LensReadout, Readout, SaeReadout
from lens_evals.request.spec import LensRequest
from lens_evals.wire import formats as wire

PROBE_BYTES = 4  # probes run in float32
READOUT_BYTES = 4  # so do readouts, their weights decoded to float32


class LensBudgetExceeded(RuntimeError):
    """Admitting the request would pass the device budget now: HTTP 429, the request may retry."""

    http_status = 429


@dataclass(frozen=True)
class StepFacts:
    """What a request's device charge depends on, read from the engine's config once."""

    hidden_size: int
    activation_bytes: int  # the model's dtype
    max_step_rows: int  # the most tokens one step runs (max_num_batched_tokens)
    vocab_size: int = 0


def budget_bytes() -> int:
    return settings.DEVICE_BUDGET_MIB.in_bytes()


def reserved_bytes() -> int:
    """What an engine keeps out of vLLM's KV cache for lens work: the budget, and the worker's
    cache of readout weights between requests."""
    return budget_bytes() + settings.READOUT_CACHE_MIB.in_bytes()


@dataclass(frozen=True)
class Charge:
    """One request's share: what it holds on the device for its whole run (its steering vectors,
    probes' weights and scores, readout results), the rows and layers its capture gathers in a
    step, its readouts' weights by digest (shared by the requests that name them) and the most
    its readouts make at once while they run (``transient``: one readout runs at a time)."""

    held: int
    capture_positions: int
    capture_layers: int
    weights: tuple[tuple[str, int], ...] = ()
    transient: int = 0


def charge_of(lens: LensRequest, positions: int, facts: StepFacts, readouts: Sequence[tuple[Readout, dict[str, Any]]] = ()) -> Charge:
    """The charge of one request of ``positions`` positions (prompt + generated - 1);
    ``readouts``: its readouts with their weights resolved and their layers (the admission's)."""
    act = facts.activation_bytes
    steering = sum(int(vector.array.size) for vector in lens.steering) * act
    probes = probes_charge(len(lens.probes), positions, facts)
    layers = len(lens.capture_layers)
    results, weights, transient = readouts_charge(readouts, positions, facts)
    return Charge(steering + probes + results, positions if layers else 0, layers, weights, transient)


def readouts_charge(
    readouts: Sequence[tuple[Readout, dict[str, Any]]], positions: int, facts: StepFacts
) -> tuple[int, tuple[tuple[str, int], ...], int]:
    """(results held in a step, weights by digest, the most made at once) of a request's readouts.
    A lens makes the full-vocabulary logits of up to ``LOGIT_CHUNK_ROWS`` rows (and their
    log-softmax), an SAE the pre-activations, activations and top-k of as many rows; both read
    a float32 copy of their rows."""
    rows = min(positions, facts.max_step_rows)
    chunk = min(positions, LOGIT_CHUNK_ROWS)
    results, transient, weights = 0, 0, {}
    for readout, item in readouts:
        layers = item.get("layers") or [item.get("layer")]
        results += rows * len(layers) * 2 * readout.top_k * READOUT_BYTES
        if isinstance(readout, LensReadout):
            made = 2 * chunk * facts.vocab_size
            if (lens := readout.lens) is not None and lens.weights is not None:
                n, d = lens.weights.shape[:2]  # the worker makes zero biases when none are sent
                weights[lens.content_digest()] = lens.nbytes() + (n * d * READOUT_BYTES if lens.biases is None else 0)
        else:
            assert isinstance(readout, SaeReadout) and readout.sae is not None and readout.sae.W_enc is not None
            made = 3 * chunk * int(readout.sae.W_enc.shape[1])
            weights[readout.sae.content_digest()] = readout.sae.nbytes()  # float32 arrays, as on the device
        transient = max(transient, (made + rows * facts.hidden_size) * READOUT_BYTES)
    return results, tuple(weights.items()), transient


def refuse_alone(nbytes: int, budget: int | None = None) -> None:
    """ValueError (400) if a request that may hold ``nbytes`` on the device can never fit the
    budget (``budget``: the budget read by the caller, else read now)."""
    budget = budget_bytes() if budget is None else budget
    if nbytes > budget:
        raise ValueError(
            f"this request may hold {nbytes / 2**20:.1f} MiB on the device, over the lens budget of "
            f"{budget / 2**20:.1f} MiB (LENS_EVALS_DEVICE_BUDGET_MIB): capture fewer layers, or send fewer "
            "or smaller probes, vectors or readouts"
        )


def probes_charge(count: int, positions: int, facts: StepFacts) -> int:
    """What ``count`` probes hold on the device for a request of ``positions`` positions."""
    return count * (facts.hidden_size + min(positions, facts.max_step_rows)) * PROBE_BYTES


@dataclass
class Ledger:
    """The charges of the requests in flight. A step's capture rows are gathered on the device
    before their copy to the host: all requests' rows of one step together are at most the
    step's tokens, so captures count once, as the step's tokens (or all positions in flight, if
    fewer) times the most layers any request captures, not once per request."""

    facts: StepFacts
    held: int = 0
    capture_positions: int = 0
    layer_counts: Counter[int] = field(default_factory=Counter)
    weight_users: Counter[str] = field(default_factory=Counter)  # digest -> requests in flight naming it
    weight_bytes: dict[str, int] = field(default_factory=dict)
    transients: Counter[int] = field(default_factory=Counter)

    def in_use(self, extra: Charge | None = None) -> int:
        positions = self.capture_positions + (extra.capture_positions if extra else 0)
        layers = max([*self.layer_counts, extra.capture_layers if extra else 0], default=0)
        rows = min(positions, self.facts.max_step_rows)
        weights = {**self.weight_bytes, **dict(extra.weights if extra else ())}
        transient = max([*self.transients, extra.transient if extra else 0], default=0)
        captured = rows * layers * self.facts.hidden_size * self.facts.activation_bytes
        return self.held + (extra.held if extra else 0) + captured + sum(weights.values()) + transient

    def alone(self, charge: Charge) -> int:
        """What ``charge`` alone holds: :meth:`in_use` of an empty ledger with it (without
        making one: this runs for every request)."""
        facts = self.facts
        captured = min(charge.capture_positions, facts.max_step_rows) * charge.capture_layers * facts.hidden_size
        return charge.held + captured * facts.activation_bytes + sum(dict(charge.weights).values()) + charge.transient

    def admit(self, charge: Charge) -> None:
        """Count ``charge`` in, or raise: ValueError (400) if the request alone never fits the
        budget, LensBudgetExceeded (429) if it does not fit beside the requests in flight."""
        budget = budget_bytes()
        refuse_alone(self.alone(charge), budget)
        if (total := self.in_use(charge)) > budget:
            raise LensBudgetExceeded(
                f"lens requests in flight hold {self.in_use() / 2**20:.1f} of the {budget / 2**20:.1f} MiB device "
                f"budget (LENS_EVALS_DEVICE_BUDGET_MIB); with this one {total / 2**20:.1f} MiB: retry when some have finished"
            )
        self.held += charge.held
        self.capture_positions += charge.capture_positions
        if charge.capture_layers:
            self.layer_counts[charge.capture_layers] += 1
        for digest, nbytes in charge.weights:
            self.weight_users[digest] += 1
            self.weight_bytes[digest] = nbytes
            readout_cache.hold(digest)  # their file (if any) stays while the request runs
        if charge.transient:
            self.transients[charge.transient] += 1

    def release(self, charge: Charge) -> None:
        self.held -= charge.held
        self.capture_positions -= charge.capture_positions
        _drop(self.layer_counts, charge.capture_layers)
        for digest, _ in charge.weights:
            readout_cache.release(digest)
            if _drop(self.weight_users, digest):
                del self.weight_bytes[digest]
        _drop(self.transients, charge.transient)


def _drop(counts: Counter[Any], key: Any) -> bool:
    """One use of ``key`` less (nothing for a falsy key); True when it was the last."""
    if not key:
        return False
    counts[key] -= 1
    if counts[key] <= 0:
        del counts[key]
        return True
    return False


# Copies a served response's rows have while it is written: the fetched rows, and their encoded
# form (the binary frame sends the rows' own buffers; the JSON forms build base64 text and the JSON
# bytes around it, ~3x the rows).
COPIES = {"safetensors-frame": 1.0}
JSON_COPIES = 3.0


def response_charge(results: Any, encoding: str) -> int:
    """What a served response's lens results hold on the frontend until it is written."""
    return int(wire.array_bytes(results) * (1.0 + COPIES.get(encoding, JSON_COPIES)))


class HeldResponses:
    """Bytes of lens results the frontend holds for HTTP responses not yet written to their
    clients (a slow reader pins them), against ``LENS_EVALS_MAX_RESPONSE_HELD_MIB``: past it, new
    lens requests get 429 until responses have gone out."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.held = 0

    def add(self, nbytes: int) -> None:
        with self._lock:
            self.held += nbytes

    def release(self, nbytes: int) -> None:
        with self._lock:
            self.held -= nbytes

    def admit(self) -> None:
        bound = settings.MAX_RESPONSE_HELD_MIB.in_bytes()
        if self.held > bound:
            raise LensBudgetExceeded(
                f"lens responses not yet written to their clients hold {self.held / 2**20:.1f} MiB on the server, over "
                f"{bound / 2**20:.1f} MiB (LENS_EVALS_MAX_RESPONSE_HELD_MIB): retry when they have been read"
            )


RESPONSES = HeldResponses()
