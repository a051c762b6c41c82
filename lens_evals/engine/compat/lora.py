"""vLLM internals for LoRA: per-adapter grouped ops so base rows never get an adapter."""

from __future__ import annotations

from collections.abc import Callable

import torch

from lens_evals.engine.compat._base import logger

__all__ = ["FLOAT32_NAMES", "lora_engine_dtype", "use_grouped_lora_ops"]


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


def _bgmv_shrink(
    inputs: torch.Tensor, lora_a_weights: torch.Tensor, output_tensor: torch.Tensor, lora_indices_tensor: torch.Tensor, scaling: float = 1.0
) -> None:
    outputs = _lora_rows(inputs, lora_a_weights, lora_indices_tensor, output_tensor.dtype)
    output_tensor[:, : outputs.shape[1]] = scaling * outputs


def _bgmv_expand(
    inputs: torch.Tensor,
    lora_b_weights: torch.Tensor,
    output_tensor: torch.Tensor,
    lora_indices_tensor: torch.Tensor,
    add_inputs: bool = True,
) -> None:
    outputs = _lora_rows(inputs, lora_b_weights, lora_indices_tensor, output_tensor.dtype)
    limit = 1 if outputs.shape[0] == 1 and output_tensor.shape[0] != 1 else output_tensor.shape[0]
    common = min(outputs.shape[1], output_tensor.shape[1])  # adapter and model may pad differently
    if add_inputs:
        output_tensor[:, :common] += outputs[:limit, :common]
    else:
        output_tensor[:, :common] = outputs[:limit, :common]


def _bgmv_expand_slice(
    inputs: torch.Tensor,
    lora_b_weights: torch.Tensor,
    output_tensor: torch.Tensor,
    lora_indices_tensor: torch.Tensor,
    slice_offset: int,
    slice_size: int,
    add_inputs: bool = True,
) -> None:
    outputs = _lora_rows(inputs, lora_b_weights, lora_indices_tensor, output_tensor.dtype)
    if add_inputs:
        output_tensor[:, slice_offset : slice_offset + slice_size] += outputs
    else:
        output_tensor[:, slice_offset : slice_offset + slice_size] = outputs


_GROUPED_LORA_OPS: dict[str, Callable[..., None]] = {
    "bgmv_shrink": _bgmv_shrink,
    "bgmv_expand": _bgmv_expand,
    "bgmv_expand_slice": _bgmv_expand_slice,
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


FLOAT32_NAMES = ("float32", "float", "torch.float32")


def lora_engine_dtype(dtype: str) -> str:
    """The engine dtype in which to serve LoRA adapters: ``dtype``, except float32 on a CUDA or
    ROCm device, where vLLM's Triton LoRA kernels (0.26: ``lora_expand_op``) assert fp16/bf16
    adapter weights; there bfloat16, with a warning. vLLM's CPU build runs fp32 LoRA."""
    if str(dtype) not in FLOAT32_NAMES:
        return dtype
    from vllm.platforms import current_platform

    if not current_platform.is_cuda_alike():
        return dtype
    logger.warning(
        "lens_evals: LoRA on %s runs in bfloat16, not %s: vLLM's GPU LoRA kernels take fp16/bf16 only", current_platform.device_name, dtype
    )
    return "bfloat16"
