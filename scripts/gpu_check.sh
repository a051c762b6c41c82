#!/usr/bin/env bash
# On the lent GPU machine, after .gpu/install.sh (vLLM 0.26 into /tmp/site): install this package
# (entry points included, no dependencies) and run the engine tests there.
set -uo pipefail
python3 -m pip install -q --no-deps --no-build-isolation --no-index --target /tmp/site . || exit 1
export PYTHONPATH=/tmp/site:$PWD LENS_EVALS_MODEL_DIR=/tmp/lens-models PYTHONUNBUFFERED=1
python3 -c "import torch, vllm; print('torch', torch.__version__, 'vllm', vllm.__version__, 'gpus', torch.cuda.device_count())"
python3 -m pytest -p no:cacheprovider -q --timeout 300 "$@" 2>&1 | tee "${OUT:-/tmp}/gpu_tests.log"
