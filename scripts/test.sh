#!/usr/bin/env bash
# The test command: set-up (idempotent), then the default suite. Extra args go to pytest
# (e.g. `scripts/test.sh -m slow` for the slow suite).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# Lint, format and types first (seconds): ruff on the whole tree, mypy on the whole package (the public
# surface strictly; pyproject.toml).
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/mypy
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}
exec .venv/bin/python -m pytest "$@"
