#!/usr/bin/env bash
# Issue #47's measurements on the lent GPU in one plan: STEP is decode, disk or prefill, one per
# device call (each fits the 10-minute limit), on the machine kept warm between them.
#
#   decode   scripts/decode_profile.py --rounds 3 --compare-stream: plain / capture-1 / steer-1 /
#            three probes (and capture with nothing streamed) in paired graph-mode rounds on one
#            in-process engine, phases per step, cProfile + torch.profiler (~330 s with the
#            engine start). Out: $OUT/decode-profile.tgz
#   disk     `lens-evals bench --gpu --workload capture-disk --prompts 300`: the disk alone, the
#            shard writer alone (2 and 4 writers), the capture's engine part, the capture with the
#            shard buffers it had before 2026-12-08 and as it is (~150 s). Out: $OUT/capture-disk.*
#   prefill  8 and all 32 layers held in memory against pure vLLM, 250 prefill prompts (the issue's
#            ≤ 1.10x / ≤ 1.30x), LENS_EVALS_TIMING phases (~300 s). Out: $OUT/bench/
#
# Before the first step, carry the wheel chunks (../shared/tools/gpu-wheelhouse; see
# scripts/gpu_bench.sh's header): call 1 carries .gpu/c00 and runs `mkdir -p /tmp/w && cp
# .gpu/c00/* /tmp/w/`, calls 2-11 each carry .gpu/cNN and copy it, and the last chunk's call
# carries BOTH .gpu/c11 and .gpu/install.sh:
#   cp .gpu/c11/* /tmp/w/ && . .gpu/install.sh && bash scripts/gpu_issue47.sh decode
# then, while the machine stays warm (30 s between calls):
#   bash scripts/gpu_issue47.sh disk
#   bash scripts/gpu_issue47.sh prefill
# For prefill on the other GPU kind at the SAME commit (the issue asks both where both are lent),
# carry the commit's source (git archive -o .gpu-src/src.tar.gz HEAD; .gpu-src is ignored, so
# name it in carry) and run SRC_TARBALL=.gpu-src/src.tar.gz bash scripts/gpu_issue47.sh prefill.
# Device time seen (2026-12-07, H100): machine start 120-180 s, the twelve chunk calls ~100 s,
# the install ~40 s; budget 1,800 s a session: decode + disk + prefill fit one session.
set -uo pipefail
step=${1:?usage: gpu_issue47.sh decode|disk|prefill}
shift
out=${OUT:-/tmp/out}
if [ -n "${SRC_TARBALL:-}" ]; then  # another commit's source, unpacked apart and run from there
  rm -rf /tmp/src47 && mkdir -p /tmp/src47 && tar xzf "$SRC_TARBALL" -C /tmp/src47 && cd /tmp/src47 || exit 1
fi
git log -1 --format='commit %h %cd' 2>/dev/null || echo "source from ${SRC_TARBALL:-the working tree}"
case "$step" in
  decode)
    OUT=/tmp/o47 DECODE_PROFILE_TIMEOUT=${DECODE_PROFILE_TIMEOUT:-540} bash scripts/gpu_decode_profile.sh --rounds 3 --compare-stream "$@"
    status=$?
    tar czf "$out/decode-profile.tgz" -C /tmp/o47 decode-profile
    ;;
  disk)
    python3 -m pip install -q --no-deps --no-build-isolation --no-index --target /tmp/site . >/dev/null || exit 1
    export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
    timeout "${DISK_TIMEOUT:-540}" python3 -m benchmarks --gpu --workload capture-disk --prompts "${DISK_PROMPTS:-300}" \
      --out /tmp/capture-disk "$@" 2>&1 | grep -v " INFO " | tail -40
    status=${PIPESTATUS[0]}
    cp /tmp/capture-disk/capture-disk.* "$out/" 2>/dev/null
    ;;
  prefill)
    BENCH_DIR=/tmp/prefill-250 LENS_EVALS_TIMING=1 WORKLOAD=prefill BENCH_SYSTEM_TIMEOUT=${BENCH_SYSTEM_TIMEOUT:-240} \
      timeout "${PREFILL_TIMEOUT:-560}" bash scripts/gpu_bench.sh vllm-eager,lens-capture-all,lens-capture-8 --prompts 250 "$@"
    status=$?
    ;;
  *)
    echo "gpu_issue47.sh: unknown step $step (decode, disk or prefill)" >&2
    exit 2
    ;;
esac
exit "$status"
