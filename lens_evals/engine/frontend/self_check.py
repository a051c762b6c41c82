"""The stream-contract self-check at engine start, on the loaded model itself (no HF).

The architecture matrix proves each decoder-layer class's contract (``compat.architectures``)
on tiny fp32 models against HF; this checks it on the checkpoint a user actually loaded
(its dtype, quantisation, parallelism), through the engine's own lens features, right after
the engine is built (offline ``LLM``) or at the first lens request (``AsyncLLM``, the server).
One short prompt, two rounds of requests; at a first, a middle and the last layer (every verified
model has one decoder-layer class):

* **identity**: the stream captured at layer L, written back unchanged (the built-in ``patch``
  hook with the captured rows) must leave the prompt log-probs where a plain request has them
  (largest absolute difference; bound: the dtype's floor). A read that misses part of the
  stream writes the wrong stream back.
  In half precision a fused-residual layer's stream is written back as one rounded sum where the
  next layer would have added hidden and residual in float32 (vLLM's CPU kernels; the GPU's round
  the sum first): a right contract then moves the log-probs by rounding alone, which grows with
  depth. So there the identity's bound is also ``ROUNDING_FACTOR`` times what a rounding-sized
  random change of the stream at the same layer (half an ulp of the dtype per element, added by
  steering, which adds to the stream whatever the contract) moves them (the **rounding**
  control); a wrong read writes back the wrong stream and moves them far more.
* **handoff**: the capture at layer L must equal what layer L + 1 reads (``record`` with
  ``pre=True``; at the last layer: capture at L - 1 vs the input of L), largest per-token
  relative error.
* **steer** (last layer): steering every prompt row by its own captured stream (the stream
  doubled) must leave the log-probs unchanged, as the model's final norm predicts (RMSNorm and
  LayerNorm are invariant to scaling their input, whatever their weights, bias or offset and
  whatever unembedding, tying, logit scaling or soft-capping follows); a random vector of the
  same size per row must move them (the write reaches the stream). The number: the doubled
  stream's movement over the random vector's. A wrong read (the layer's output without its
  residual, say) doubles only part of the stream, which moves the logits like the control.
  Why not ``logit_lens`` or the gathered weights: both assume a final RMSNorm with Llama's
  names and no logit scaling, wrong for LayerNorm models (GPT-2, StableLM, ...), Gemma's
  offset norm and soft-capping, Cohere's and Granite's logit scales (false alarms), and the
  weights are GBs to move on real models.

Graph mode runs what it supports: identity by steering with zeros, no handoff (no hooks).
A failure refuses lens requests with the numbers (plain requests are served);
``LENS_EVALS_SELF_CHECK=0`` skips it. vLLM internals stay in ``compat``.
"""

from __future__ import annotations

import contextvars
import dataclasses
import logging
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch

from lens_evals import settings
from lens_evals.request.hooks import Hook
from lens_evals.request.spec import SteeringVector

logger = logging.getLogger("lens_evals")

PROMPT = "The quick brown fox jumps over the lazy dog. A model reads the stream, layer by layer, and writes it back."
# (identity: largest |log-prob change|, handoff: largest per-token relative error) per dtype
FLOORS = {"float32": (1e-4, 1e-6), "float16": (2e-2, 4e-3), "bfloat16": (1e-1, 3e-2)}
STEER_BOUND = 1e-2  # doubled stream's log-prob movement / a random vector's (measured: see docs/model_support.md)
# in half precision the doubled stream's rounding moves the log-probs too (tiny-llama in bfloat16
# on the CPU: 1.2e-2, a right contract); wrong contracts measured 0.56-0.92
STEER_BOUNDS = {"float32": STEER_BOUND, "float16": 5e-2, "bfloat16": 1e-1}
HALF = {"float16": 2.0**-10, "bfloat16": 2.0**-7}  # the ulp at 1.0 (torch.finfo(dtype).eps)
CONTROL_MIN = 1e-2  # the random vector must move some log-prob by at least this
ROUNDING_FACTOR = 4.0  # half precision: identity <= this x a rounding-sized change's movement passes
_RUNNING: contextvars.ContextVar[bool] = contextvars.ContextVar("lens_evals_self_check_running", default=False)


