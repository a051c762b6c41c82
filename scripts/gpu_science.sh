#!/usr/bin/env bash
# The issue-20 science run for one model on the lent GPU machine (vLLM 0.26, one H200), after the
# wheels (scripts/gpu_suite.sh header), the code (.gpu-src, unpacked to /tmp/src) and the model
# chunks (scripts/prepare_gpu_models.sh header: .gpu-models/m00 ... then join.sh) were carried:
#   bash /tmp/src/scripts/gpu_science.sh
# or, to stay well inside the 10-minute limit of one device call, two calls back to back:
#   STEPS="prepare science" bash /tmp/src/scripts/gpu_science.sh      then      STEPS=eval bash ...
# Results are kept in $WORK (default /tmp/science, kept between calls) and copied into $OUT at
# the end of every call, so each call brings back all that was made so far.
# Steps (STEPS, default "prepare science eval"; each logs to $WORK/NN-step.log):
#   prepare  the model directory (no-op when join.sh prepared it; else offline from $GGUF_DIR/MODEL.gguf,
#            the same pins and header checks), dequantised to $DTYPE (default bfloat16)
#   science  `lens-evals probes science`: every layer captured, the layer chosen on Instructed-Pairs
#            validation, the three probes, all Instructed-Pairs dialogues ($IP_LIMIT) and all control
#            requests ($CONTROL_LIMIT) answered with $CONTROL_TOKENS tokens; JSON + probe set in $WORK
#   eval     one lens server (gpu_memory_utilization $GPU_MEM) for: the three-probe Inspect eval
#            (off-policy), the grader's accuracy on the 288 labelled off-policy completions
#            (scripts/grader_check.py), and the on-policy eval (ip-lr exported from the probe set),
#            the model answering and grading its own answers
# Engine dtype = $DTYPE everywhere (the probes see the activations they are served with).
# Everything (logs, results JSON, probe set, Inspect logs) is written under $WORK and copied to $OUT.
# On CPU (a check of the script, tiny limits): SRC=$PWD PYTHON=.venv/bin/python WORK=/tmp/out
#   LENS_EVALS_MODEL_DIR=~/.cache/lens-evals/models MODEL=smollm2-135m-instruct DTYPE=float32 IP_LIMIT=20 RP_LIMIT=10
#   CONTROL_LIMIT=8 CONTROL_TOKENS=8 LIMIT=4 VLLM_CPU_KVCACHE_SPACE=1 bash scripts/gpu_science.sh
set -uo pipefail
MODEL=${MODEL:-qwen2.5-coder-1.5b-instruct}
out=${WORK:-/tmp/science}
mkdir -p "$out/probes" "$out/logs"
bring_back() { if [ -n "${OUT:-}" ] && [ "$OUT" != "$out" ]; then cp -r "$out/." "$OUT/"; fi; }
# DTYPE, GPU_MEM, SRC, PY, on_gpu, the environment, the install of $SRC, step, code_version
. "$(dirname "${BASH_SOURCE[0]}")/gpu_common.sh"
export LENS_EVALS_PROBE_DIR=$out/probes INSPECT_LOG_DIR=$out/logs INSPECT_DISPLAY=plain
gpu_args=()
[ "$on_gpu" = 1 ] && gpu_args=(--gpu-memory-utilization "$GPU_MEM")
set_file=$out/probes/${MODEL}__probe-set.json
limit_args=()
[ -n "${LIMIT:-}" ] && limit_args=(--limit "$LIMIT")  # samples per Inspect eval (CPU checks only)

science() {
  local engine=(--engine-arg seed=0)
  [ "$on_gpu" = 1 ] && engine+=(--engine-arg "gpu_memory_utilization=$GPU_MEM")
  "$PY" -m lens_evals.cli probes science --model "$MODEL" --dtype "$DTYPE" --out "$out" "${engine[@]}" \
    ${IP_LIMIT:+--limit "$IP_LIMIT"} ${CONTROL_LIMIT:+--control-limit "$CONTROL_LIMIT"} ${RP_LIMIT:+--roleplaying-limit "$RP_LIMIT"} --control-max-tokens "${CONTROL_TOKENS:-48}"
}

evals() {
  local dir port server rc=0
  dir=$("$PY" -m lens_evals.cli models path "$MODEL") || return 1
  port=$("$PY" -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
  setsid "$PY" -m vllm.entrypoints.openai.api_server --model "$dir" --served-model-name "$MODEL" --host 127.0.0.1 \
    --port "$port" --dtype "$DTYPE" --max-model-len 4096 --seed 0 "${gpu_args[@]}" \
    --override-generation-config '{"max_new_tokens": 64}' > "$out/server.log" 2>&1 &
  # max_new_tokens: every reply at most 64 tokens (the on-policy grader asks with no limit and a
  # small model may not stop); the evals ask for 1 (scoring) to 48 (on-policy answers)
  server=$!
  export VLLM_LENS_BASE_URL=http://127.0.0.1:$port/v1
  if ! "$PY" -c "
import sys, time, httpx
for _ in range(600):
    try:
        if httpx.get('http://127.0.0.1:$port/health', timeout=2).status_code == 200: sys.exit(0)
    except httpx.HTTPError: time.sleep(1)
sys.exit(1)"; then
    echo "server did not become healthy; its log:"; tail -40 "$out/server.log"; kill -- -"$server"; return 1
  fi
  echo "server up (pid $server, port $port)"
  local inspect=("$PY" -m inspect_ai eval tasks/roleplaying_probe.py --model "vllm-lens/$MODEL" --log-dir "$out/logs"
                 --max-connections 64 --display plain "${limit_args[@]}")
  "${inspect[@]}" -T probes=ip-lr,ip-dom,rp-lr -T "probe_set=$set_file" || rc=1
  "$PY" scripts/grader_check.py --model "vllm-lens/$MODEL" --out "$out/grader_check.json" ${LIMIT:+--limit "$LIMIT"} || rc=1
  probe=$("$PY" -c "from lens_evals.probing.multi import export_single_probe as e; print(e('$set_file', 'ip-lr', '$out/probes'))") || rc=1
  "${inspect[@]}" -T "probe=$probe" -T mode=on_policy -T "grader=vllm-lens/$MODEL" || rc=1
  kill -- -"$server"; wait "$server" 2>/dev/null
  return $rc
}

echo "model $MODEL, dtype $DTYPE, on GPU: $on_gpu, out $out, code $(code_version)"
for s in ${STEPS:-prepare science eval}; do
  case $s in
    prepare) step 01-prepare "$PY" -m lens_evals.cli models path "$MODEL" || exit 1 ;;
    science) TAIL=60 step 02-science science || exit 1 ;;
    eval) TAIL=80 step 03-eval evals ;;
    *) echo "unknown step $s (prepare, science, eval)"; exit 2 ;;
  esac
done
ls -la "$out" "$out/probes" "$out/logs"
