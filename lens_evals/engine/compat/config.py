"""vLLM internals both sides read alike: the engine's configuration (the model's shape, our
section of ``additional_config``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["ModelShape", "model_shape", "plugin_config", "workers_share_host"]


@dataclass(frozen=True)
class ModelShape:
    num_layers: int
    hidden_size: int
    max_model_len: int
    vocab_size: int


def model_shape(vllm_config: Any) -> ModelShape:
    text_config = vllm_config.model_config.hf_text_config
    return ModelShape(
        num_layers=int(text_config.num_hidden_layers),
        hidden_size=int(text_config.hidden_size),
        max_model_len=int(vllm_config.model_config.max_model_len),
        vocab_size=int(vllm_config.model_config.get_vocab_size()),
    )


def plugin_config(vllm_config: Any, key: str) -> dict[str, Any]:
    """Our section of vLLM's ``additional_config`` (empty when absent)."""
    extra = getattr(vllm_config, "additional_config", None)
    section = extra.get(key) if isinstance(extra, dict) else None
    return section if isinstance(section, dict) else {}


def workers_share_host(vllm_config: Any) -> bool:
    """Whether every worker of the engine runs on the frontend's host: vLLM's own processes or
    the frontend's (``mp`` / ``uni`` executors) on one node, with every data-parallel rank local.
    Ray, an external launcher, a custom executor class or several nodes: not known, so False."""
    parallel = vllm_config.parallel_config
    backend = getattr(parallel, "distributed_executor_backend", None)
    if backend not in (None, "mp", "uni"):
        return False
    if int(getattr(parallel, "nnodes", 1) or 1) > 1:
        return False
    size = int(getattr(parallel, "data_parallel_size", 1) or 1)
    return size == 1 or int(getattr(parallel, "data_parallel_size_local", size)) == size
