#!/usr/bin/env bash
# Issue #47 on the lent GPU, ONE device call (< 6 min with the engine start): where graph-mode
# decode spends the overhead of capture / steering / three probes over plain requests
# (scripts/decode_profile.py: random Llama-8B shape, bf16, 256 prompts x 128 tokens, layer 16,
# CUDA graphs + torch.compile, paired rounds on one in-process engine, the pre-#47 worker paths
# in the same rounds, phases per step, cProfile and torch.profiler of one round per feature).
# vLLM 0.26 as for scripts/gpu_bench.sh (its header: the wheel chunks, then `. .gpu/install.sh`):
#   ... last chunk call: cp .gpu/cNN/* /tmp/w/ && . .gpu/install.sh && bash scripts/gpu_decode_profile.sh
# Extra arguments go to decode_profile.py (e.g. --rounds 3, --eager, --prompts 64 --max-tokens 32).
# Output: $OUT/decode-profile/decode-profile.md (the tables), .json, cprofile-*.txt, torch-*.txt.
set -uo pipefail
python3 -m pip install -q --no-deps --no-build-isolation --no-index --target /tmp/site . >/dev/null || exit 1
export PYTHONPATH=/tmp/site:$PWD LENS_EVALS_MODEL_DIR=/tmp/lens-models PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false \
  VLLM_CACHE_ROOT=/tmp/kc/vllm TRITON_CACHE_DIR=/tmp/kc/triton
python3 -c "import torch, vllm; print('torch', torch.__version__, 'vllm', vllm.__version__)"
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
out="${OUT:-/tmp/out}/decode-profile"
mkdir -p "$out"
timeout "${DECODE_PROFILE_TIMEOUT:-540}" python3 scripts/decode_profile.py --gpu --rounds 4 --compare-old --cprofile --torch-profile \
  --out "$out" "$@" 2>&1 | grep -v " INFO " | tee "$out/run.log"
exit "${PIPESTATUS[0]}"
