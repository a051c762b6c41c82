"""lens-evals: residual-stream capture, steering and probes inside vLLM.

The client side (``SteeringVector``, ``LinearProbe``, the wire format) imports without vllm or torch.
"""

from lens_evals.spec import (
    CAPTURE_KEY,
    PROBE_KEY,
    STEERING_KEY,
    LensRequest,
    LinearProbe,
    SteeringVector,
    parse_lens_args,
)

__all__ = ["CAPTURE_KEY", "PROBE_KEY", "STEERING_KEY", "LensRequest", "LinearProbe", "SteeringVector", "parse_lens_args"]
__version__ = "0.1.0"
