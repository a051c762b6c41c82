#!/usr/bin/env bash
# `lens-evals bench --gpu` on the lent GPU machine (one H200), in calls of at most 10 minutes.
#
# vLLM 0.26 comes from ../shared/tools/gpu-wheelhouse (see its header): it lays wheel chunks under
# .gpu/ that are carried in back-to-back device calls; the last call runs `. .gpu/install.sh`
# (vLLM into /tmp/site). For the chart add matplotlib, and for the nnsight rows nnsight, to the
# wheels when building the chunks:
#   GPU_EXTRA_PKGS="matplotlib==3.11.2 contourpy==1.3.3 cycler==0.12.1 fonttools==4.68.0 \
#     kiwisolver==1.5.1 pyparsing==3.3.3 nnsight==0.8.1 greenlet==3.5.6 websocket-client==1.9.2" \
#     bash ../shared/tools/gpu-wheelhouse
# (TransformerLens 4.3 needs transformers>=5.9 and pulls wandb/pandas/pyarrow/datasets: its row
# says "not installed" unless you add those too.) Without matplotlib the PNG is skipped.
#
# One system set per call (each vLLM engine start loads the 16 GB model; the machine keeps /tmp
# between calls while it stays warm, so the model is built once and results accumulate in
# $BENCH_DIR; every call copies the report so far to $OUT/bench, with every system's JSON and
# log in $OUT/bench/all.tar.gz):
#   ... last chunk call: cp .gpu/cNN/* /tmp/w/ && . .gpu/install.sh && bash scripts/gpu_bench.sh vllm-graphs,vllm-eager
#   bash scripts/gpu_bench.sh lens-capture-1,lens-steer-1
#   bash scripts/gpu_bench.sh lens-probe,hf-hook
#   bash scripts/gpu_bench.sh lens-capture-all
#   bash scripts/gpu_bench.sh nnsight-hf,nnsight-vllm,tl-bridge
# Our features against plain requests on ONE engine, rounds paired (what a noisy host cannot
# blur; ~3-5 min each, add LENS_EVALS_BENCH_PROFILE=$BENCH_DIR/profiles for cProfile per feature):
#   bash scripts/gpu_bench.sh lens-mixed,lens-graphs-mixed
# Where our time goes (host-GPU syncs by Python line, one extra untimed run per vLLM system; a
# separate BENCH_DIR because the config differs):
#   BENCH_DIR=/tmp/lens-evals-syncs bash scripts/gpu_bench.sh vllm-eager,lens-capture-1,lens-steer-1 \
#     --engine inprocess --sync-debug --prompts 64 --max-tokens 16
# Device time seen (2026-12-03): a machine start 120-180 s, the eight chunk calls ~35 s, the 8B
# model build ~25 s, vllm-graphs 146-159 s to start (compile + graph capture), the graph-mode
# systems 21-49 s, eager systems 13-19 s; each timed run 1.6-5 s. Two sessions' budgets (1800 s)
# fitted: graphs + graph capture in one call, the other graph systems + eager in the next.
# Without vLLM (no chunks needed): `python3 scripts/fetch_path_bench.py` times the end of a
# capture run (release, write, claim; inline / files / the shared pool) on the GPU host.
# Extra arguments go to `lens-evals bench` (e.g. --prompts 64 --max-tokens 32 --gpu-layers 8 for
# a quick smoke run; use the same ones in every call, or the earlier results are not reused).
#
# WORKLOAD=prefill (issue #21): 1,000 Alpaca-like token-id prompts (40-400 tokens), max_tokens=1,
# every token of the layer captured, best of 2 after a warm-up, results in its own BENCH_DIR
# (/tmp/lens-evals-bench-prefill). SYSTEMS left out: the table and the paired eager rounds
# (plain / capture 1 layer / 8 layers / steering / 3 probes on one engine). That list does NOT fit
# one device call (2026-12-04: vLLM with graphs took 188 s to start, every other 8B system ~60 s
# of process; the call was cut after four systems), so run it as calls of a few systems each
# (same BENCH_DIR: --resume keeps what is done; wrap each in `timeout 540` and copy $BENCH_DIR out
# after, as a cut call writes no report):
#   WORKLOAD=prefill bash scripts/gpu_bench.sh vllm-eager,lens-capture-1,lens-steer-1,lens-mixed
#   WORKLOAD=prefill bash scripts/gpu_bench.sh vllm-graphs,lens-graphs-capture-1,lens-graphs-probe
#   WORKLOAD=prefill bash scripts/gpu_bench.sh hf-forward,lens-graphs-mixed,lens-capture-8,lens-graphs-capture-8
# Capture 8 layers and the pool (H200 2026-12-05: 2.21x paired with the 4 GiB pool; H100 2026-12-05
# with the quarter-of-memory default: 1.067x, repeats 4, 435 s with the install), phases of both:
#   LENS_EVALS_TIMING=1 WORKLOAD=prefill bash scripts/gpu_bench.sh lens-mixed --repeats 6
#   BENCH_DIR=/tmp/prefill-pool4g LENS_EVALS_HANDOFF_POOL_MIB=4096 LENS_EVALS_TIMING=1 \
#     WORKLOAD=prefill bash scripts/gpu_bench.sh lens-mixed --repeats 6
#   python3 -m benchmarks.phases /tmp/lens-evals-bench-prefill   (and /tmp/prefill-pool4g)
# All 32 layers (H100 2026-12-05: 1,000 prompts = 43.9 GB in one call took > 34 s against 3.94 s
# plain, and the engine core died in the second call; benchmarks/results/NOTEBOOK.md says why): the same
# bytes per call as capture-8 with a quarter of the prompts, own BENCH_DIR (the prompts differ):
#   BENCH_DIR=/tmp/prefill-250 LENS_EVALS_TIMING=1 WORKLOAD=prefill bash scripts/gpu_bench.sh \
#     vllm-eager,lens-capture-all,lens-capture-8 --prompts 250
# Would the step copies straight into the pool pay (the design in benchmarks/results/NOTEBOOK.md)? ~1 min,
# torch only, no vLLM needed:  python3 scripts/direct_copy_bench.py --gib 8
# Every call needs the package installed where vLLM finds its plugin (this script does it; a bare
# `python3 scripts/...` after `. .gpu/install.sh` does not: the engine starters now refuse):
#   python3 -m pip install -q --no-deps --no-build-isolation --no-index --target /tmp/site .
# Over HTTP (H200 2026-12-05: 2.03x with base64 JSON; H100 2026-12-05 at ff5f8fe: the frame 1.59x,
# plain 1.04x; since: served fetches batched, engine/fetch_batch.py, and LensClient on urllib3),
# ~4 min: the frame and plain requests, LensClient's transport against the former httpx one, 64
# and 256 requests in flight (are the steps under-filled with 64?), one engine:
#   python3 scripts/http_capture_bench.py --model /tmp/lens-evals-bench-llama8b \
#     --engine-arg skip_tokenizer_init=true --prompts 1000 --layer 16 --rounds 1 \
#     --encodings plain safetensors-frame --client threads httpx-threads --concurrency 64 256 --out $OUT/http.json
# The hand-off settings' effect (their defaults changed after the 2026-12-04 run): the old ones
# in a BENCH_DIR of their own, e.g.
#   BENCH_DIR=/tmp/prefill-old-handoff LENS_EVALS_HANDOFF_MIN_BYTES=1048576 LENS_EVALS_HANDOFF_POOL_MIB=1024 \
#     WORKLOAD=prefill bash scripts/gpu_bench.sh vllm-eager,lens-capture-1
# The step copies' overlap (LENS_EVALS_COPY_OVERLAP, engine/host_copy.py): on the GPU the prefill
# lens-mixed / lens-graphs-mixed systems add capture-1-sync (and capture-8-sync, eager) rounds, the
# same captures with that round's copies on the compute stream, so the side stream's gain is a
# paired ratio on one engine ("Copy overlap" line of bench.md; ~+25 s per mixed system). The same
# in separate processes (overlap off; the baselines already in BENCH_DIR are reused):
#   WORKLOAD=prefill bash scripts/gpu_bench.sh lens-capture-1-sync,lens-graphs-capture-1-sync
set -uo pipefail
WORKLOAD=${WORKLOAD:-decode}
if [ "$WORKLOAD" = prefill ]; then
  PREFILL_SYSTEMS=vllm-graphs,vllm-eager,lens-capture-1,lens-graphs-capture-1,lens-graphs-probe,lens-steer-1,lens-mixed,hf-forward
  systems=${1:-$PREFILL_SYSTEMS}
  [ $# -gt 0 ] && shift
  set -- --workload prefill --repeats 2 "$@"
  BENCH_DIR=${BENCH_DIR:-/tmp/lens-evals-bench-prefill}
else
  systems=${1:?usage: gpu_bench.sh SYSTEMS [lens-evals bench args]  (or WORKLOAD=prefill gpu_bench.sh [SYSTEMS])}
  shift
fi
BENCH_DIR=${BENCH_DIR:-/tmp/lens-evals-bench}
python3 -m pip install -q --no-deps --no-build-isolation --no-index --target /tmp/site . >/dev/null || exit 1
export PYTHONPATH=/tmp/site:$PWD LENS_EVALS_MODEL_DIR=/tmp/lens-models PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false VLLM_CACHE_ROOT=/tmp/kc/vllm TRITON_CACHE_DIR=/tmp/kc/triton  # compilation caches: scripts/gpu_cache.py
python3 -c "import torch, vllm, transformers; print('torch', torch.__version__, 'vllm', vllm.__version__, 'transformers', transformers.__version__, 'gpus', torch.cuda.device_count())"
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
# Stop each system well inside the call's 10 minutes, so the report still gets written.
python3 -m benchmarks --gpu --resume --systems "$systems" --out "$BENCH_DIR" \
  --gpu-model-dir /tmp/lens-evals-bench-llama8b --timeout "${BENCH_SYSTEM_TIMEOUT:-420}" "$@" 2>&1 | tee "$BENCH_DIR.log"
status=${PIPESTATUS[0]}
# The device returns at most 8 files a call: the report, and everything else in one archive.
mkdir -p "${OUT:-/tmp/out}/bench"
cp "$BENCH_DIR"/bench.* "${OUT:-/tmp/out}/bench/" 2>/dev/null
cp "$BENCH_DIR.log" "$BENCH_DIR/run.log" 2>/dev/null
tar czf "${OUT:-/tmp/out}/bench/all.tar.gz" -C "$BENCH_DIR" . || echo "gpu_bench: could not pack $BENCH_DIR" >&2
exit "$status"
