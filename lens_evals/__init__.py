"""lens-evals: residual-stream capture, steering, probes and hooks inside vLLM.

What users import is here, loaded on first use: ``import lens_evals`` itself imports nothing
(no vllm, no torch, no numpy). The client side (``SteeringVector``, ``LinearProbe``, ``Hook``,
``lens_xargs``, ``LensClient``, vllm-lens's six helpers ``serialize_tensor``...) imports neither
vllm nor torch; ``HookContext`` (what a hook sees on the worker), ``LensRequestError`` and
``register_hook_set`` / ``HookSet`` (offline persistent hook sets) come from the engine and need
torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from lens_evals._moved import install as _install_moved_paths

_install_moved_paths()  # the import paths the docs gave before #44 (lens_evals/_moved.py)

if TYPE_CHECKING:
    from lens_evals.client import LensClient, activations_from_response, lens_xargs
    from lens_evals.engine.frontend.attach import LensRequestError
    from lens_evals.engine.frontend.hook_sets import HookSet, register_hook_set
    from lens_evals.engine.worker.hooks import HookContext
    from lens_evals.request.args import parse_lens_args
    from lens_evals.request.hooks import Hook
    from lens_evals.request.spec import CAPTURE_KEY, PROBE_KEY, STEERING_KEY, LensRequest, LinearProbe, SteeringVector
    from lens_evals.vllm_lens_helpers import (
        decode_activations,
        deserialize_hook_results,
        deserialize_tensor,
        serialize_activations,
        serialize_hook_results,
        serialize_tensor,
    )

# name -> the module that defines it
_EXPORTS = {
    "CAPTURE_KEY": "lens_evals.request.spec",
    "PROBE_KEY": "lens_evals.request.spec",
    "STEERING_KEY": "lens_evals.request.spec",
    "LensRequest": "lens_evals.request.spec",
    "LinearProbe": "lens_evals.request.spec",
    "SteeringVector": "lens_evals.request.spec",
    "parse_lens_args": "lens_evals.request.args",
    "Hook": "lens_evals.request.hooks",
    "LensClient": "lens_evals.client",
    "activations_from_response": "lens_evals.client",
    "lens_xargs": "lens_evals.client",
    "HookContext": "lens_evals.engine.worker.hooks",
    "LensRequestError": "lens_evals.engine.frontend.attach",
    "HookSet": "lens_evals.engine.frontend.hook_sets",
    "register_hook_set": "lens_evals.engine.frontend.hook_sets",
    # vllm-lens's helpers, under its names and signatures (docs/vllm_lens.md)
    "decode_activations": "lens_evals.vllm_lens_helpers",
    "deserialize_hook_results": "lens_evals.vllm_lens_helpers",
    "deserialize_tensor": "lens_evals.vllm_lens_helpers",
    "serialize_activations": "lens_evals.vllm_lens_helpers",
    "serialize_hook_results": "lens_evals.vllm_lens_helpers",
    "serialize_tensor": "lens_evals.vllm_lens_helpers",
}

__all__ = [
    "CAPTURE_KEY",
    "PROBE_KEY",
    "STEERING_KEY",
    "Hook",
    "HookContext",
    "HookSet",
    "LensClient",
    "LensRequest",
    "LensRequestError",
    "LinearProbe",
    "SteeringVector",
    "activations_from_response",
    "decode_activations",
    "deserialize_hook_results",
    "deserialize_tensor",
    "lens_xargs",
    "parse_lens_args",
    "register_hook_set",
    "serialize_activations",
    "serialize_hook_results",
    "serialize_tensor",
]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'lens_evals' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # the next access does not come here
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