@dataclass(frozen=True)
class LayerCheck:
    """One checked layer's numbers (NaN: not measured there)."""

    layer: int
    identity: float
    handoff: float
    steer: float = math.nan
    control: float = math.nan  # the random vector's log-prob movement (last layer)
    passed: bool = True
    rounding: float = math.nan  # half precision: a rounding-sized change's movement (the rounding control)

    def identity_bound(self, dtype: str) -> float:
        """The dtype's floor, or in half precision ``ROUNDING_FACTOR`` x the rounding control if larger."""
        floor = bounds(dtype)[0]
        return floor if math.isnan(self.rounding) else max(floor, ROUNDING_FACTOR * self.rounding)

    @property
    def steer_inconclusive(self) -> bool:
        """The logits barely depend on the stream (a random vector of its size moves no log-prob
        by CONTROL_MIN: vLLM's ``load_format=dummy`` weights, say): the steer check cannot tell a
        right contract from a wrong one there, so it neither passes nor fails the layer."""
        return self.control < CONTROL_MIN


@dataclass
class SelfCheck:
    """The outcome: ``error`` when a request of the check itself failed; ``passed`` else."""

    architecture: str
    dtype: str
    layers: list[LayerCheck] = field(default_factory=list)
    error: str | None = None
    skipped: str | None = None
    seconds: float = 0.0

    @property
    def passed(self) -> bool:
        return self.error is None and all(layer.passed for layer in self.layers)

    def refusal(self) -> str | None:
        """Why lens requests are refused (None: the check passed or did not run)."""
        if self.skipped is not None or self.passed:
            return None
        what = self.error or "; ".join(describe(layer, self.dtype) for layer in self.layers if not layer.passed)
        return (
            f"lens requests are refused on this engine: the stream-contract self-check at engine start failed on "
            f"{self.architecture} ({self.dtype}): {what}. The decoder layer's contract "
            "(lens_evals/engine/compat/architectures.py) does not hold for this checkpoint, so captures and steering "
            f"would be wrong; plain requests are served. {settings.SELF_CHECK.name}=0 skips the check"
        )

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["passed"] = self.passed
        data["inconclusive"] = self.inconclusive
        data["bounds"] = {
            "identity": bounds(self.dtype)[0],
            "handoff": bounds(self.dtype)[1],
            "steer": steer_bound(self.dtype),
            "control_min": CONTROL_MIN,
        }
        finite: dict[str, Any] = _finite(data)
        return finite

    def table(self) -> str:
        head = f"self-check of {self.architecture} ({self.dtype}), {self.seconds:.1f} s: "
        if self.skipped is not None:
            return head + f"not run ({self.skipped})"
        identity, handoff = bounds(self.dtype)
        lines = [head + ("PASS" if self.passed else "FAIL"), "layer  identity   handoff    steer      result"]
        lines += [f"{c.layer:<6} {_num(c.identity)}  {_num(c.handoff)}  {_num(c.steer)}  {_verdict(c)}" for c in self.layers]
        lines.append(f"bounds {_num(identity)}  {_num(handoff)}  {_num(steer_bound(self.dtype))}")
        measured = [c for c in self.layers if not math.isnan(c.rounding)]
        if measured:
            parts = [f"layer {c.layer} {c.rounding:.2e} (identity bound {c.identity_bound(self.dtype):.2e})" for c in measured]
            lines.append("rounding control (a rounding-sized change): " + ", ".join(parts))
        if self.error:
            lines.append(f"error: {self.error}")
        lines += [f"note: {describe(c, self.dtype)}" for c in self.layers if c.passed and c.steer_inconclusive]
        return "\n".join(lines)

    @property
    def inconclusive(self) -> bool:
        """Passed, but the steer check could not judge (see LayerCheck.steer_inconclusive)."""
        return self.passed and any(c.steer_inconclusive for c in self.layers)


