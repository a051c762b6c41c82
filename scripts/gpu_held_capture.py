"""Issue #47's first failure, on the GPU host: ONE offline ``llm.generate`` capturing 8 layers
(8, 11, ..., 29) of 1,000 token-id prompts (40-400 tokens) of a Llama-8B-shaped model in bf16
(vLLM's random ``load_format=dummy`` weights), ``max_tokens=1``, eager. Before the fix, requests
from ~347 on came back "no capture came back for layers [...]". Prints, per phase, the wall time
(plain call, then the capture call on the same engine), whether every request's capture came
back with its full shape, the bytes, the process's peak RSS and the engine's lens settings; exit
status 1 if any capture is missing or short.

``--kv-check`` instead starts the engine twice (``LENS_EVALS_DEVICE_BUDGET_MIB`` 0 and 4096, half
the device each) and prints the KV cache each got: the lens budget is taken out of it.

Run after the wheels' install (``scripts/gpu_suite.sh``'s header), from the repository:
    python3 scripts/gpu_held_capture.py --prompts 1000 && python3 scripts/gpu_held_capture.py --kv-check
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the checkout's, not in the wheel
LAYERS = list(range(8, 32, 3))  # 8, 11, ..., 29
HIDDEN = 4096


def build(work: Path, n: int) -> tuple[Path, list[list[int]]]:
    from transformers import LlamaConfig

    from benchmarks.gpu_model import LLAMA_8B
    from benchmarks.prefill import prefill_lengths
    from benchmarks.prompts import make_prompts

    model = work / "model"
    LlamaConfig(**LLAMA_8B, torch_dtype="bfloat16", architectures=["LlamaForCausalLM"]).save_pretrained(model)
    prompts = make_prompts(n, model, int(LLAMA_8B["vocab_size"]), lengths=prefill_lengths(n))
    return model, prompts


def held_capture(work: Path, n: int) -> int:
    from vllm import LLM, SamplingParams

    from lens_evals import settings

    model, prompts = build(work, n)
    tokens = sum(len(ids) for ids in prompts)
    print(f"{n} prompts, {tokens} tokens; capture of {len(LAYERS)} layers: {tokens * len(LAYERS) * HIDDEN * 2 / 1e9:.2f} GB")
    print(
        f"LENS_EVALS_MAX_HELD_CAPTURE_GIB {settings.MAX_HELD_CAPTURE_GIB.get():.1f}, "
        f"LENS_EVALS_DEVICE_BUDGET_MIB {settings.DEVICE_BUDGET_MIB.get():.0f}, "
        f"LENS_EVALS_HANDOFF_POOL_MIB {settings.HANDOFF_POOL_MIB.get():.0f}"
    )
    llm = LLM(str(model), load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16", max_model_len=1024, enforce_eager=True)
    inputs = [{"prompt_token_ids": ids} for ids in prompts]
    plain_params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, detokenize=False)
    llm.generate(inputs[:8], plain_params, use_tqdm=False)  # warm-up
    start = time.monotonic()
    plain = llm.generate(inputs, plain_params, use_tqdm=False)
    plain_s = time.monotonic() - start
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, detokenize=False, extra_args={"output_residual_stream": LAYERS})
    start = time.monotonic()
    try:
        outs = llm.generate(inputs, params, use_tqdm=False)
        error = None
    except Exception as exc:  # the failure being checked: report it with what came back
        outs, error = getattr(exc, "outputs", None) or [], f"{type(exc).__name__}: {str(exc)[:600]}"
    capture_s = time.monotonic() - start
    whole = 0
    for ids, out in zip(prompts, outs, strict=False):
        acts = getattr(out, "activations", None) or {}
        stream = acts.get("residual_stream")
        if stream is not None and tuple(stream.shape) == (len(LAYERS), len(ids), HIDDEN):
            whole += 1
    same_tokens = sum(a.outputs[0].token_ids == b.outputs[0].token_ids for a, b in zip(plain, outs, strict=False))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    report = {
        "prompts": n,
        "tokens": tokens,
        "whole_captures": whole,
        "tokens_equal_plain": int(same_tokens),
        "plain_s": round(plain_s, 2),
        "capture_s": round(capture_s, 2),
        "ratio": round(capture_s / plain_s, 3),
        "peak_rss_gib": round(peak, 1),
        "error": error,
    }
    print(json.dumps(report))
    return 0 if whole == n and error is None else 1


KV_CHILD = """
import json, sys
from vllm import LLM
llm = LLM(sys.argv[1], load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16", max_model_len=1024,
          enforce_eager=True, gpu_memory_utilization=0.5)
config = llm.llm_engine.vllm_config.cache_config
print("KV", json.dumps({"blocks": config.num_gpu_blocks, "block_size": config.block_size}))
"""


def kv_check(work: Path) -> None:
    """The KV cache an engine gets with the lens budget 0 and 4096 MiB (one small model)."""
    model, _ = build(work, 1)
    per_block = None
    blocks = {}
    for budget in ("0", "4096"):
        env = {**os.environ, "LENS_EVALS_DEVICE_BUDGET_MIB": budget}
        done = subprocess.run([sys.executable, "-c", KV_CHILD, str(model)], env=env, capture_output=True, text=True)
        line = next((line for line in done.stdout.splitlines() if line.startswith("KV ")), None)
        if line is None:
            print(f"budget {budget}: engine failed\n{done.stderr[-2000:]}")
            return
        found = json.loads(line[3:])
        blocks[budget] = found["blocks"]
        # Llama-8B: 32 layers x 2 (K, V) x 8 heads x 128 x bf16 per token
        per_block = found["block_size"] * 32 * 2 * 8 * 128 * 2
    assert per_block is not None
    freed = (blocks["0"] - blocks["4096"]) * per_block / 2**20
    print(f"KV blocks: budget 0 -> {blocks['0']}, budget 4096 MiB -> {blocks['4096']}: {freed:.0f} MiB kept for lens requests")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=1000)
    parser.add_argument("--work", default="/tmp/held-capture")
    parser.add_argument("--kv-check", action="store_true")
    args = parser.parse_args()
    work = Path(args.work)
    if args.kv_check:
        kv_check(work)
        return 0
    return held_capture(work, args.prompts)


if __name__ == "__main__":
    sys.exit(main())
