"""nnsight 0.8's vLLM backend (``nnsight.modeling.vllm.VLLM``)."""

from __future__ import annotations

from lens_evals.bench.config import BenchConfig
from lens_evals.bench.measure import Measured, SystemUnavailable
from lens_evals.bench.systems import System


def run_nnsight_vllm(system: System, cfg: BenchConfig) -> Measured:
    raise SystemUnavailable("not tried yet")