def steer_bound(dtype: str) -> float:
    return STEER_BOUNDS.get(dtype, STEER_BOUNDS["bfloat16"])


def bounds(dtype: str) -> tuple[float, float]:
    return FLOORS.get(dtype, FLOORS["bfloat16"])


def describe(check: LayerCheck, dtype: str) -> str:
    identity, handoff = bounds(dtype)
    bound = f"floor {identity:.0e}"
    if not math.isnan(check.rounding):
        bound += f", or {ROUNDING_FACTOR:g} x a rounding-sized change's {check.rounding:.2e}"
    parts = [f"identity {check.identity:.2e} ({bound})", f"handoff {check.handoff:.2e} (floor {handoff:.0e})"]
    if check.steer_inconclusive:
        parts.append(
            f"steer not judged: a random vector of the stream's size moved the log-probs only {check.control:.2e} "
            f"(< {CONTROL_MIN:.0e}), so the logits barely depend on the stream (random or dummy weights?)"
        )
    elif not math.isnan(check.steer):
        parts.append(
            f"steer {check.steer:.2e} (bound {steer_bound(dtype):.0e}; control moved {check.control:.2e}, needs {CONTROL_MIN:.0e})"
        )
    return f"layer {check.layer}: " + ", ".join(parts)


def _verdict(check: LayerCheck) -> str:
    if not check.passed:
        return "FAIL"
    return "pass (steer not judged)" if check.steer_inconclusive else "pass"


def _num(value: float) -> str:
    return "n/a      " if math.isnan(value) else f"{value:.2e} "


def _finite(value: Any) -> Any:
    """NaN as None (JSON has no NaN)."""
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


# ----------------------------------------------------------------- the requests
@dataclass(frozen=True)
class Request:
    extra: dict[str, Any] | None
    logprobs: bool


