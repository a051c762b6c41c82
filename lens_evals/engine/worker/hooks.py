"""The worker's half of generic hooks: a request's hooks decoded (references resolved, args
on the device), the context a hook sees, running one request's hooks on its rows and putting a
returned tensor back into the stream."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from lens_evals.engine import compat
from lens_evals.engine.transport.hook_refs import resolve
from lens_evals.engine.transport.protocol import HookWire
from lens_evals.engine.worker.transfer import to_device
from lens_evals.wire import formats as wire

logger = logging.getLogger("lens_evals")


@dataclass
class WorkerHook:
    name: str
    fn: Callable[..., Any]
    layers: list[int]
    pre: bool
    module: str | None
    args: dict[str, Any]


def decode_hooks(items: list[HookWire] | list[Mapping[str, Any]], device: torch.device) -> list[WorkerHook]:
    def on_device(array: np.ndarray) -> torch.Tensor:
        return to_device(array, device)

    return [
        WorkerHook(
            name=str(item["name"]),
            fn=resolve(str(item["ref"])),
            layers=[int(i) for i in item["layers"]],
            pre=bool(item["pre"]),
            module=item.get("module"),
            args=wire.decode_tree(item.get("args") or {}, on_device),
        )
        for item in items
    ]


@dataclass
class HookCall:
    """One hook on one request's rows ``[start, stop)`` of this step at one layer."""

    key: str
    hook: WorkerHook
    start: int
    stop: int
    positions: torch.Tensor
    token_ids: torch.Tensor | None
    saved: dict[str, Any]


@dataclass
class HookContext:
    """What a hook sees besides the rows: ``saved`` is this hook's own dict for this request,
    kept across layers and steps (it comes back as ``output.hook_results[str(index)]``), ``positions`` / ``token_ids`` are the rows' absolute
    positions and input token ids, ``args`` the hook's arguments (arrays as device tensors)."""

    saved: dict[str, Any]
    layer_idx: int
    positions: torch.Tensor
    token_ids: torch.Tensor | None
    args: dict[str, Any]
    pre: bool
    module_path: str | None
    model: nn.Module
    hf_config: Any
    parameters: ParameterCache = field(repr=False)

    @property
    def seq_len(self) -> int:
        """The number of rows this call sees (this step's tokens of the request)."""
        return int(self.positions.shape[0])

    @property
    def tp_rank(self) -> int:
        return compat.worker.parallel_ranks()[0]

    def get_parameter(self, name: str) -> torch.Tensor:
        """A model parameter by vLLM's name (e.g. "model.layers.3.mlp.down_proj.weight"), whole:
        gathered across tensor-parallel ranks (a collective: every rank's hook must ask too)."""
        return self.parameters.get(name)


class ParameterCache:
    """Whole parameters asked for by hooks, kept after the first gather."""

    def __init__(self, model: nn.Module, checkpoint: str | None) -> None:
        self.model = model
        self.checkpoint = checkpoint
        self.cache: dict[str, torch.Tensor] = {}

    def get(self, name: str) -> torch.Tensor:
        if name not in self.cache:
            self.cache[name] = compat.worker.gathered_parameter(self.model, name, self.checkpoint)
        return self.cache[name]


def run_calls(
    calls: list[HookCall],
    stream_of: Callable[[int, int], torch.Tensor],
    put: Callable[[int, int, torch.Tensor], None],
    layer: int,
    make_context: Callable[[HookCall, int], HookContext],
    fail: Callable[[str, str], None],
    failed: Callable[[str], bool],
) -> None:
    """Run each call on a copy of its rows; a returned tensor replaces them. An exception or a
    bad return value fails that call's request alone."""
    for call in calls:
        if failed(call.key):
            continue
        given = stream_of(call.start, call.stop)
        try:
            result = call.hook.fn(make_context(call, layer), given)
            if result is None:
                continue
            if not isinstance(result, torch.Tensor) or result.shape != given.shape:
                shape = tuple(result.shape) if isinstance(result, torch.Tensor) else type(result).__name__
                raise ValueError(f"returned {shape}; a hook returns None or a tensor of shape {tuple(given.shape)}")
            put(call.start, call.stop, result)
        except Exception as exc:  # noqa: BLE001 - the hook is user code: its request fails, the engine goes on
            where = f"layer {layer}{' ' + call.hook.module if call.hook.module else ''}{' (pre)' if call.hook.pre else ''}"
            logger.warning("lens_evals: hook %s failed at %s: %s", call.hook.name, where, exc)
            fail(call.key, f"hook {call.hook.name} failed at {where}: {type(exc).__name__}: {exc}")
