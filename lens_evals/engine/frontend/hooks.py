"""The frontend's half of generic hooks: validated ``Hook`` objects into the worker's form
(``protocol.HookWire``), and the hooks' results joined for ``activations["saved"]``."""

from __future__ import annotations

from typing import Any

from lens_evals.engine.transport.hook_refs import forget_local, hook_reference
from lens_evals.engine.transport.protocol import HookWire
from lens_evals.request.hooks import Hook
from lens_evals.wire import formats as wire

__all__ = ["encode_hooks", "forget_local", "union_of"]


def union_of(per_hook: dict[str, Any]) -> dict[str, Any]:
    """Every hook's saved keys in one dict (``activations["saved"]``); where two hooks wrote the
    same key the later hook's value is kept (``hook_results`` keeps both)."""
    union: dict[str, Any] = {}
    for index in sorted(per_hook, key=int):
        union.update(per_hook[index])
    return union


def encode_hooks(hooks: list[Hook]) -> tuple[list[HookWire], list[str]]:
    """The worker's JSON form of validated hooks, and the local ids they hold."""
    encoded: list[HookWire] = []
    local_ids: list[str] = []
    for hook in hooks:
        ref, local_id = hook_reference(hook)
        if local_id is not None:
            local_ids.append(local_id)
        encoded.append(
            {
                "ref": ref,
                "name": hook.name,
                "layers": hook.layer_indices,
                "pre": hook.pre,
                "module": hook.module,
                "args": wire.encode_tree(hook.args, "args"),
            }
        )
    return encoded, local_ids
