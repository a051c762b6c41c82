"""What users would pick instead of our plugin, on the same weights and prompts: HF transformers
``generate`` with a forward hook, nnsight 0.8 (HF backend) and TransformerLens 4.3
``TransformerBridge``. Batched with left padding; greedy; exactly ``max_tokens`` new tokens
(EOS does not stop generation, as vLLM's ``ignore_eos``)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, cast

import torch

from benchmarks.config import BenchConfig
from benchmarks.measure import Measured, Stopwatch, SystemUnavailable, best_of, left_pad, package_version, torch_dtype
from benchmarks.systems import System

# (input_ids, attention_mask, new tokens) -> (ids incl. the padded prompt, per-step layer outputs)
BatchFn = Callable[[torch.Tensor, torch.Tensor, int], tuple[torch.Tensor, list[torch.Tensor]]]


def _stream(output: torch.Tensor | tuple[torch.Tensor, ...]) -> torch.Tensor:
    return output[0] if isinstance(output, tuple) else output


def _pad_id(config: Any) -> int:
    for name in ("pad_token_id", "eos_token_id", "bos_token_id"):
        value = getattr(config, name, None)
        if isinstance(value, list):
            value = value[0] if value else None
        if value is not None:
            return int(value)
    return 0


def _run_batches(cfg: BenchConfig, pad_id: int, device: str, batch_fn: BatchFn, start_seconds: float) -> Measured:
    """Warm up on one small batch, then time every batch; keep tokens and the first prompts' stream."""
    warm = Stopwatch()
    with warm.timing(sync_cuda=True):
        ids, mask, _ = left_pad(cfg.prompts[: min(2, len(cfg.prompts))], pad_id)
        batch_fn(ids.to(device), mask.to(device), cfg.warmup_tokens)

    def every_batch() -> tuple[list[list[int]], dict[int, torch.Tensor]]:
        tokens: list[list[int]] = []
        samples: dict[int, torch.Tensor] = {}
        for first in range(0, len(cfg.prompts), cfg.hf_batch):
            batch = cfg.prompts[first : first + cfg.hf_batch]
            ids, mask, pads = left_pad(batch, pad_id)
            out, steps = batch_fn(ids.to(device), mask.to(device), cfg.max_tokens)
            width = ids.shape[1]
            tokens.extend(out[:, width : width + cfg.max_tokens].tolist())  # .tolist() waits for the device
            stream = torch.cat(steps, dim=1).to("cpu")  # (B, width + max_tokens - 1, hidden) on the host
            for row, (prompt, pad) in enumerate(zip(batch, pads)):
                index = first + row
                if index < cfg.check_prompts:
                    samples[index] = stream[row, pad : pad + len(prompt) + cfg.max_tokens - 1].float()
        return tokens, samples

    best, times, (tokens, samples) = best_of(cfg.repeats, every_batch)
    return Measured(start_seconds, warm.seconds, best, tokens, samples, all_seconds=times)


def run_hf_hook(system: System, cfg: BenchConfig) -> Measured:
    from transformers import AutoModelForCausalLM

    started = time.perf_counter()
    loaded = AutoModelForCausalLM.from_pretrained(cfg.model_dir, dtype=torch_dtype(cfg.dtype))
    # PreTrainedModel.to is wrapped with functools.wraps, whose typeshed type does not bind self
    model = loaded.to(cfg.device).eval()  # type: ignore[arg-type]
    model.generation_config.eos_token_id = None  # exactly max_tokens new tokens, as ignore_eos
    start_seconds = time.perf_counter() - started
    pad_id = _pad_id(model.config)
    steps: list[torch.Tensor] = []
    model.model.layers[cfg.layer].register_forward_hook(lambda module, args, output: steps.append(_stream(output).detach()))

    @torch.no_grad()
    def batch_fn(ids: torch.Tensor, mask: torch.Tensor, new_tokens: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
        steps.clear()
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False, pad_token_id=pad_id)
        return out, list(steps)

    return _run_batches(cfg, pad_id, cfg.device, batch_fn, start_seconds)


def run_nnsight_hf(system: System, cfg: BenchConfig) -> Measured:
    try:
        import nnsight
        from nnsight import TransformersModel
    except ImportError as exc:
        raise SystemUnavailable(f"nnsight not installed ({exc}); see scripts/bench_env.sh") from None

    started = time.perf_counter()
    model = TransformersModel(cfg.model_dir, task="text-generation", dispatch=True, dtype=torch_dtype(cfg.dtype), device_map=cfg.device)
    model._module.generation_config.eos_token_id = None
    start_seconds = time.perf_counter() - started
    pad_id = _pad_id(model._module.config)
    layer = model.model.layers[cfg.layer]

    def batch_fn(ids: torch.Tensor, mask: torch.Tensor, new_tokens: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
        inputs = {"input_ids": ids, "attention_mask": mask}
        with model.generate(inputs, max_new_tokens=new_tokens, do_sample=False, pad_token_id=pad_id) as tracer:
            steps = nnsight.save(list())
            for _ in tracer.iter[:new_tokens]:
                steps.append(_stream(layer.output))
            out = tracer.result.save()
        return out, [s.detach() for s in steps]

    measured = _run_batches(cfg, pad_id, cfg.device, batch_fn, start_seconds)
    measured.notes.append(f"nnsight {package_version('nnsight')}")
    return measured


def run_tl_bridge(system: System, cfg: BenchConfig) -> Measured:
    try:
        from transformer_lens.model_bridge import TransformerBridge
    except ImportError as exc:
        raise SystemUnavailable(f"transformer-lens not installed ({exc}); see scripts/bench_env.sh") from None

    started = time.perf_counter()
    bridge = TransformerBridge.boot_transformers(cfg.model_dir, device=cfg.device, dtype=torch_dtype(cfg.dtype))
    start_seconds = time.perf_counter() - started
    pad_id = _pad_id(bridge.original_model.config) if hasattr(bridge, "original_model") else 0
    steps: list[torch.Tensor] = []

    def hook(tensor: torch.Tensor, hook: Any) -> None:
        steps.append(tensor.detach())

    @torch.no_grad()
    def batch_fn(ids: torch.Tensor, mask: torch.Tensor, new_tokens: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
        steps.clear()
        with bridge.hooks(fwd_hooks=[(f"blocks.{cfg.layer}.hook_out", hook)]):
            out = bridge.generate(
                ids, max_new_tokens=new_tokens, stop_at_eos=False, do_sample=False, attention_mask=mask, return_type="tokens", verbose=False
            )
        # a tensor input with return_type="tokens" (no cache, no logits) comes back as the token ids
        return cast(torch.Tensor, out), list(steps)

    measured = _run_batches(cfg, pad_id, cfg.device, batch_fn, start_seconds)
    measured.notes.append(f"transformer-lens {package_version('transformer-lens')}; eager attention (forced by the bridge)")
    return measured
