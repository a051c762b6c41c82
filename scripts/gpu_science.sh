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
DTYPE=${DTYPE:-bfloat16}
GPU_MEM=${GPU_MEM:-0.5}
SRC=${SRC:-/tmp/src}
PY=${PYTHON:-python3}
out=${WORK:-/tmp/science}
mkdir -p "$out/probes" "$out/logs"
export PYTHONPATH=/tmp/site:$SRC${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export LENS_EVALS_MODEL_DIR=${LENS_EVALS_MODEL_DIR:-/tmp/gm} LENS_EVALS_GGUF_DIR=${GGUF_DIR:-/tmp/gmw}
export LENS_EVALS_DEQUANT_DTYPE=$DTYPE LENS_EVALS_PROBE_DIR=$out/probes VLLM_USE_V2_MODEL_RUNNER=0
export INSPECT_LOG_DIR=$out/logs INSPECT_DISPLAY=plain
bring_back() { if [ -n "${OUT:-}" ] && [ "$OUT" != "$out" ]; then cp -r "$out/." "$OUT/"; fi; }
trap bring_back EXIT
trap 'exit 143' TERM INT
cd "$SRC" || exit 1
on_gpu=$("$PY" -c "import torch; print(int(torch.cuda.is_available()))" 2>/dev/null || echo 0)
if [ "$on_gpu" = 1 ] || ! "$PY" -c "from importlib.metadata import version; version('lens-evals')" 2>/dev/null; then
  # installed (not only on the path): vLLM finds the plugin and Inspect the provider by their entry points;
  # /tmp/site comes first on the path, so this copy of $SRC is the code that runs
  "$PY" -m pip install -q --no-deps --no-build-isolation --no-index --upgrade --target /tmp/site "$SRC" || exit 1
fi
gpu_args=()
[ "$on_gpu" = 1 ] && gpu_args=(--gpu-memory-utilization "$GPU_MEM")
set_file=$out/probes/${MODEL}__probe-set.json
limit_args=()
[ -n "${LIMIT:-}" ] && limit_args=(--limit "$LIMIT")  # samples per Inspect eval (CPU checks only)

step() {  # step NAME COMMAND...: run, log to $WORK/NAME.log, print the exit code, the time and the log's tail
  local name=$1 start=$SECONDS rc; shift
  echo "== $name: $*"
  "$@" > "$out/$name.log" 2>&1; rc=$?
  bring_back
  echo "== $name: exit $rc after $((SECONDS - start)) s"
  grep -vE "it/s\]|s/it\]|Processed prompts|dialogue/s" "$out/$name.log" | tail -n "${TAIL:-25}" | cut -c1-300
  return $rc
}

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

echo "model $MODEL, dtype $DTYPE, on GPU: $on_gpu, out $out, code $(git -C "$SRC" rev-parse --short HEAD 2>/dev/null || cat "$SRC/COMMIT" 2>/dev/null || echo '?')"
for s in ${STEPS:-prepare science eval}; do
  case $s in
    prepare) step 01-prepare "$PY" -m lens_evals.cli models path "$MODEL" || exit 1 ;;
    science) TAIL=60 step 02-science science || exit 1 ;;
    eval) TAIL=80 step 03-eval evals ;;
    *) echo "unknown step $s (prepare, science, eval)"; exit 2 ;;
  esac
done
ls -la "$out" "$out/probes" "$out/logs"
