"""vLLM internals on the worker side: the model runner's load / step / forward, the batch
layout, requests' extra args, decoder layers, layer inputs / outputs, parallel ranks."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lens_evals.engine.compat._base import Method, _patch, logger

__all__ = [
    "BatchLayout",
    "max_step_rows",
    "batch_layout",
    "checkpoint_dir",
    "finished_request_ids",
    "first_input",
    "first_output",
    "forward_input_ids",
    "gathered_parameter",
    "hf_config",
    "num_layers_of",
    "parallel_ranks",
    "patch_model_runner",
    "readout_head",
    "request_extra_args",
    "request_rows_at_most",
    "reserve_lens_memory",
    "runner_device",
    "runner_from_worker",
    "runner_model",
    "step_num_scheduled",
]


def patch_model_runner(
    on_load: Callable[[Any], None],
    on_step_start: Callable[[Any, Any], None],
    around_forward: Callable[[Any, Callable[[], Any], torch.Tensor | None], Any],
) -> None:
    """``on_load(runner)`` after the model loads; ``on_step_start(runner, scheduler_output)``
    before each step; ``around_forward(runner, run, input_ids)`` wraps each model forward."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    runner_classes: list[type] = [GPUModelRunner]
    try:
        from vllm.v1.worker.cpu_model_runner import CPUModelRunner

        runner_classes.append(CPUModelRunner)
    except ImportError:
        logger.debug("no CPU model runner in this vLLM build")

    def make_load(original: Method) -> Method:
        def load_model(self: Any, *args: Any, **kwargs: Any) -> Any:
            result = original(self, *args, **kwargs)
            _ensure_pp_receive_buffer(self)
            on_load(self)
            return result

        return load_model

    def make_execute(original: Method) -> Method:
        def execute_model(self: Any, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
            on_step_start(self, scheduler_output)
            return original(self, scheduler_output, *args, **kwargs)

        return execute_model

    def make_forward(original: Method) -> Method:
        def _model_forward(self: Any, *args: Any, **kwargs: Any) -> Any:
            return around_forward(self, lambda: original(self, *args, **kwargs), forward_input_ids(args, kwargs))

        return _model_forward

    for cls in runner_classes:
        if "load_model" in vars(cls):
            _patch(cls, "load_model", make_load)
    _patch(GPUModelRunner, "execute_model", make_execute)
    _patch(GPUModelRunner, "_model_forward", make_forward)


def _ensure_pp_receive_buffer(runner: Any) -> None:
    """vLLM defect (0.32 CPU): a later pipeline stage copies the tensors it receives into
    ``runner.intermediate_tensors``, which only ``_dummy_run`` allocates. The CPU worker runs
    no warm-up in eager mode (CompilationMode.NONE, which the plugin forces) with an explicit
    KV cache size, so the buffer stays None and the first step fails (``AssertionError`` in
    ``sync_and_gather_intermediate_tensors``). Allocate it as ``_dummy_run`` would."""
    if getattr(runner, "intermediate_tensors", "absent") is not None:
        return
    from vllm.distributed import parallel_state

    if not parallel_state.model_parallel_is_initialized() or parallel_state.get_pp_group().is_first_rank:
        return
    model = runner.get_model() if hasattr(runner, "get_model") else runner.model
    runner.intermediate_tensors = model.make_empty_intermediate_tensors(
        batch_size=runner.max_num_tokens, dtype=runner.model_config.dtype, device=runner.device
    )
    logger.info("lens_evals: allocated the pipeline-stage receive buffer vLLM's eager CPU worker leaves unset")


def finished_request_ids(scheduler_output: Any) -> set[str]:
    return set(getattr(scheduler_output, "finished_req_ids", ()) or ())


def step_num_scheduled(scheduler_output: Any) -> dict[str, int]:
    return dict(scheduler_output.num_scheduled_tokens)


@dataclass(frozen=True)
class BatchLayout:
    """Requests of one forward pass in row order, with their first absolute position."""

    req_ids: list[str]
    num_rows: list[int]
    start_positions: list[int]


def batch_layout(runner: Any, num_scheduled: dict[str, int]) -> BatchLayout:
    batch = runner.input_batch
    req_ids = [r for r in batch.req_ids if r is not None]
    rows = [int(num_scheduled.get(r, 0)) for r in req_ids]
    computed = batch.num_computed_tokens_cpu
    starts = [int(computed[batch.req_id_to_index[r]]) for r in req_ids]
    return BatchLayout(req_ids, rows, starts)


def request_extra_args(runner: Any, req_id: str) -> dict[str, Any] | None:
    state = runner.requests.get(req_id)
    params = getattr(state, "sampling_params", None)
    return getattr(params, "extra_args", None)


def request_rows_at_most(runner: Any, req_id: str) -> int | None:
    """The most positions a request's forward passes can reach: its prompt and ``max_tokens``
    (None: unknown, e.g. no ``max_tokens``)."""
    state = runner.requests.get(req_id)
    prompt = getattr(state, "num_prompt_tokens", None)
    max_tokens = getattr(getattr(state, "sampling_params", None), "max_tokens", None)
    if not isinstance(prompt, int) or not isinstance(max_tokens, int):
        return None
    return prompt + max_tokens


def runner_device(runner: Any) -> torch.device:
    return torch.device(runner.device)


def runner_model(runner: Any) -> nn.Module:
    model: nn.Module = runner.get_model() if hasattr(runner, "get_model") else runner.model
    return model


# Where vLLM's model files keep the final norm (the module between the last decoder layer and
# the logits), by the attribute path of the *ForCausalLM class.
FINAL_NORM_PATHS = (
    "model.norm",
    "model.final_layernorm",
    "model.ln_f",
    "transformer.ln_f",
    "transformer.norm_f",
    "gpt_neox.final_layer_norm",
    "model.decoder.final_layer_norm",
    "backbone.norm_f",
)


def readout_head(model: nn.Module) -> Callable[[torch.Tensor], torch.Tensor | None] | None:
    """The model's own path from a layer's residual stream to logits, for lens readouts: its
    final norm, then its ``compute_logits`` (unembedding, tied or not, logit scale and soft-cap,
    the vocabulary-parallel gather: None on tensor-parallel ranks it does not reach, so every
    rank must call it with the same rows). None: no final norm found, or not the last pipeline
    stage (then lens readouts are refused)."""
    compute_logits = getattr(model, "compute_logits", None)
    if compute_logits is None:
        return None
    for path in FINAL_NORM_PATHS:
        try:
            norm = model.get_submodule(path)
        except AttributeError:
            continue
        if type(norm).__name__ == "PPMissingLayer":
            return None

        def head(stream: torch.Tensor, norm: nn.Module = norm) -> torch.Tensor | None:
            normed = norm(stream)
            if isinstance(normed, tuple):
                normed = normed[0]
            logits: torch.Tensor | None = compute_logits(normed)
            return logits

        return head
    return None


def runner_from_worker(worker: Any) -> Any:
    """collective_rpc hands functions the worker (or a wrapper of it)."""
    for candidate in (worker, getattr(worker, "worker", None)):
        runner = getattr(candidate, "model_runner", None)
        if runner is not None:
            return runner
    raise RuntimeError(f"lens_evals: no model runner found on {type(worker).__name__}")


def first_input(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor:
    for value in list(args) + list(kwargs.values()):
        if isinstance(value, torch.Tensor):
            return value
    raise TypeError("lens_evals: the hooked module got no tensor input")


def first_output(output: Any) -> torch.Tensor:
    """vLLM's parallel linear layers return (output, bias); other modules a tensor."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, tuple) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    raise TypeError(f"lens_evals: the hooked module returned {type(output).__name__}, not a tensor")


def gathered_parameter(model: nn.Module, name: str, checkpoint: str | None) -> torch.Tensor:
    """A parameter by its vLLM name, whole: under tensor parallelism the shards of column-,
    row- and vocabulary-parallel layers are gathered (merged projections such as qkv_proj and
    gate_up_proj come back rank by rank). A collective under TP: every rank must call it.
    vLLM's CPU backend frees linear weights after packing them for oneDNN; those are read from
    the checkpoint in ``checkpoint`` (a directory), where the name exists there unchanged."""
    from vllm.distributed import get_tensor_model_parallel_world_size, tensor_model_parallel_all_gather
    from vllm.model_executor.layers.linear import ColumnParallelLinear, RowParallelLinear
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    module_name, _, param_name = name.rpartition(".")
    try:
        module = model.get_submodule(module_name) if module_name else model
        param = getattr(module, param_name)
    except AttributeError:
        raise ValueError(f"the model has no parameter {name!r}") from None
    if not isinstance(param, torch.Tensor):
        raise ValueError(f"{name!r} is not a parameter")
    tensor = param.detach()
    if tensor.numel() == 0:
        return _checkpoint_tensor(checkpoint, name).to(device=tensor.device, dtype=tensor.dtype)
    if get_tensor_model_parallel_world_size() == 1:
        return tensor
    if isinstance(module, VocabParallelEmbedding):
        return tensor_model_parallel_all_gather(tensor, dim=0)[: module.org_vocab_size]
    if isinstance(module, ColumnParallelLinear):  # weight and bias sharded along the outputs
        return tensor_model_parallel_all_gather(tensor, dim=getattr(param, "output_dim", 0) or 0)
    if isinstance(module, RowParallelLinear) and tensor.dim() > 1:
        return tensor_model_parallel_all_gather(tensor, dim=getattr(param, "input_dim", 1))
    return tensor


def _checkpoint_tensor(checkpoint: str | None, name: str) -> torch.Tensor:
    from pathlib import Path

    from safetensors import safe_open

    files = sorted(Path(checkpoint).glob("*.safetensors")) if checkpoint and Path(checkpoint).is_dir() else []
    for path in files:
        with safe_open(str(path), framework="pt") as handle:
            if name in handle.keys():
                tensor: torch.Tensor = handle.get_tensor(name)
                return tensor
    raise ValueError(
        f"{name!r} was freed by vLLM's CPU backend after packing and is not in the checkpoint under that "
        "name (merged projections such as qkv_proj / gate_up_proj are stored split)"
    )


def checkpoint_dir(runner: Any) -> str | None:
    return str(runner.model_config.model)


def hf_config(runner: Any) -> Any:
    return runner.model_config.hf_text_config


def forward_input_ids(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor | None:
    """The token ids of one ``_model_forward`` call (None when the model gets embeddings)."""
    value = kwargs.get("input_ids", args[0] if args else None)
    return value if isinstance(value, torch.Tensor) else None


def parallel_ranks() -> tuple[int, int]:
    """(tensor-parallel rank, pipeline-parallel rank) of this worker."""
    from vllm.distributed import parallel_state

    tp = parallel_state.get_tensor_model_parallel_rank() if parallel_state.model_parallel_is_initialized() else 0
    pp = parallel_state.get_pp_group().rank_in_group if parallel_state.model_parallel_is_initialized() else 0
    return int(tp), int(pp)


def num_layers_of(runner: Any) -> int:
    return int(runner.model_config.hf_text_config.num_hidden_layers)


def reserve_lens_memory(reserved_bytes: Callable[[], int]) -> None:
    """On a GPU, vLLM sizes its KV cache with what is left after ``reserved_bytes()`` (the lens
    device budget and the readout weights' cache), so the memory lens requests are admitted against exists. Not when the user
    sized the KV cache (``kv_cache_memory_bytes``): the room beside it is theirs to leave. The CPU
    worker sizes its cache from ``VLLM_CPU_KVCACHE_SPACE`` (its own method, left as it is)."""
    from vllm.v1.worker.gpu_worker import Worker

    def make(original: Method) -> Method:
        def determine_available_memory(self: Any) -> int:
            available = int(original(self))
            if getattr(self.cache_config, "kv_cache_memory_bytes", None):
                return available
            reserved = reserved_bytes()
            if reserved >= available:
                raise ValueError(
                    f"the lens device budget ({reserved / 2**30:.2f} GiB, LENS_EVALS_DEVICE_BUDGET_MIB + LENS_EVALS_READOUT_CACHE_MIB) leaves no room "
                    f"for the KV cache ({available / 2**30:.2f} GiB available): lower it or raise gpu_memory_utilization"
                )
            logger.info(
                "lens_evals: %.2f GiB of device memory kept for lens requests (LENS_EVALS_DEVICE_BUDGET_MIB + LENS_EVALS_READOUT_CACHE_MIB)",
                reserved / 2**30,
            )
            return available - reserved

        return determine_available_memory

    _patch(Worker, "determine_available_memory", make)


def max_step_rows(runner: Any) -> int:
    """The most token rows one forward pass can have (scheduler budget, CUDA graph sizes)."""
    config = runner.vllm_config
    rows = int(config.scheduler_config.max_num_batched_tokens)
    capture = getattr(config.compilation_config, "max_cudagraph_capture_size", None) or 0
    return max(rows, int(capture), int(getattr(runner, "max_num_tokens", 0) or 0))
