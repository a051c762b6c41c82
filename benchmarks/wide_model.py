"""``wide-llama``: a random Llama with a Llama-8B's hidden size (4,096, bf16: 8 KiB per token and
layer, as the GPU bench's rows) but two layers, one key/value head and a 128-wide MLP, so a CPU
computes it in seconds: it measures the per-byte cost of moving captures (the HTTP path) on a
machine without a GPU. Built once, offline, with a transformers config."""

from __future__ import annotations

import json
from pathlib import Path

WIDE_LLAMA = "wide-llama"
SHAPE: dict[str, int | bool] = {
    "vocab_size": 2048,
    "hidden_size": 4096,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 32,
    "num_key_value_heads": 1,
    "head_dim": 128,  # vLLM's CPU attention takes it
    "max_position_embeddings": 2048,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "tie_word_embeddings": True,
}
READY = ".lens_evals_wide_ready"


def build_wide_llama(out_dir: Path = Path("/tmp/lens-evals-wide-llama"), seed: int = 0) -> Path:
    """Build (once) and return the model directory (~160 MB)."""
    ready = out_dir / READY
    if ready.exists() and json.loads(ready.read_text()) == SHAPE:
        return out_dir
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    # transformers types each config field on its own, which a dict of mixed values cannot match
    config = LlamaConfig(**SHAPE, torch_dtype="bfloat16")  # type: ignore[arg-type, call-arg]
    torch.manual_seed(seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    (out_dir / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    ready.write_text(json.dumps(SHAPE))
    return out_dir
