"""The ``--gpu`` model: a random-weight Llama-3-8B-shaped model, built on the GPU in bf16 with a
transformers config and saved to a local directory (no tokenizer: prompts are token ids)."""

from __future__ import annotations

import json
from pathlib import Path

READY = ".lens_evals_bench_ready"
LLAMA_8B: dict[str, int | float | bool] = {
    "vocab_size": 128256,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "max_position_embeddings": 8192,
    "rope_theta": 500000.0,
    "rms_norm_eps": 1e-5,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
    "tie_word_embeddings": False,
}


def build_random_llama(out_dir: Path, num_layers: int = 32, seed: int = 0) -> Path:
    """Build (once) and return the model directory; ``num_layers`` < 32 makes a quicker model."""
    shape = {**LLAMA_8B, "num_hidden_layers": num_layers}
    ready = out_dir / READY
    if ready.exists() and json.loads(ready.read_text()) == shape:
        return out_dir
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if not torch.cuda.is_available():
        raise RuntimeError("--gpu needs a CUDA device")
    # transformers' config takes keyword arguments its signature does not declare (rope_theta, and
    # torch_dtype for 4.x) and types each field on its own, which a dict of mixed values cannot match
    config = LlamaConfig(**shape, torch_dtype="bfloat16")  # type: ignore[arg-type, call-arg]
    torch.manual_seed(seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda"):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True, max_shard_size="5GB")
    (out_dir / "generation_config.json").write_text(
        json.dumps({"bos_token_id": shape["bos_token_id"], "eos_token_id": shape["eos_token_id"]})
    )
    del model
    torch.cuda.empty_cache()
    ready.write_text(json.dumps(shape))
    return out_dir


if __name__ == "__main__":  # built in its own process, so the benchmark's parent holds no GPU memory
    import sys

    print(build_random_llama(Path(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 32))
