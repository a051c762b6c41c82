"""The ONE module that touches vLLM internals. vLLM 0.26 (GPU) and 0.32 (CPU build).

Everything else in ``lens_evals.engine`` talks to vLLM through the functions here:
patch points (request validation, offline/async result delivery, the model runner's
forward, the HTTP app) and accessors (the batch layout, a request's extra args, the
decoder layers, parallel ranks). A vLLM upgrade should only need edits here.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
from torch import nn

logger = logging.getLogger("lens_evals")

_PATCHED_ATTR = "__lens_evals_patched__"


def vllm_version() -> str:
    import vllm

    return getattr(vllm, "__version__", "unknown")


def _patch(owner: Any, name: str, make_wrapper: Callable[[Callable], Callable]) -> None:
    original = getattr(owner, name)
    if getattr(original, _PATCHED_ATTR, False):
        return
    wrapper = make_wrapper(original)
    functools.update_wrapper(wrapper, original)
    setattr(wrapper, _PATCHED_ATTR, True)
    setattr(owner, name, wrapper)


# --------------------------------------------------------------------------- frontend
@dataclass(frozen=True)
class ModelShape:
    num_layers: int
    hidden_size: int
    max_model_len: int


def model_shape(vllm_config: Any) -> ModelShape:
    text_config = vllm_config.model_config.hf_text_config
    return ModelShape(
        num_layers=int(text_config.num_hidden_layers),
        hidden_size=int(text_config.hidden_size),
        max_model_len=int(vllm_config.model_config.max_model_len),
    )


def _client_error_class() -> type[ValueError]:
    """A ValueError that vLLM's server maps to HTTP 400 (0.32 only passes VLLMClientError
    through AsyncLLM.generate; other exceptions become a bare 500)."""
    try:
        from vllm.exceptions import VLLMValidationError
    except ImportError:  # vLLM 0.26: ValueError already maps to 400
        return ValueError

    class LensValidationError(VLLMValidationError, ValueError):
        pass

    return LensValidationError


def patch_input_processor(on_request: Callable[[Any, str, Any], None]) -> None:
    """Call ``on_request(input_processor, external_request_id, engine_core_request)`` for
    every new request, after vLLM's own processing and before the request id is rewritten.
    ``on_request`` may raise ValueError: vLLM turns it into an HTTP 400 / offline error."""
    from vllm.v1.engine import input_processor as ip_module

    cls = ip_module.InputProcessor if hasattr(ip_module, "InputProcessor") else ip_module.Processor

    error_class = _client_error_class()

    def make(original: Callable) -> Callable:
        def process_inputs(self: Any, request_id: str, *args: Any, **kwargs: Any) -> Any:
            request = original(self, request_id, *args, **kwargs)
            try:
                on_request(self, request_id, request)
            except ValueError as exc:
                if isinstance(exc, error_class):
                    raise
                raise error_class(str(exc)) from None
            return request

        return process_inputs

    _patch(cls, "process_inputs", make)


def request_sampling_params(request: Any) -> Any:
    return getattr(request, "sampling_params", None)


def set_request_cache_salt(request: Any, salt: str) -> None:
    """A unique salt: the request neither reads cached prefix KV nor leaves KV others reuse."""
    request.cache_salt = salt


def patch_offline_results(attach: Callable[[Any, list[Any]], None]) -> None:
    """After ``LLM.generate`` / ``LLM.chat`` finish, call ``attach(llm, outputs)``."""
    from vllm.entrypoints.llm import LLM

    def make(original: Callable) -> Callable:
        def _run_engine(self: Any, *args: Any, **kwargs: Any) -> Any:
            outputs = original(self, *args, **kwargs)
            attach(self, outputs)
            return outputs

        return _run_engine

    _patch(LLM, "_run_engine", make)


def offline_input_processor(llm: Any) -> Any:
    engine = llm.llm_engine
    return getattr(engine, "input_processor", None) or getattr(engine, "processor", None)


def patch_async_results(
    attach: Callable[[Any, Any], Any], discard: Callable[[Any, str], Any]
) -> None:
    """Wrap ``AsyncLLM.generate``: ``await attach(engine, output)`` on the final output of a
    request; ``await discard(engine, request_id)`` when a request ends without one."""
    from vllm.v1.engine.async_llm import AsyncLLM

    def make(original: Callable) -> Callable:
        async def generate(self: Any, prompt: Any, sampling_params: Any, request_id: str, *args: Any, **kwargs: Any):
            delivered = False
            try:
                async for output in original(self, prompt, sampling_params, request_id, *args, **kwargs):
                    if output.finished:
                        await attach(self, output)
                        delivered = True
                    yield output
            finally:
                if not delivered:
                    await discard(self, request_id)

        return generate

    _patch(AsyncLLM, "generate", make)


def async_input_processor(engine: Any) -> Any:
    return getattr(engine, "input_processor", None) or getattr(engine, "processor", None)


def force_eager_unless(reason: str, graph_layers: Callable[[], Any], config_key: str) -> None:
    """Forward hooks run only outside CUDA graphs / torch.compile: force enforce_eager, unless
    graph mode is asked for (``graph_layers()`` not None, or ``additional_config[config_key]``
    already names graph layers). The env setting is copied into ``additional_config``, which
    vLLM hashes into its compile cache key and sends to every worker."""
    from vllm.engine.arg_utils import EngineArgs

    def make(original: Callable) -> Callable:
        def create_engine_config(self: Any, *args: Any, **kwargs: Any) -> Any:
            extra = dict(self.additional_config or {}) if isinstance(self.additional_config, dict) else None
            section = dict((extra or {}).get(config_key) or {})
            from_env = graph_layers()
            if extra is not None and section.get("graph_layers") is None and from_env is not None:
                section["graph_layers"] = from_env
                extra[config_key] = section
                self.additional_config = extra
            if section.get("graph_layers") is not None:
                logger.info("lens_evals: graph mode (layers %s): torch.compile / CUDA graphs as configured", section["graph_layers"])
            elif not self.enforce_eager:
                logger.info("lens_evals: enforce_eager=True (%s); set LENS_EVALS_DISABLE=1 to opt out", reason)
                self.enforce_eager = True
            return original(self, *args, **kwargs)

        return create_engine_config

    _patch(EngineArgs, "create_engine_config", make)


def plugin_config(vllm_config: Any, key: str) -> dict[str, Any]:
    """Our section of vLLM's ``additional_config`` (empty when absent)."""
    extra = getattr(vllm_config, "additional_config", None)
    section = extra.get(key) if isinstance(extra, dict) else None
    return section if isinstance(section, dict) else {}


