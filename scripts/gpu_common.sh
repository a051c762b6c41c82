# Sourced by scripts/gpu_science.sh and scripts/gpu_probe_recipes.sh (not run on its own): the
# settings, the install of $SRC and the step runner those two GPU scripts share. Before sourcing,
# the script sets `out` (its results folder) and defines `bring_back` (what it copies to $OUT).
# Reads DTYPE (default bfloat16), GPU_MEM (0.5), SRC (/tmp/src), PYTHON (python3), GGUF_DIR and
# LENS_EVALS_MODEL_DIR; sets PY, on_gpu (1 or 0) and the environment every step runs in.
DTYPE=${DTYPE:-bfloat16}
GPU_MEM=${GPU_MEM:-0.5}
SRC=${SRC:-/tmp/src}
PY=${PYTHON:-python3}
export PYTHONPATH=/tmp/site:$SRC${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export LENS_EVALS_MODEL_DIR=${LENS_EVALS_MODEL_DIR:-/tmp/gm} LENS_EVALS_GGUF_DIR=${GGUF_DIR:-/tmp/gmw}
export LENS_EVALS_DEQUANT_DTYPE=$DTYPE VLLM_USE_V2_MODEL_RUNNER=0
trap bring_back EXIT
trap 'exit 143' TERM INT
cd "$SRC" || exit 1
on_gpu=$("$PY" -c "import torch; print(int(torch.cuda.is_available()))" 2>/dev/null || echo 0)
if [ "$on_gpu" = 1 ] || ! "$PY" -c "from importlib.metadata import version; version('lens-evals')" 2>/dev/null; then
  # installed (not only on the path): vLLM finds the plugin and Inspect the provider by their entry
  # points; /tmp/site comes first on the path, so this copy of $SRC is the code that runs
  "$PY" -m pip install -q --no-deps --no-build-isolation --no-index --upgrade --target /tmp/site "$SRC" || exit 1
fi

step() {  # step NAME COMMAND...: run, log to $out/NAME.log, print the exit code, the time and the log's tail
  local name=$1 start=$SECONDS rc; shift
  echo "== $name: $*"
  "$@" > "$out/$name.log" 2>&1; rc=$?
  bring_back
  echo "== $name: exit $rc after $((SECONDS - start)) s"
  grep -vE "it/s\]|s/it\]|Processed prompts|dialogue/s" "$out/$name.log" | tail -n "${TAIL:-25}" | cut -c1-300
  return $rc
}

code_version() {  # the commit of $SRC (a checkout's HEAD, or a git archive's COMMIT file)
  git -C "$SRC" rev-parse --short HEAD 2>/dev/null || cat "$SRC/COMMIT" 2>/dev/null || echo '?'
}
