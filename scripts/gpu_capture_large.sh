#!/usr/bin/env bash
# Issue #21's capture larger than RAM, on the lent GPU machine (one H200, vLLM 0.26): `lens-evals
# capture` of 1,000 prefill-bench prompts (token ids, 40-400 tokens, ~170 each) at all 32 layers of
# a Llama-8B-shaped model in bf16: 1,000 x ~170 x 32 x 4,096 x 2 B ~ 44 GB written to disk, with
# the peak RSS of the capture process (the engine runs in it: VLLM_ENABLE_V1_MULTIPROCESSING=0).
# The weights are vLLM's random `load_format=dummy` (config only, no 16 GB of weights on the
# 64 GiB disk next to the 44 GB capture; what is measured is memory and disk, not the numbers).
# Run after the wheels' install (scripts/gpu_suite.sh's header), from the repository:
#   N_PROMPTS=1000 bash scripts/gpu_capture_large.sh      (the report goes to $OUT/capture-large.txt)
# CONFIG_ONLY=1 writes the model config and the prompts only (for scripts/http_capture_bench.py).
set -uo pipefail
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false VLLM_USE_V2_MODEL_RUNNER=0
out=${OUT:-/tmp}
work=${CAPTURE_WORK:-/tmp/capture-large}
report=$out/capture-large.txt
rm -rf /tmp/w /tmp/w.tar /tmp/whl "$work"  # the wheels' install leftovers (installed in /tmp/site): disk for the capture
# the benchmark's 16 GB model (scripts/gpu_bench.sh; rebuilt in ~25 s when needed) if the disk
# cannot hold the capture beside it
if [ -z "${CONFIG_ONLY:-}" ] && [ -d /tmp/lens-evals-bench-llama8b ] && [ "$(df --output=avail -B1G /tmp | tail -1)" -lt 52 ]; then
  echo "removing /tmp/lens-evals-bench-llama8b: the capture needs ~45 GB" && rm -rf /tmp/lens-evals-bench-llama8b
fi
mkdir -p "$work/model"
{
  # the archive's COMMIT file beside scripts/ (git archive --add-virtual-file), else git
  root=$(cd "$(dirname "$0")/.." && pwd)
  echo "gpu_capture_large.sh at $(cat "$root/COMMIT" 2>/dev/null || git -C "$root" rev-parse --short HEAD 2>/dev/null || echo '?'), $(date -u +%FT%TZ)"
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
  df -h /tmp | tail -1
  python3 - "$work" "${N_PROMPTS:-1000}" <<'EOF'
import json, sys
from pathlib import Path
from transformers import LlamaConfig
from benchmarks.gpu_model import LLAMA_8B
from benchmarks.prefill import prefill_lengths
from benchmarks.prompts import make_prompts

work, n = Path(sys.argv[1]), int(sys.argv[2])
LlamaConfig(**LLAMA_8B, torch_dtype="bfloat16", architectures=["LlamaForCausalLM"]).save_pretrained(work / "model")
lengths = prefill_lengths(n)
with open(work / "prompts.jsonl", "w") as f:
    for ids in make_prompts(n, work / "model", LLAMA_8B["vocab_size"], lengths=lengths):
        f.write(json.dumps({"prompt_token_ids": ids}) + "\n")
tokens = sum(lengths)
print(f"{n} prompts, {tokens} tokens; capture of 32 layers x 4096 x bf16: {tokens * 32 * 4096 * 2 / 1e9:.1f} GB")
EOF
  if [ -n "${CONFIG_ONLY:-}" ]; then echo "CONFIG_ONLY: the model config and prompts are in $work"; exit 0; fi
  layers=$(python3 -c "print(','.join(map(str, range(32))))")
  # peak RSS of the capture process, from the kernel's accounting of the finished child
  python3 - "$work" "$layers" <<'EOF'
import resource, subprocess, sys, time
work, layers = sys.argv[1], sys.argv[2]
command = [sys.executable, "-m", "lens_evals.cli", "capture", f"{work}/prompts.jsonl", "--model", f"{work}/model",
           "--layers", layers, "--out", f"{work}/out", "--dtype", "bfloat16", "--max-model-len", "1024",
           "--engine-arg", "load_format=dummy", "--engine-arg", "skip_tokenizer_init=true"]
start = time.monotonic()
done = subprocess.run(command, capture_output=True, text=True)
wall = time.monotonic() - start
print("\n".join(done.stderr.splitlines()[-8:]))
print(done.stdout.strip())
peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20
print(f"exit {done.returncode}; wall {wall:.0f} s; peak RSS of the capture process {peak:.2f} GiB")
EOF
  du -sh "$work/out" 2>&1
  ls "$work/out" | wc -l
  python3 - "$work/out" <<'EOF'
import sys, time
from lens_evals.capture.loader import CaptureReader
start = time.monotonic()
reader = CaptureReader(sys.argv[1])  # verifies every shard's checksum
rows = tokens = 0
for row in reader.rows(layers=[16]):
    rows += 1
    tokens += len(row.token_ids)
print(f"loader: {rows} rows ({tokens} tokens) of layer 16 read back, shards verified, in {time.monotonic() - start:.0f} s")
EOF
  df -h /tmp | tail -1
} 2>&1 | tee "$report"
rm -rf "$work/out"