def max_step_rows(runner: Any) -> int:
    """The most token rows one forward pass can have (scheduler budget, CUDA graph sizes)."""
    config = runner.vllm_config
    rows = int(config.scheduler_config.max_num_batched_tokens)
    capture = getattr(config.compilation_config, "max_cudagraph_capture_size", None) or 0
    return max(rows, int(capture), int(getattr(runner, "max_num_tokens", 0) or 0))


def prefer_v1_model_runner() -> None:
    """vLLM 0.26 on GPU picks "Model Runner V2" for Llama-like models; our taps plan each step
    from the V1 runner's input batch. Ask for V1 unless the user chose explicitly."""
    import os

    if os.environ.get("VLLM_USE_V2_MODEL_RUNNER") is None:
        os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0"
        logger.info("lens_evals: VLLM_USE_V2_MODEL_RUNNER=0 (the plugin plans steps from the V1 model runner)")


def patch_http_app(add_middleware: Callable[[Any], None], middleware_path: str) -> None:
    """Add our ASGI middleware (``add_middleware(app)``, or by import path where vLLM builds
    the middleware list itself) to the OpenAI-compatible server's app."""
    import sys

    try:  # vLLM >= 0.30: build_app lives in vllm.entrypoints.launchers.app
        from vllm.entrypoints.launchers import app as app_module

        def make(original: Callable) -> Callable:
            def init_entrypoints_middleware(args: Any, app: Any, *rest: Any, **kwargs: Any) -> Any:
                result = original(args, app, *rest, **kwargs)
                add_middleware(app)
                return result

            return init_entrypoints_middleware

        _patch(app_module, "init_entrypoints_middleware", make)
        return
    except ImportError:
        pass
    from vllm.entrypoints.openai import api_server  # vLLM 0.26: build_app reads args.middleware

    def make_build(original: Callable) -> Callable:
        def build_app(args: Any, *rest: Any, **kwargs: Any) -> Any:
            middleware = list(getattr(args, "middleware", None) or [])
            if middleware_path not in middleware:
                args.middleware = middleware + [middleware_path]
            return original(args, *rest, **kwargs)

        return build_app

    _patch(api_server, "build_app", make_build)
    main = sys.modules.get("__main__")  # `python -m vllm.entrypoints.openai.api_server`
    if main is not None and getattr(getattr(main, "__spec__", None), "name", None) == api_server.__name__:
        _patch(main, "build_app", make_build)


def engine_client_from_scope(scope: dict[str, Any]) -> Any:
    """The server's AsyncLLM, from an ASGI scope of vLLM's OpenAI-compatible app."""
    app = scope.get("app")
    engine = getattr(getattr(app, "state", None), "engine_client", None)
    if engine is None:
        raise RuntimeError("lens_evals: no engine client on this app")
    return engine


