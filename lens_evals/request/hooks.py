"""Generic hooks, request side (no vllm, no torch needed).

A :class:`Hook` runs ``fn(ctx, hidden) -> Tensor | None`` on one request's rows at each layer
in ``layer_indices`` (see ``lens_evals.engine.worker.hooks.HookContext`` for ``ctx``). ``fn`` is

* a Python callable: offline only (``SamplingParams.extra_args``), the user's own code in the
  user's own process. A module-level function travels to the worker as its import name, so it
  works with the multiprocess engine too; a lambda, closure or method works only when the worker
  runs in the same process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), else the request fails with
  a message saying so.
* a registered name (a string): a function the operator registered at start-up, through the
  ``lens_evals.request.hooks`` entry point group or ``LENS_EVALS_HOOKS="name=module:function,..."``,
  plus the built-ins of :mod:`lens_evals.request.hook_library`. This is the only form a server accepts
  (JSON can only name hooks, never carry code), with JSON ``args``.
"""

from __future__ import annotations

import functools
import importlib
import json
import re
from collections.abc import Callable, Mapping
from dataclasses import field
from importlib.metadata import entry_points
from typing import Any, NamedTuple

from pydantic import ConfigDict, field_validator
from pydantic.dataclasses import dataclass

from lens_evals import settings
from lens_evals.wire import formats as wire

HOOKS_ENV = settings.HOOKS.name
ENTRY_POINT_GROUP = "lens_evals.request.hooks"
BUILTIN_HOOKS = {
    "ablate": "lens_evals.request.hook_library:ablate",
    "add": "lens_evals.request.hook_library:add",
    "patch": "lens_evals.request.hook_library:patch",
    "record": "lens_evals.request.hook_library:record",
    "record_norm": "lens_evals.request.hook_library:record_norm",
    "logit_lens": "lens_evals.request.hook_library:logit_lens",
}
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.\-]{0,127}$")
_MODULE_PATH = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z0-9_]+)*$")
_WIRE_FIELDS = {"name", "layer_indices", "pre", "module", "args"}
CODE_REFUSED = (
    "this server never runs code sent over the network, so a hook given as a (cloudpickled) "
    "function 'fn' is refused. Register the function by name on the server instead: start it with "
    "LENS_EVALS_HOOKS=\"my_hook=my_package.my_module:my_function\" (or the 'lens_evals.request.hooks' entry "
    'point group), then send {"name": "my_hook", "layer_indices": [...], "args": {...}} '
    '(lens_evals.Hook("my_hook", [...])). Built-in hooks: '
)
MAX_HOOK_LAYERS = 4096


def code_refused() -> str:
    """Why a hook given as code is refused, and how to register it by name instead."""
    return CODE_REFUSED + ", ".join(sorted(BUILTIN_HOOKS)) + " (see docs/vllm_lens.md)"


@dataclass(frozen=True, config=ConfigDict(arbitrary_types_allowed=True))
class Hook:
    """``Hook(fn, layer_indices, pre=False, module=None, args={})``.

    ``pre=False``: ``hidden`` is the residual stream after the layer (what a capture returns);
    ``pre=True``: the layer's input (the residual stream after the previous layer, or the
    embeddings at layer 0). With ``module`` (a path inside the decoder layer, e.g.
    ``"mlp.down_proj"``) the hook sees that module's first input (``pre``) or its output instead
    (under tensor parallelism: this rank's shard). Returning a tensor of the same shape replaces
    the rows. ``args`` (JSON values and arrays) reach the hook as ``ctx.args``, arrays as tensors
    on the model's device."""

    fn: Callable[..., Any] | str
    layer_indices: list[int]
    pre: bool = False
    module: str | None = None
    args: dict[str, Any] = field(default_factory=dict)

    @field_validator("fn")
    @classmethod
    def _fn(cls, value: Any) -> Any:
        if isinstance(value, str) and not _NAME.match(value):
            raise ValueError(f"hook name {value!r} is not a valid name")
        return value

    @field_validator("layer_indices")
    @classmethod
    def _layers(cls, value: list[int]) -> list[int]:
        if not value:
            raise ValueError("layer_indices must not be empty")
        if len(value) > MAX_HOOK_LAYERS:
            raise ValueError(f"too many layer indices ({len(value)})")
        if any(isinstance(i, bool) or i < 0 for i in value):
            raise ValueError(f"layer_indices must be integers >= 0, got {value}")
        if len(set(value)) != len(value):
            raise ValueError(f"layer_indices has duplicates: {value}")
        return sorted(value)

    @field_validator("module")
    @classmethod
    def _module(cls, value: str | None) -> str | None:
        if value is not None and not _MODULE_PATH.match(value):
            raise ValueError(f"module {value!r} is not a dotted attribute path like 'mlp.down_proj'")
        return value

    @field_validator("args")
    @classmethod
    def _args(cls, value: dict[str, Any]) -> dict[str, Any]:
        try:
            wire.encode_tree(value, "args")  # refuse what could not reach the worker
        except wire.WireError as exc:
            raise ValueError(str(exc)) from None
        return value

    @property
    def name(self) -> str:
        if isinstance(self.fn, str):
            return self.fn
        return f"{getattr(self.fn, '__module__', '?')}:{getattr(self.fn, '__qualname__', repr(self.fn))}"

    @property
    def registered(self) -> bool:
        return isinstance(self.fn, str)

    def to_wire(self) -> dict[str, Any]:
        """JSON form (registered hooks only: code never travels as JSON)."""
        if not self.registered:
            raise ValueError(f"hook {self.name} is a Python callable, which has no JSON form: {code_refused()}")
        return {
            "name": self.fn,
            "layer_indices": self.layer_indices,
            "pre": self.pre,
            "module": self.module,
            "args": wire.encode_tree(self.args, "args"),
        }

    def to_json(self) -> str:
        return json.dumps(self.to_wire())

    def model_dump(self) -> dict[str, Any]:
        """:meth:`to_wire` under the name vllm-lens's ``Hook`` gives it (its client sends
        ``hook.model_dump()``): a Python callable is refused before anything is sent, saying how
        to register it by name."""
        return self.to_wire()

    @classmethod
    def from_wire(cls, payload: Any, bound: wire.Bound = wire.UNBOUNDED) -> Hook:
        """A Hook object, or the JSON form (dict or string) of a registered hook (each array of
        its args refused unread if it declares more than ``bound``)."""
        if isinstance(payload, Hook):
            return payload
        if isinstance(payload, str):
            payload = wire.json_object(payload, "hook", _WIRE_FIELDS | {"fn"})
        if isinstance(payload, Mapping) and "fn" in payload:
            raise ValueError(code_refused())
        payload = wire.json_object(payload, "hook", _WIRE_FIELDS)
        if not isinstance(payload.get("name"), str):
            raise ValueError("a hook in JSON form needs 'name': the name of a registered hook")
        try:
            args = wire.decode_tree(payload.get("args") or {}, bound=bound)
        except wire.WireError as exc:
            raise ValueError(f"hook args: {exc}") from None
        if not isinstance(args, dict):
            raise ValueError("hook args must be an object")
        return cls(
            fn=payload["name"],
            layer_indices=payload.get("layer_indices"),
            pre=payload.get("pre", False),
            module=payload.get("module"),
            args=args,
        )


