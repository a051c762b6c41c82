"""The device the tests run on, and how their engines share it: importable without side effects
(tests/conftest.py sets environment variables; the subprocess scripts under tests/scripts/ import
this instead)."""

from __future__ import annotations

from typing import Any


def on_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


# On a GPU machine several engines share one device: the test process's, a subprocess's, a
# server's, and those of the other pytest processes that scripts/gpu_suite.sh runs beside it.
# A fixed KV cache (what VLLM_CPU_KVCACHE_SPACE=1 gives each engine on CPU) makes vLLM skip its
# start-up memory profiling, which fails ("Error in memory profiling") when another process frees
# device memory meanwhile; gpu_memory_utilization is then only vLLM's check that this much is free.
GPU_SHARE = {"gpu_memory_utilization": 0.05, "kv_cache_memory_bytes": 2**30}


def gpu_share() -> dict[str, Any]:
    """On a GPU, the engine options that let many engines share the device (:data:`GPU_SHARE`);
    nothing on CPU."""
    return dict(GPU_SHARE) if on_gpu() else {}