async def async_collective_rpc(engine: Any, method: str, args: tuple) -> list[Any]:
    """Call a worker method installed by :func:`add_worker_methods` on every worker. By name:
    vLLM refuses to send functions between processes unless insecure serialisation is on.

    With data parallelism, ``AsyncLLM.collective_rpc`` runs the method on every engine's
    workers but returns only the first engine's replies; a request served by another engine
    would lose its results. Ask each engine this frontend talks to and join the replies."""
    core = engine.engine_core
    engines = list(getattr(core, "core_engines", None) or ())
    if len(engines) <= 1 or not hasattr(core, "_call_utility_async"):
        return await engine.collective_rpc(method, args=args)
    per_engine = await asyncio.gather(
        *(core._call_utility_async("collective_rpc", method, None, args, None, engine=target) for target in engines)
    )
    return [reply for replies in per_engine for reply in replies]


def offline_collective_rpc(llm: Any, method: str, args: tuple) -> list[Any]:
    return llm.collective_rpc(method, args=args)


def add_worker_methods(methods: dict[str, Callable[..., Any]]) -> None:
    """Make ``methods`` callable by name through collective_rpc (``fn(worker, *args)``)."""
    from vllm.v1.worker.worker_base import WorkerBase

    for name, fn in methods.items():
        if getattr(WorkerBase, name, None) is not fn:
            setattr(WorkerBase, name, fn)


