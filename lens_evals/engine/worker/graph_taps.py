"""Graph mode: capture, steering and probes with torch.compile and CUDA graphs kept on.

Python forward hooks cannot make per-request decisions inside a captured CUDA graph: the graph
replays the kernels it recorded. In graph mode every tapped layer therefore runs the same fixed
op at every step, ``lens_evals::tap_stream``, traced into the compiled graph:

    hidden' = hidden + steer[:n]              (n = the step's, possibly padded, token rows)
    capture[:n] = hidden' + residual          (the residual stream after the layer)

``steer`` and ``capture`` are static buffers of the layer (``max rows x hidden``, allocated once
at model load, before vLLM measures memory). Per-request work stays outside the graph, on the
host side of each step: before the forward the rows of steered requests are written into
``steer`` (nothing to write when a decode step reuses the last plan), after it the captured
and probed rows are read out of ``capture`` — the same plan, gathers and host store as eager
mode. Rows of other requests see an exact ``+ 0``.

What graph mode cannot do (refused per request with a clear error): layers that were not
tapped at start, ``norm_match`` steering (it needs the live row norm), generic hooks.
Turn it on with ``LENS_EVALS_GRAPH_LAYERS=16`` (or ``8,16`` or ``all``) or vLLM's
``additional_config={"lens_evals": {"graph_layers": [16]}}``; it is part of vLLM's compile
cache key, so graphs compiled with other taps (or none) are never reused.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from lens_evals import settings
from lens_evals.engine import compat
from lens_evals.engine.transport.graph_layers import GRAPH_LAYERS_ENV

logger = logging.getLogger("lens_evals")

CAPTURE_BUFFER = "lens_evals_capture"
STEER_BUFFER = "lens_evals_steer"


@torch.library.custom_op("lens_evals::tap_stream", mutates_args=("capture",))
def tap_stream(hidden: torch.Tensor, residual: torch.Tensor | None, steer: torch.Tensor, capture: torch.Tensor) -> torch.Tensor:
    rows = hidden.shape[0]
    steered = hidden + steer[:rows]
    if residual is None:
        capture[:rows].copy_(steered)
    else:
        torch.add(steered, residual, out=capture[:rows])
    return steered


@tap_stream.register_fake
def _tap_stream_fake(hidden: torch.Tensor, residual: torch.Tensor | None, steer: torch.Tensor, capture: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(hidden)


def graph_refusal(support: Any) -> str | None:
    """Graph mode relies on the architecture's contract inside a compiled graph. It runs on an
    architecture verified in graph mode (``graph_mode`` in the table), on any other verified one
    while the self-check is on (it runs in graph mode on the loaded engine before the first lens
    request and refuses lens requests if the contract does not hold there), or on any with
    LENS_EVALS_TRUST_ARCH=1."""
    entry = compat.architectures.VERIFIED.get(support.architecture)
    if entry is not None and (entry.graph_mode or settings.SELF_CHECK.get()):
        return None
    if compat.architectures.trust_unverified():
        return None
    if entry is not None:
        return (
            f"graph mode ({GRAPH_LAYERS_ENV}) is not verified on architecture {support.architecture} and the "
            f"self-check that would verify it on this engine is off: start with {settings.SELF_CHECK.name}=1, "
            f"or without graph mode (eager hooks), or set {compat.architectures.TRUST_ENV}=1 at your own risk"
        )
    return (
        f"graph mode ({GRAPH_LAYERS_ENV}) is not verified on architecture {support.architecture}: start the "
        f"engine without it (eager hooks), or set {compat.architectures.TRUST_ENV}=1 at your own risk"
    )


class GraphTaps:
    """The static buffers of the tapped layers of one worker, and the host side of each step."""

    def __init__(
        self,
        layer_modules: dict[int, nn.Module],
        layers: list[int],
        max_rows: int,
        hidden_size: int,
        dtype: torch.dtype,
        device: torch.device,
        contract: compat.architectures.StreamContract,
    ) -> None:
        self.steer: dict[int, torch.Tensor] = {}
        self.capture: dict[int, torch.Tensor] = {}
        self._dirty_rows: dict[int, int] = {}  # rows of ``steer`` written and not cleared since
        self._written: Any = None  # the plan whose steering rows ``steer`` holds
        for index in layers:
            layer = layer_modules.get(index)
            if layer is None:  # on another pipeline stage
                continue
            steer = torch.zeros(max_rows, hidden_size, dtype=dtype, device=device)
            capture = torch.zeros(max_rows, hidden_size, dtype=dtype, device=device)
            layer.register_buffer(STEER_BUFFER, steer, persistent=False)
            layer.register_buffer(CAPTURE_BUFFER, capture, persistent=False)
            layer.register_forward_hook(_graph_tap(contract))
            self.steer[index], self.capture[index] = steer, capture
        logger.info(
            "lens_evals: graph mode, layers %s tapped (%d rows, %.0f MiB of buffers)",
            sorted(self.steer),
            max_rows,
            2 * len(self.steer) * max_rows * hidden_size * torch.finfo(dtype).bits / 8 / 2**20,
        )

    def before_forward(self, plan: Any) -> None:
        """Write the step's steering rows (``plan`` None: no lens request, clear what is left)."""
        steer_plan = plan.steer if plan is not None else {}
        if plan is not None and plan is self._written and plan.reusable:
            return  # a decode step reusing the last plan: the rows are already in place
        for layer, rows in list(self._dirty_rows.items()):
            self.steer[layer][:rows].zero_()
            del self._dirty_rows[layer]
        for layer, steer in steer_plan.items():
            delta = (steer.delta if steer.delta is not None else steer.vectors * steer.scale).to(self.steer[layer].dtype)
            if steer.span is not None:  # contiguous rows, each once
                self.steer[layer][steer.span[0] : steer.span[1]].copy_(delta)
            else:  # rows may repeat (two vectors on one request): they add up, as in eager mode
                self.steer[layer].index_add_(0, steer.rows, delta)
            self._dirty_rows[layer] = steer.row_stop
        self._written = plan

    def stream(self, layer: int, num_rows: int) -> torch.Tensor:
        """The step's residual stream after ``layer`` (valid until the next forward is queued)."""
        return self.capture[layer][:num_rows]


def _graph_tap(contract: compat.architectures.StreamContract) -> Any:
    def tap(module: nn.Module, args: Any, output: Any) -> Any:
        hidden, residual = contract.read_output(output)
        steered = torch.ops.lens_evals.tap_stream(hidden, residual, getattr(module, STEER_BUFFER), getattr(module, CAPTURE_BUFFER))
        return contract.write_output(output, steered)

    return tap
