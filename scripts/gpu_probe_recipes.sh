#!/usr/bin/env bash
# The probe-recipe study (#41, `lens-evals probes recipes`) for one or more models on the lent GPU
# machine (vLLM 0.26, bf16), after the wheels (scripts/gpu_suite.sh header), the code (.gpu-src,
# unpacked to /tmp/src) and the model chunks (scripts/prepare_gpu_models.sh header: .gpu-models/m00
# ... then join.sh, once per model) were carried. One device call per model and step keeps each well
# inside the 10-minute limit:
#   MODELS=qwen2.5-coder-0.5b-instruct STEPS="prepare capture" bash /tmp/src/scripts/gpu_probe_recipes.sh
#   MODELS=qwen2.5-coder-0.5b-instruct STEPS=fit bash /tmp/src/scripts/gpu_probe_recipes.sh
#   MODELS=qwen2.5-coder-1.5b-instruct STEPS="prepare capture" bash ...    then    STEPS="fit table" ...
# (or all at once: MODELS="qwen2.5-coder-0.5b-instruct qwen2.5-coder-1.5b-instruct" bash ..., when
# the machine is known to be fast enough). Results are kept in $WORK (default /tmp/recipes, kept
# between calls on the same warm machine) and copied into $OUT at the end of every call.
# Steps (STEPS, default "prepare capture fit table"; each logs to $WORK/NN-step-MODEL.log):
#   prepare  the model directory (no-op when join.sh prepared it), dequantised to $DTYPE (default bfloat16)
#   capture  `probes recipes --capture-only`: the model's control answers ($CONTROL_LIMIT x $CONTROL_TOKENS
#            tokens) and every dataset's capture at the candidate layers (Roleplaying, control,
#            Instructed-Pairs, Varied-Pairs, on-policy lies when the study has them; each with and
#            without the follow-up), float16, in $WORK/cache/MODEL; a call that runs out of time
#            keeps the captures it finished, the next call captures only the rest
#   fit      `probes recipes` over the complete cache: the model is not loaded (host CPU only); every
#            recipe fitted, layers and aggregation chosen on the Roleplaying development split,
#            AUROC with its bootstrap interval and recall at 1 % FPR on the test split:
#            $WORK/results/recipes-MODEL-DTYPE.json
#   table    `probes recipes-report` over every results JSON in $WORK/results: the markdown table
#            ($WORK/results/recipes-table.md) and the plot ($WORK/results/recipes-gpu.png)
# Engine dtype = $DTYPE everywhere (the probes see the activations they are served with).
# On CPU (a check of the script, tiny limits): SRC=$PWD PYTHON=.venv/bin/python WORK=/tmp/rcheck
#   LENS_EVALS_MODEL_DIR=~/.cache/lens-evals/models MODELS=smollm2-135m-instruct DTYPE=float32 TRAIN_LIMIT=12
#   RP_LIMIT=24 CONTROL_LIMIT=6 CONTROL_TOKENS=6 VLLM_CPU_KVCACHE_SPACE=1 bash scripts/gpu_probe_recipes.sh
set -uo pipefail
MODELS=${MODELS:-qwen2.5-coder-0.5b-instruct qwen2.5-coder-1.5b-instruct}
out=${WORK:-/tmp/recipes}
mkdir -p "$out/results" "$out/cache"
bring_back() { if [ -n "${OUT:-}" ] && [ "$OUT" != "$out" ]; then cp -r "$out/results" "$out"/*.log "$OUT/" 2>/dev/null; fi; }
# DTYPE, GPU_MEM, SRC, PY, on_gpu, the environment, the install of $SRC, step, code_version
. "$(dirname "${BASH_SOURCE[0]}")/gpu_common.sh"

study() {  # study MODEL [--capture-only]
  local model=$1; shift
  local engine=(--engine-arg seed=0 --engine-arg "dtype=$DTYPE")
  [ "$on_gpu" = 1 ] && engine+=(--engine-arg "gpu_memory_utilization=$GPU_MEM")
  "$PY" -m lens_evals.cli probes recipes --model "$model" --out "$out/results" --cache "$out/cache/$model" "${engine[@]}" \
    ${TRAIN_LIMIT:+--limit "$TRAIN_LIMIT"} ${RP_LIMIT:+--roleplaying-limit "$RP_LIMIT"} --control-limit "${CONTROL_LIMIT:-300}" --control-max-tokens "${CONTROL_TOKENS:-32}" "$@"
}

table() {
  local results=("$out"/results/recipes-*.json)
  [ -e "${results[0]}" ] || { echo "no results in $out/results"; return 1; }
  "$PY" -m lens_evals.cli probes recipes-report "${results[@]}" --out "$out/results/recipes-gpu.png" > "$out/results/recipes-table.md"
  cat "$out/results/recipes-table.md"
}

echo "models $MODELS, dtype $DTYPE, on GPU: $on_gpu, out $out, code $(code_version)"
for s in ${STEPS:-prepare capture fit table}; do
  case $s in
    prepare) for m in $MODELS; do step "01-prepare-$m" "$PY" -m lens_evals.cli models path "$m" || exit 1; done ;;
    capture) for m in $MODELS; do step "02-capture-$m" study "$m" --capture-only || exit 1; done ;;
    fit) for m in $MODELS; do TAIL=40 step "03-fit-$m" study "$m" || exit 1; done ;;
    table) TAIL=40 step 04-table table ;;
    *) echo "unknown step $s (prepare, capture, fit, table)"; exit 2 ;;
  esac
done
ls -la "$out/results" "$out/cache"/*