def checked_layers(num_layers: int) -> list[int]:
    return sorted({0, num_layers // 2, num_layers - 1})


def _neighbour(layer: int, num_layers: int) -> tuple[int, int]:
    """(layer whose capture, layer whose input) must agree for a checked layer."""
    return (layer, layer + 1) if layer + 1 < num_layers else (layer - 1, layer)


class Plan:
    """The check's two rounds for a model of ``num_layers`` (``tapped``: graph mode's layers)."""

    def __init__(self, num_layers: int, tapped: list[int] | None) -> None:
        self.num_layers, self.graph = num_layers, tapped is not None
        self.layers = checked_layers(num_layers)
        if tapped is not None:
            self.layers = [layer for layer in self.layers if layer in tapped]
        self.last = num_layers - 1
        pairs = [_neighbour(layer, num_layers) for layer in self.layers if num_layers > 1] if not self.graph else []
        self.pairs = dict(zip(self.layers, pairs)) if pairs else {}
        self.capture = sorted(set(self.layers) | {a for a, _ in self.pairs.values()})
        self.pre = sorted({b for _, b in self.pairs.values()})

    def has_rounding_control(self, dtype: str) -> bool:
        """Half precision in eager mode (graph mode's identity is steering by zeros: exact)."""
        return dtype in HALF and not self.graph

    def first_round(self) -> list[Request]:
        extra: dict[str, Any] = {"output_residual_stream": self.capture}
        if self.pre:
            extra["apply_hooks"] = [Hook("record", [layer], pre=True) for layer in self.pre]
        return [Request(extra, False)]

    def second_round(self, stream: torch.Tensor, prompt_len: int, hidden: int, seed: int = 0, dtype: str = "float32") -> list[Request]:
        """Plain, identity per layer, doubled and control at the last layer, then (half
        precision, eager) the rounding control per layer (``stream``: the first round's capture,
        (capture layers, prompt_len, hidden))."""
        positions = list(range(prompt_len))
        requests = [Request(None, True)]
        for layer in self.layers:
            rows = stream[self.capture.index(layer)].float().numpy()
            if self.graph:
                zero = SteeringVector(activations=np.zeros((1, hidden), np.float32), layer_indices=[layer])
                requests.append(Request({"apply_steering_vectors": [zero]}, True))
            else:
                requests.append(Request({"apply_hooks": [Hook("patch", [layer], args={"positions": positions, "values": rows})]}, True))
        if self.last in self.layers:
            rows = stream[self.capture.index(self.last)].float().numpy()
            direction = np.random.default_rng(seed).normal(size=rows.shape).astype(np.float32)
            control = direction * (np.linalg.norm(rows, axis=-1, keepdims=True) / np.linalg.norm(direction, axis=-1, keepdims=True))
            for vectors in (rows, control):
                steer = SteeringVector(activations=vectors[None], layer_indices=[self.last], position_indices=positions)
                requests.append(Request({"apply_steering_vectors": [steer]}, True))
        if self.has_rounding_control(dtype):
            rng, ulp = np.random.default_rng(seed + 1), HALF[dtype]
            for layer in self.layers:
                rows = stream[self.capture.index(layer)].float().numpy()
                nudge = np.abs(rows) * (ulp / 2) * rng.choice([-1.0, 1.0], size=rows.shape).astype(np.float32)
                steer = SteeringVector(activations=nudge[None], layer_indices=[layer], position_indices=positions)
                requests.append(Request({"apply_steering_vectors": [steer]}, True))  # added, whatever the contract
        return requests

    def measure(self, first: Any, second: list[Any], prompt_ids: Sequence[int], dtype: str) -> list[LayerCheck]:
        """The numbers from the outputs of both rounds (``second`` in :meth:`second_round`'s order)."""
        stream = first.activations["residual_stream"]
        saved = (first.hook_results or {}) if self.pre else {}
        plain = prompt_logprobs(second[0], prompt_ids)
        handoff_floor = bounds(dtype)[1]
        moved = [float((prompt_logprobs(out, prompt_ids) - plain).abs().max()) for out in second[1:]]
        steered = len(self.layers) + (2 if self.last in self.layers else 0)  # identities, then doubled and control
        rounding = moved[steered:] if self.has_rounding_control(dtype) else [math.nan] * len(self.layers)
        checks = []
        for i, layer in enumerate(self.layers):
            handoff = math.nan
            if layer in self.pairs:
                source, reader = self.pairs[layer]
                got = _saved_rows(saved, self.pre.index(reader), reader)
                handoff = token_error(stream[self.capture.index(source)], got)
            steer = control = math.nan
            if layer == self.last:
                control = moved[len(self.layers) + 1]
                steer = moved[len(self.layers)] / max(control, 1e-30)
            check = LayerCheck(layer, moved[i], handoff, steer, control, rounding=rounding[i])
            ok = moved[i] <= check.identity_bound(dtype) and not handoff > handoff_floor
            if layer == self.last and control >= CONTROL_MIN:  # below: not judged (LayerCheck.steer_inconclusive)
                ok = ok and steer <= steer_bound(dtype)
            checks.append(dataclasses.replace(check, passed=ok))
        return checks


def _saved_rows(saved: dict[str, Any], index: int, layer: int) -> torch.Tensor:
    """The rows the ``record`` hook (the ``index``-th hook of the request) saved at ``layer``."""
    results = saved.get(str(index), saved)
    rows: torch.Tensor = results[f"rows.{layer}"]
    return rows


def token_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    """Largest per-token relative error ``||got - ref|| / ||ref||``."""
    got, ref = got.double(), ref.double()
    if got.shape != ref.shape:
        return math.inf
    return float(((got - ref).norm(dim=-1) / ref.norm(dim=-1).clamp_min(1e-30)).max())


def prompt_logprobs(output: Any, prompt_ids: Sequence[int]) -> torch.Tensor:
    """log p(token t | tokens < t) of each prompt token after the first."""
    entries = output.prompt_logprobs or []
    return torch.tensor([entry[token].logprob for entry, token in zip(entries[1:], prompt_ids[1:])], dtype=torch.float64)
