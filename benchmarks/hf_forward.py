"""HF transformers *forward* + a forward hook (system ``hf-forward``): the honest competitor on
the prefill workload. Prompts sorted by length (little padding), right-padded, one forward per
batch; the hooked layer's rows of every prompt token are copied to the host, and the next token
is the argmax of the logits at each prompt's last position (the LM head runs on those rows only,
as a tuned user would). The batch size is the fastest of ``cfg.hf_batches`` on a sample of the
prompts, timed before the timed run."""

from __future__ import annotations

import time
from typing import Any

import torch

from benchmarks.config import BenchConfig
from benchmarks.hf_systems import _pad_id, _stream
from benchmarks.measure import Measured, Stopwatch, SystemUnavailable, best_of, torch_dtype
from benchmarks.systems import System

TUNE_PROMPTS = 4  # batches of each candidate size timed while tuning


def right_pad(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask) with the prompts left-aligned."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([p + [pad_id] * (width - len(p)) for p in prompts], dtype=torch.long)
    mask = torch.tensor([[1] * len(p) + [0] * (width - len(p)) for p in prompts], dtype=torch.long)
    return ids, mask


class ForwardRunner:
    """One model, one hook: ``run(order, batch)`` does the whole workload over prompts taken in
    ``order``; returns (next token per prompt, host rows per prompt)."""

    def __init__(self, model: Any, cfg: BenchConfig) -> None:
        self.model, self.cfg = model, cfg
        self.pad_id = _pad_id(model.config)
        self.captured: list[torch.Tensor] = []
        model.model.layers[cfg.layer].register_forward_hook(lambda m, a, out: self.captured.append(_stream(out)))

    @torch.no_grad()
    def batch(self, prompts: list[list[int]]) -> tuple[list[int], list[torch.Tensor]]:
        ids, mask = right_pad(prompts, self.pad_id)
        self.captured.clear()
        device = self.cfg.device
        hidden = self.model.model(input_ids=ids.to(device), attention_mask=mask.to(device)).last_hidden_state
        lengths = torch.tensor([len(p) for p in prompts])
        last = hidden[torch.arange(len(prompts)), (lengths - 1).to(device)]
        tokens = self.model.lm_head(last).argmax(dim=-1).tolist()
        stream = self.captured[0].to("cpu")  # (B, width, hidden): every position of the batch to the host
        return tokens, [stream[row, : len(p)] for row, p in enumerate(prompts)]

    def run(self, order: list[int], batch_size: int) -> tuple[dict[int, int], dict[int, torch.Tensor]]:
        tokens: dict[int, int] = {}
        rows: dict[int, torch.Tensor] = {}
        for first in range(0, len(order), batch_size):
            chunk = order[first : first + batch_size]
            got, streams = self.batch([self.cfg.prompts[i] for i in chunk])
            tokens.update(zip(chunk, got))
            rows.update(zip(chunk, streams))
        if self.cfg.device == "cuda":
            torch.cuda.synchronize()
        return tokens, rows


def tune(runner: ForwardRunner, order: list[int], candidates: list[int]) -> tuple[int, list[str]]:
    """The candidate batch size with the most prompt tokens per second on a sample spread over
    the length-sorted prompts (``TUNE_PROMPTS`` batches of each size)."""
    best, best_rate, notes = candidates[0], 0.0, []
    for size in candidates:
        step = max(1, len(order) // (TUNE_PROMPTS * size))
        sample = order[::step][: TUNE_PROMPTS * size]
        sample.sort(key=lambda i: -len(runner.cfg.prompts[i]))
        runner.run(sample[:size], size)  # warm this shape
        started = time.perf_counter()
        runner.run(sample, size)
        rate = sum(len(runner.cfg.prompts[i]) for i in sample) / (time.perf_counter() - started)
        notes.append(f"{size}: {rate:.0f} tok/s")
        if rate > best_rate:
            best, best_rate = size, rate
    return best, notes


def run_hf_forward(system: System, cfg: BenchConfig) -> Measured:
    from transformers import AutoModelForCausalLM

    if cfg.max_tokens != 1:
        raise SystemUnavailable("a forward pass gives one new token: hf-forward runs with max_tokens=1 (--workload prefill)")
    started = time.perf_counter()
    loaded = AutoModelForCausalLM.from_pretrained(cfg.model_dir, dtype=torch_dtype(cfg.dtype))
    # PreTrainedModel.to is wrapped with functools.wraps, whose typeshed type does not bind self
    model = loaded.to(cfg.device).eval()  # type: ignore[arg-type]
    start_seconds = time.perf_counter() - started
    runner = ForwardRunner(model, cfg)
    order = sorted(range(len(cfg.prompts)), key=lambda i: -len(cfg.prompts[i]))  # longest first: peak memory early
    warm = Stopwatch()
    with warm.timing(sync_cuda=True):
        size, tuned = tune(runner, order, cfg.hf_batches or [cfg.hf_batch])
    best, times, (tokens, rows) = best_of(cfg.repeats, lambda: runner.run(order, size))
    measured = Measured(start_seconds, warm.seconds, best, [[tokens[i]] for i in range(len(cfg.prompts))], all_seconds=times)
    measured.samples = {i: rows[i].float() for i in range(cfg.check_prompts)}
    measured.notes.append(f"batch {size}, tuned over {', '.join(tuned)}")
    if cfg.device == "cuda":
        measured.notes.append(f"torch peak device memory {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB")
    return measured