# --------------------------------------------------------------------------- LoRA
def _lora_rows(inputs: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(rows, out): row n is ``inputs[n] @ weights[indices[n]].T``, and 0 where indices[n] < 0
    (a base-model row). One matmul per adapter in the batch."""
    if weights.dim() == 4:  # (slots, 1, out, in)
        weights = weights.squeeze(1)
    x = inputs.to(dtype)
    out = torch.zeros((x.shape[0], weights.shape[1]), dtype=dtype, device=x.device)
    for slot in torch.unique(indices).tolist():
        if slot < 0:
            continue
        rows = indices == slot
        out[rows] = x[rows] @ weights[slot].to(dtype).T
    return out


def _bgmv_shrink(inputs: torch.Tensor, lora_a_weights: torch.Tensor, output_tensor: torch.Tensor,
                 lora_indices_tensor: torch.Tensor, scaling: float = 1.0) -> None:
    outputs = _lora_rows(inputs, lora_a_weights, lora_indices_tensor, output_tensor.dtype)
    output_tensor[:, : outputs.shape[1]] = scaling * outputs


def _bgmv_expand(inputs: torch.Tensor, lora_b_weights: torch.Tensor, output_tensor: torch.Tensor,
                 lora_indices_tensor: torch.Tensor, add_inputs: bool = True) -> None:
    outputs = _lora_rows(inputs, lora_b_weights, lora_indices_tensor, output_tensor.dtype)
    limit = 1 if outputs.shape[0] == 1 and output_tensor.shape[0] != 1 else output_tensor.shape[0]
    common = min(outputs.shape[1], output_tensor.shape[1])  # adapter and model may pad differently
    if add_inputs:
        output_tensor[:, :common] += outputs[:limit, :common]
    else:
        output_tensor[:, :common] = outputs[:limit, :common]


def _bgmv_expand_slice(inputs: torch.Tensor, lora_b_weights: torch.Tensor, output_tensor: torch.Tensor,
                       lora_indices_tensor: torch.Tensor, slice_offset: int, slice_size: int, add_inputs: bool = True) -> None:
    outputs = _lora_rows(inputs, lora_b_weights, lora_indices_tensor, output_tensor.dtype)
    if add_inputs:
        output_tensor[:, slice_offset : slice_offset + slice_size] += outputs
    else:
        output_tensor[:, slice_offset : slice_offset + slice_size] = outputs


_GROUPED_LORA_OPS: dict[str, Callable[..., None]] = {
    "bgmv_shrink": _bgmv_shrink, "bgmv_expand": _bgmv_expand, "bgmv_expand_slice": _bgmv_expand_slice,
}


def use_grouped_lora_ops() -> None:
    """Replace vLLM's PyTorch LoRA row ops (the CPU punica wrapper, vLLM 0.32) with grouped ones.

    vLLM's versions gather one weight matrix per token (``weights[lora_indices]``) and read a
    base-model row's index -1 as the LAST slot: when every slot holds an adapter, base rows in
    a batch with LoRA rows silently get that adapter. These run one matmul per adapter and give
    base rows exactly 0, with the same signatures and output semantics. The GPU (Triton)
    kernels skip index -1 and are left alone."""
    try:
        from vllm.lora.ops.torch_ops import lora_ops
        from vllm.lora.punica_wrapper import punica_cpu
    except ImportError:  # a build without the PyTorch LoRA ops
        logger.debug("no PyTorch LoRA ops in this vLLM build")
        return
    # sgmv_* call lora_ops' bgmv_*; the CPU wrapper imported bgmv_* by name: replace both.
    for module in (lora_ops, punica_cpu):
        for name, replacement in _GROUPED_LORA_OPS.items():
            if getattr(module, name, None) is not replacement:
                setattr(module, name, replacement)


# --------------------------------------------------------------------------- worker
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

    def make_load(original: Callable) -> Callable:
        def load_model(self: Any, *args: Any, **kwargs: Any) -> Any:
            result = original(self, *args, **kwargs)
            _ensure_pp_receive_buffer(self)
            on_load(self)
            return result

        return load_model

    def make_execute(original: Callable) -> Callable:
        def execute_model(self: Any, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
            on_step_start(self, scheduler_output)
            return original(self, scheduler_output, *args, **kwargs)

        return execute_model

    def make_forward(original: Callable) -> Callable:
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


def runner_device(runner: Any) -> torch.device:
    return torch.device(runner.device)


def runner_model(runner: Any) -> nn.Module:
    return runner.get_model() if hasattr(runner, "get_model") else runner.model


def runner_from_worker(worker: Any) -> Any:
    """collective_rpc hands functions the worker (or a wrapper of it)."""
    for candidate in (worker, getattr(worker, "worker", None)):
        runner = getattr(candidate, "model_runner", None)
        if runner is not None:
            return runner
    raise RuntimeError(f"lens_evals: no model runner found on {type(worker).__name__}")


def decoder_layers(model: nn.Module, num_layers: int) -> Iterator[tuple[int, nn.Module]]:
    """(absolute index, layer) for the decoder layers present on this pipeline stage."""
    from vllm.model_executor.models.utils import PPMissingLayer

    for module in model.modules():
        layers = getattr(module, "layers", None)
        if isinstance(layers, nn.ModuleList) and len(layers) == num_layers:
            for index, layer in enumerate(layers):
                if not isinstance(layer, PPMissingLayer):
                    yield index, layer
            return
    raise RuntimeError(f"lens_evals: could not find {num_layers} decoder layers in {type(model).__name__}")


def split_layer_output(output: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A decoder layer returns ``(hidden, residual)`` (fused residual: the stream is their
    sum) or the stream itself."""
    if isinstance(output, tuple) and len(output) == 2 and isinstance(output[0], torch.Tensor):
        return output[0], output[1]
    if isinstance(output, torch.Tensor):
        return output, None
    raise TypeError(f"lens_evals: unsupported decoder layer output {type(output).__name__}")


def split_layer_input(args: tuple, kwargs: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A decoder layer is called as ``layer(positions, hidden_states, residual)``: the stream
    entering it is hidden_states + residual (residual is None at the first layer)."""
    names = ("positions", "hidden_states", "residual")
    values = dict(zip(names, args)) | {k: v for k, v in kwargs.items() if k in names}
    hidden = values.get("hidden_states")
    if not isinstance(hidden, torch.Tensor):
        raise TypeError("lens_evals: decoder layer called without a hidden_states tensor")
    return hidden, values.get("residual")


def first_input(args: tuple, kwargs: dict[str, Any]) -> torch.Tensor:
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
                return handle.get_tensor(name)
    raise ValueError(
        f"{name!r} was freed by vLLM's CPU backend after packing and is not in the checkpoint under that "
        "name (merged projections such as qkv_proj / gate_up_proj are stored split)"
    )


def checkpoint_dir(runner: Any) -> str | None:
    return str(runner.model_config.model)


def hf_config(runner: Any) -> Any:
    return runner.model_config.hf_text_config


def forward_input_ids(args: tuple, kwargs: dict[str, Any]) -> torch.Tensor | None:
    """The token ids of one ``_model_forward`` call (None when the model gets embeddings)."""
    value = kwargs.get("input_ids", args[0] if args else None)
    return value if isinstance(value, torch.Tensor) else None


def join_layer_output(original: Any, hidden: torch.Tensor) -> Any:
    if isinstance(original, tuple):
        return (hidden, original[1])
    return hidden


def parallel_ranks() -> tuple[int, int]:
    """(tensor-parallel rank, pipeline-parallel rank) of this worker."""
    from vllm.distributed import parallel_state

    tp = parallel_state.get_tensor_model_parallel_rank() if parallel_state.model_parallel_is_initialized() else 0
    pp = parallel_state.get_pp_group().rank_in_group if parallel_state.model_parallel_is_initialized() else 0
    return int(tp), int(pp)


def num_layers_of(runner: Any) -> int:
    return int(runner.model_config.hf_text_config.num_hidden_layers)


