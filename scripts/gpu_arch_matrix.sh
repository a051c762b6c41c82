#!/usr/bin/env bash
# The architecture matrix on the lent GPU machine (vLLM 0.26, one H200), in one device call of at
# most 10 minutes, after `. .gpu/install.sh` (vLLM 0.26 from ../shared/tools/gpu-wheelhouse, built
# with GPU_EXTRA_PKGS="pytest==9.2.0 pytest-timeout==2.4.0 iniconfig==2.3.1 pluggy==1.7.0").
# One pytest process, tests one after another: vLLM's start-up memory profiling fails when
# another process on the device allocates or frees meanwhile (seen 2026-12-03 with three).
# The default selection: the stream contracts in eager mode, graph mode (GRAPH list), Model
# Runner V2, speculative decoding, unverified architectures, graph-mode refusal; K overrides it,
# FILES the test file (multimodal language towers: FILES=tests/engine/test_multimodal_towers.py K=multimodal).
# The tiny models: copy the prepared tiny Llama (and any zoo models) into a git-ignored folder,
# carry it in a call of its own (the 64 MiB limit; a chunk is 52 MB), copy it to /tmp/gm there and
# set LENS_EVALS_MODEL_DIR=/tmp/gm; tests/arch_zoo.py builds what is missing or whose config
# differs (GPU_OVERRIDES, another transformers version). Results: $OUT/gpu_matrix.json for
# scripts/model_support_table.py (copy it under docs/model_support/), the log in $OUT/matrix.log.
set -uo pipefail
python3 -m pip install -q --no-deps --no-build-isolation --no-index --target /tmp/site . || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 LENS_EVALS_MODEL_DIR=${LENS_EVALS_MODEL_DIR:-$PWD/.lens-models}
out=${OUT:-/tmp}
python3 -c "import torch, vllm, transformers; print('torch', torch.__version__, 'vllm', vllm.__version__, 'transformers', transformers.__version__, 'gpus', torch.cuda.device_count())"
K=${K:-"(matches_hf and not graph_mode and (Qwen3Moe or GPT2 or Olmo2 or StableLm or DeepseekV2)) or graph_mode_matches or differs_from_hf or graph_mode_runs or runner_v2 or speculative or unverified or worker_refuses or graph_mode_is_refused"}
LENS_EVALS_MATRIX_RESULTS=$out/gpu_matrix.json timeout ${LIMIT:-540} python3 -m pytest -p no:cacheprovider -q \
  --timeout 300 -m "gpu or slow or not slow" ${FILES:-tests/engine/test_architectures.py} -k "$K" > "$out/matrix.log" 2>&1
grep -hE "^(FAILED|ERROR)|^E  |[0-9]+ (passed|failed)" "$out/matrix.log" | cut -c1-300 | head -40
