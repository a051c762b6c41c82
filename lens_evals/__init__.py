"""lens-evals: residual-stream capture, steering, probes and hooks inside vLLM.

The client side (``SteeringVector``, ``LinearProbe``, ``Hook``, the wire format) imports without
vllm or torch; ``HookContext`` (what a hook sees on the worker) needs torch and is imported on
first use. vllm-lens's helpers (``serialize_tensor``...) live in :mod:`lens_evals.client`.
"""

from typing import Any

from lens_evals.hooks import Hook
from lens_evals.request_args import parse_lens_args
from lens_evals.spec import (
    CAPTURE_KEY,
    PROBE_KEY,
    STEERING_KEY,
    LensRequest,
    LinearProbe,
    SteeringVector,
)

__all__ = [
    "CAPTURE_KEY", "PROBE_KEY", "STEERING_KEY", "Hook", "HookContext", "LensRequest", "LinearProbe",
    "SteeringVector", "parse_lens_args",
]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name == "HookContext":
        from lens_evals.engine.worker_hooks import HookContext

        return HookContext
    raise AttributeError(f"module 'lens_evals' has no attribute {name!r}")