# --------------------------------------------------------------------------- registry
def hook_registry() -> dict[str, str]:
    """Registered hook names -> "module:function": built-ins, then the entry point group
    ``lens_evals.request.hooks``, then ``LENS_EVALS_HOOKS`` (later ones override earlier ones).
    Entry points are read once per process (installing a package needs a restart)."""
    return dict(_registry_for(settings.HOOKS.get()))


@functools.lru_cache(maxsize=1)
def _entry_point_hooks() -> tuple[tuple[str, str], ...]:
    return tuple((entry.name, entry.value) for entry in entry_points(group=ENTRY_POINT_GROUP))


@functools.lru_cache(maxsize=8)
def _registry_for(env_value: str) -> tuple[tuple[str, str], ...]:
    registry = dict(BUILTIN_HOOKS)
    registry.update(_entry_point_hooks())
    for item in filter(None, (part.strip() for part in env_value.split(","))):
        name, sep, target = item.partition("=")
        if not sep or not _NAME.match(name.strip()) or ":" not in target:
            raise ValueError(f"{HOOKS_ENV}: entries are name=module:function, got {item!r}")
        registry[name.strip()] = target.strip()
    return tuple(registry.items())


def import_target(target: str) -> Callable[..., Any]:
    """``"package.module:qualified.name"`` -> the object (for registered and importable hooks)."""
    module_name, _, qualname = target.partition(":")
    obj: Any = importlib.import_module(module_name)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"{target} is not callable")
    function: Callable[..., Any] = obj
    return function


def registered_hook(name: str) -> Callable[..., Any]:
    registry = hook_registry()
    if name not in registry:
        raise ValueError(f"unknown hook {name!r}: registered hooks are {sorted(registry)}")
    return import_target(registry[name])


class HookBounds(NamedTuple):
    """What admission knows for a hook's args, given to its ``args_model`` as the validation
    context ``{"bounds": HookBounds}``: ``width``, the rows' width (the model's hidden size; None
    for a ``module`` hook, whose width is the module's), ``max_positions``, how many positions
    the request may have (prompt + max_tokens - 1; for a hook set, the model's context length),
    and the model's ``vocab_size``. The worker validates again without it."""

    width: int | None
    max_positions: int
    vocab_size: int


BOUNDS_CONTEXT = "bounds"


def check_hook_args(hook: Hook, hidden_size: int, max_positions: int, vocab_size: int) -> None:
    """A registered hook's args against its ``args_model`` and the request's and model's bounds."""
    if hook.registered:
        bounds = HookBounds(hidden_size if hook.module is None else None, max_positions, vocab_size)
        check_registered_args(str(hook.fn), hook.args, bounds)


def check_registered_args(name: str, args: Mapping[str, Any], bounds: HookBounds | None = None) -> None:
    """Validate ``args`` with the hook's ``args_model`` (a pydantic model), if it declares one."""
    model = getattr(registered_hook(name), "args_model", None)
    if model is not None:
        try:
            model.model_validate(dict(args), context=None if bounds is None else {BOUNDS_CONTEXT: bounds})
        except ValueError as exc:
            raise ValueError(f"hook {name!r} args: {exc}") from None
