#!/usr/bin/env bash
# The default test suite on the lent GPU machine (vLLM 0.26, one H200), in device calls of at most
# 10 minutes. Set-up, on this machine:
#   GPU_EXTRA_PKGS="$(cat scripts/gpu_extra_pkgs.txt)" bash ../shared/tools/gpu-wheelhouse
#   mkdir -p .gpu-src && git archive --format=tar.gz --add-virtual-file=COMMIT:"$(git rev-parse HEAD)" -o .gpu-src/src.tar.gz HEAD
# then the device calls back to back, in ONE message after the first (the machine is released after
# 30 s idle; start it with the first chunk's call alone: while no machine can be had, every call of
# a batch costs 15 s): the chunk calls .gpu/c00 ... as the wheelhouse's header says, the last one carrying
#   .gpu/install.sh and .gpu-src too and running
#   `. .gpu/install.sh && mkdir -p /tmp/src && tar xzf .gpu-src/src.tar.gz -C /tmp/src && PART=prepare bash /tmp/src/scripts/gpu_suite.sh && PART=solo LIMIT=300 bash /tmp/src/scripts/gpu_suite.sh`
#   (the committed code, not the working tree; prepare, then the bench alone: 476 s on 2026-12-05),
#   then the rest of the suite in one call: `PART=lanes LANES="1 2a 2b 2c 2d 3a 3b 3c 3d 3e 3f
#   ray" PACK_CACHES=1 bash /tmp/src/scripts/gpu_suite.sh` (nine lanes took 553 s on 2026-12-05); or one
#   call per PART (1, 2a-2d, 3a-3f, solo, ray, overlap; files runs FILES, e.g. the
#   last run's failures): `PART=1 bash /tmp/src/scripts/gpu_suite.sh`.
# Compilation caches: `PART=caches` as the last call (or PACK_CACHES=1 on any part) sends vLLM's
# compilation caches back (at most 60 MiB compressed, else nothing; sizes printed at the end of
# every part's log). Copy the pieces from the reply's files_at into .gpu-cache/ and, on the next
# machine, carry them before prepare, which unpacks them (scripts/gpu_cache.py): with the last chunk
# when they fit beside it (a call carries 64 MiB), carry=[".gpu/c11", ".gpu/install.sh", ".gpu-src",
# ".gpu-cache"] and "mkdir -p /tmp/kc-in && cp .gpu-cache/* /tmp/kc-in/ && " before the command above,
# else in a call of their own.
# The code runs from /tmp/src (a git archive of one commit), so what ran is named by that commit
# (its COMMIT file, printed at the head of every log).
# Several pytest processes may share the device (PART=lanes): the tests' engines skip vLLM's
# start-up memory profiling (tests/device.py), which another process's freeing would fail. The
# bench (PART=solo) and the timed overlap tests run alone. Logs and junit XML go to $OUT (lanes: two
# files, lanes.txt and lanes-logs.tar.gz, as a call sends back 8 files at most).
set -uo pipefail
# lens_evals is installed (prepare) into a folder named site-packages, as a user's install is:
# Inspect names a task "lens_evals/<task>" only when its module lies under one (2026-12-05: from
# /tmp/site the registry test saw bare names)
export PYTHONPATH=/tmp/pkg/site-packages:/tmp/site:/tmp/src PYTHONUNBUFFERED=1 LENS_EVALS_MODEL_DIR=/tmp/gm
export VLLM_USE_V2_MODEL_RUNNER=0 TOKENIZERS_PARALLELISM=false LENS_EVALS_TEST_FAILURES_AT_ONCE=1
# vLLM's compilation caches (torch.compile, Inductor, Triton) in one place, so that PART=caches can
# send them back and the next machine can start from them (scripts/gpu_cache.py)
export VLLM_CACHE_ROOT=/tmp/kc/vllm TRITON_CACHE_DIR=/tmp/kc/triton FLASHINFER_WORKSPACE_BASE=/tmp/kc/flashinfer
out=${OUT:-/tmp}
cd "${SUITE_SRC:-/tmp/src}" || exit 1  # SUITE_SRC: another checkout (PART=list and the skips' test)
# SUITE_TMP: where the parts' pytest temporary folders go (a test of this script runs it inside a part)
run() {  # run NAME pytest-args...: pytest processes, junit XML and the log to $OUT
  local name=$1; shift
  local ledger="$out/$name.ledger" started=$SECONDS round=0 left code hung group
  rm -f "$ledger" "$out/$name.stacks"
  echo "code $(cat COMMIT 2>/dev/null || echo 'unknown: an archive without COMMIT')" > "$out/$name.log"
  # A test stuck past HANG_S seconds prints every thread's stack and ends its process
  # (tests/run_ledger.py: faulthandler, which works where pytest-timeout's signal does not), and
  # the next process runs the tests not yet started, while the part's LIMIT lasts.
  while :; do
    left=$(( ${LIMIT:-540} - (SECONDS - started) ))
    [ "$left" -gt 30 ] || { echo "$name: no time left for the tests not yet started" | tee -a "$out/$name.log"; break; }
    # -v: each test's name and outcome in the log as it ends, so a call cut at its limit still says
    # what ran (2026-12-03: a part cut at 600 s left only its progress dots)
    # timeout leads a process group of its own: what a process leaves behind (a server, an
    # engine's worker holding device memory) is killed with the group before the next one starts
    LENS_EVALS_TEST_LEDGER=$ledger LENS_EVALS_TEST_HANG_EXIT_S=${HANG_S:-270} \
      timeout --kill-after=15 "$left" python3 -m pytest -p no:cacheprovider -p tests.run_ledger -v --timeout 240 -o addopts="" \
      -m "${MARK:-not slow and not gpu}" -ra --durations=15 --junitxml "$out/$name.$round.xml" --basetemp "${SUITE_TMP:-/tmp}/pytest-$name-$round" "$@" >> "$out/$name.log" 2>&1 &
    group=$!
    wait "$group"
    code=$?
    kill -9 -- "-$group" 2>/dev/null
    # Ray's daemons leave the process group (a test's `ray start`): stopped here, so a process
    # ended mid-test leaves no cluster for the next one to trip on
    [ "$name" = ray ] && python3 -m ray.scripts.scripts stop --force > /dev/null 2>&1
    echo "$name: exit $code"
    hung=$(python3 -m tests.run_ledger hung "$ledger")
    [ -n "$hung" ] && [ "$code" != 124 ] && [ "$code" != 137 ] || break
    { echo; echo "HUNG past ${HANG_S:-270} s, its process ended (stacks below): $hung"; cat "$out/$name.stacks"; } >> "$out/$name.log"
    : > "$out/$name.stacks"
    round=$((round + 1))
  done
  { printf 'compilation caches: '; du -sh /tmp/kc/* 2>/dev/null | tr '\n' ' '; echo; } >> "$out/$name.log"
  # PACK_CACHES=1: this part's call sends the caches back too (a later cut call loses nothing)
  [ "${PACK_CACHES:-0}" = 1 ] && python3 scripts/gpu_cache.py pack /tmp/kc "$out" --max-mib 56
  # the outcome (BRIEF=1, as in lanes: failures and counts only; the log has every test)
  local outcome="^(FAILED|ERROR|SKIPPED|HUNG)|[0-9]+ (passed|failed|error)|(PASSED|FAILED|ERROR) +\["
  [ "${BRIEF:-0}" = 1 ] && outcome="^(FAILED|ERROR|SKIPPED|HUNG)|[0-9]+ (passed|failed|error)"
  grep -hE "$outcome" "$out/$name.log" | cut -c1-200 | tail -60
  # A skip here is a test the GPU run never ran (a missing chromium, a refused tmpfs mount): the
  # part fails on it (issue #45), unless its reason is one this machine has by design
  local skipped
  skipped=$(grep -hE "^SKIPPED" "$out/$name.log" | grep -vE "$EXPECTED_GPU_SKIPS")
  if [ -n "$skipped" ]; then
    echo "FAILED $name: tests skipped on the GPU machine, where they must run:" | tee -a "$out/$name.log"
    echo "$skipped" | cut -c1-200 | tee -a "$out/$name.log"
    return 1
  fi
}
# The skips a lent GPU machine has by design (an extended regex of their reasons)
EXPECTED_GPU_SKIPS="two workers need 2 GPUs; this machine has 1"
# The test files of each part. Sized to finish inside one call on a warm machine (measured on
# the H200, 2026-12-04: part 1 492 s with the machine's first engine; 2a+2b ran past 575 s as
# one part; the GPU takes ~1.5-2x the 2-core CPU's time on these tiny models, each engine's
# start-up being most of it). "solo": tests whose engines must have the device to themselves (the
# bench's systems ask for 0.85 of it and profile its memory), never run in lanes.
P1="tests/engine/test_engine_tiny.py tests/engine/test_positions.py tests/capture/test_capture_hf.py tests/engine/test_hooks.py tests/engine/test_hook_sets.py
    tests/probing/test_probes.py tests/engine/test_graph_mode.py tests/engine/test_failures_and_disable.py tests/engine/test_store.py tests/engine/test_handoff.py tests/engine/test_handoff_views.py
    tests/request/test_wire_spec.py tests/engine/test_engine_modes.py tests/engine/test_steering_edges.py"
# 2a and 2d: 493 s as one part among nine lanes (2026-12-05); on the 2-core CPU server 46 s, auth 20 s, provider 129 s
P2A="tests/engine/test_server.py tests/engine/test_server_auth.py"
P2D="tests/inspect_kit/test_provider.py"
P2C="tests/engine/test_hardening_inputs.py tests/engine/test_hardening_fuzz.py tests/engine/test_hardening_load.py"
P2B="tests/engine/test_lora_engine.py tests/inspect_kit/test_oracle_solver.py"
# 3a and 3f: the default matrix against HF (an engine and an HF model per architecture, in a
# process of its own; 26-31 s each on the 2-core CPU), and the files without engines; 3e: the rest
# of test_architectures.py (the refusals: engines in the test process). As one part (2026-12-05)
# they ran past 540 s among nine lanes.
P3A="tests/engine/test_architectures.py::test_architecture_matches_hf[Qwen3ForCausalLM] tests/engine/test_architectures.py::test_architecture_matches_hf[Qwen3MoeForCausalLM]
     tests/test_docs_links.py tests/models/test_gguf_models.py tests/test_layout.py"
P3F="tests/engine/test_architectures.py::test_architecture_matches_hf[GPT2LMHeadModel] tests/engine/test_architectures.py::test_architecture_matches_hf[Olmo2ForCausalLM]
     tests/engine/test_architectures.py::test_architecture_matches_hf[StableLmForCausalLM]"
P3E="tests/engine/test_architectures.py::test_graph_mode_is_refused_where_unverified tests/engine/test_architectures.py::test_default_matrix_covers_every_contract
     tests/engine/test_architectures.py::test_graph_mode_gate_follows_the_table_and_the_self_check[False]
     tests/engine/test_architectures.py::test_graph_mode_gate_follows_the_table_and_the_self_check[True]
     tests/engine/test_architectures.py::test_unverified_architecture_serves_plain_requests_and_refuses_lens_requests
     tests/engine/test_architectures.py::test_trusted_unverified_architecture_uses_the_guessed_contract
     tests/engine/test_architectures.py::test_trusted_transformers_backend_layers_are_guessed_as_the_stream
     tests/engine/test_architectures.py::test_worker_refuses_a_verified_name_built_with_another_layer_class
     tests/engine/test_architectures.py::test_model_runner_v2_serves_plain_requests_and_refuses_lens_requests
     tests/engine/test_architectures.py::test_speculative_decoding_serves_plain_requests_and_refuses_lens_requests"
P3B="tests/capture/test_capture_cmd.py tests/capture/test_capture_faults.py tests/evals/test_coup.py"
P3C="tests/evals/test_roleplaying_eval.py tests/evals/test_roleplaying_file.py tests/integrations/test_petri_inspectors.py tests/engine/test_parallel.py
     tests/report/test_report.py tests/report/test_report_values.py"
PSOLO="tests/benchmarks/test_bench.py"
part_files() {  # part_files PART: its test files (3d: every file no other part names; new files land there)
  case $1 in
    1) echo $P1 ;;
    2a) echo $P2A ;;
    2b) echo $P2B ;;
    2c) echo $P2C ;;
    2d) echo $P2D ;;
    3a) echo $P3A ;;
    3b) echo $P3B ;;
    3c) echo $P3C ;;
    3e) echo $P3E ;;
    3f) echo $P3F ;;
    solo) echo $PSOLO ;;
    # (a part that names test ids, tests/x.py::test_y, claims the file; tests/test_gpu_suite_parts.py
    # checks that the ids of a file split between parts cover its tests)
    3d) find tests -name 'test_*.py' -not -path 'tests/scripts/*' | sort | grep -vxF -f <(echo $P1 $P2A $P2B $P2C $P2D $P3A $P3B $P3C $P3E $P3F $PSOLO | tr ' ' '\n' | sed 's/::.*//') ;;
    # a list of test files or test ids: FILES="tests/test_x.py tests/test_y.py::test_z"
    files) echo ${FILES:?FILES=...} ;;
    *) echo "unknown part $1" >&2; return 1 ;;
  esac
}
part_name() {  # part_name PART: the name its log, ledger and XML files take
  case $1 in ray|overlap) echo "$1" ;; *) echo "part$1" ;; esac
}
run_part() {  # run_part PART: one part, or Ray's gpu-marked tests (-s: their printed errors)
  if [ "$1" = ray ]; then MARK=gpu run "$(part_name ray)" -s tests/engine/test_ray_executor.py
  elif [ "$1" = overlap ]; then MARK=gpu run "$(part_name overlap)" tests/engine/test_copy_overlap.py
  else
    local files; files=$(part_files "$1") || return 1
    [ -n "$files" ] || { echo "part $1: no test files" >&2; return 1; }
    run "$(part_name "$1")" $files
  fi
}
case ${PART:?PART=prepare|1|2a|2b|2c|2d|3a|3b|3c|3d|3e|3f|solo|files|ray|overlap|lanes|caches|list} in
  prepare)
    # caches carried from an earlier machine (.gpu-cache/ copied to /tmp/kc-in by a call of its own)
    [ -d /tmp/kc-in ] && python3 scripts/gpu_cache.py unpack /tmp/kc-in /tmp/kc
    python3 -m pip install -q --no-deps --no-build-isolation --no-index --target /tmp/pkg/site-packages . || exit 1
    python3 -c "import torch, vllm, transformers, inspect_ai, ray; print('torch', torch.__version__, 'vllm', vllm.__version__, 'transformers', transformers.__version__, 'inspect', inspect_ai.__version__, 'ray', ray.__version__, 'gpus', torch.cuda.device_count())"
    python3 -c "from lens_evals.models.registry import model_path; [print(model_path(n)) for n in ('tiny-llama', 'tiny-moe', 'smollm2-135m-instruct')]"
    # The machine's first engine (149-207 s in four runs, later ones 10-15 s) started here, its
    # phases timed, so that the parts' budgets hold and the carried caches' effect is measured
    # (WARM=0 skips it; the part still ends 0)
    if [ "${WARM:-1}" = 1 ]; then VLLM_ENABLE_V1_MULTIPROCESSING=0 python3 -c "
import time; t0 = time.monotonic()
from vllm import LLM, SamplingParams
t1 = time.monotonic(); print(f'warm: import vllm {t1 - t0:.1f} s', flush=True)
llm = LLM('/tmp/gm/tiny-llama', dtype='float32', max_model_len=1024, gpu_memory_utilization=0.2, seed=0)
t2 = time.monotonic(); print(f'warm: first engine {t2 - t1:.1f} s', flush=True)
out = llm.generate(['the cat reads a book.'], SamplingParams(max_tokens=2, temperature=0.0, extra_args={'output_residual_stream': [1]}))
t3 = time.monotonic(); print(f'warm: first lens request {t3 - t2:.1f} s, rows {tuple(out[0].activations[\"residual_stream\"].shape)}', flush=True)
llm.llm_engine.engine_core.shutdown()
" > "$out/warm.log" 2>&1; grep -E "^warm:|Error" "$out/warm.log" | cut -c1-300; fi
    du -sh /tmp/kc/* 2>/dev/null || true
    ;;
  1|2a|2b|2c|2d|3a|3b|3c|3d|3e|3f|solo|files|ray) run_part "$PART" ;;
  # each part's test files or ids, a line each: "PART: FILE ..." (no device needed)
  list) for part in 1 2a 2b 2c 2d 3a 3b 3c 3d 3e 3f solo; do echo "$part:" $(part_files "$part"); done ;;
  # vLLM's Ray executor (docs/parallelism.md); the step copy on a side stream (issue #21: timed, so alone)
  overlap) run_part overlap ;;
  lanes)
    # LANES="1 2a 2b 3a": those parts at once, one pytest process each beside the others on the
    # device (their engines take tests/device.py's fixed KV cache, so none profiles the device's
    # memory, which another process's freeing would break), the host's cores split between them.
    # Each lane's own LIMIT; the call lasts as long as the longest lane.
    lanes=${LANES:?LANES="1 2a ..."}
    threads=$(( $(nproc) / $(wc -w <<< "$lanes") ))
    for lane in $lanes; do
      case $lane in solo|overlap) echo "lanes: $lane runs alone, not in lanes" >&2; exit 2 ;; esac
    done
    # each lane compiles into a copy of the caches of its own (vLLM rewrites files there without
    # locking: two lanes compiling one configuration at once could collide); what the lanes added
    # is merged back afterwards, so a later pack sends it
    # A call sends back 8 files at most (2026-12-05: nine lanes' logs, ledgers and XML were left
    # there): the lanes write to a folder of their own, and $OUT gets lanes.txt (each lane's
    # outcome, its failures' tracebacks and its skips' reasons), lanes-logs.tar.gz (everything)
    # and the caches' pieces. LIMIT 520 per lane (Ray's RAY_LIMIT 555) leaves the call time to pack
    # before 600 s (13 s on 2026-12-05).
    logs=/tmp/lanes-logs; rm -rf "$logs"; mkdir -p "$logs"
    for lane in $lanes; do
      rm -rf "/tmp/kc-$lane"; mkdir -p /tmp/kc && cp -a /tmp/kc "/tmp/kc-$lane"
      ( export VLLM_CACHE_ROOT=/tmp/kc-$lane/vllm TRITON_CACHE_DIR=/tmp/kc-$lane/triton FLASHINFER_WORKSPACE_BASE=/tmp/kc-$lane/flashinfer
        limit=${LIMIT:-520}; [ "$lane" = ray ] && limit=${RAY_LIMIT:-555}  # Ray's five engines took 534 s among nine lanes
        out=$logs LIMIT=$limit OMP_NUM_THREADS=$threads PACK_CACHES=0 BRIEF=1 run_part "$lane" > "$logs/lane-$lane.txt" 2>&1 ) &
    done
    wait
    for lane in $lanes; do cp -a -n "/tmp/kc-$lane/." /tmp/kc/ 2>/dev/null; done
    for lane in $lanes; do
      echo "== lane $lane"; cat "$logs/lane-$lane.txt"
      # the tracebacks written as failures happened (LENS_EVALS_TEST_FAILURES_AT_ONCE), 60 lines each
      log=$logs/$(part_name "$lane").log
      [ -f "$log" ] && awk '/^--- .* failed \(/ {n = 80} n > 0 {print; n--; if ($0 ~ /^[^ ]+\.py:[0-9]+: /) n = 0}' "$log"
    done > "$out/lanes.txt"
    cat "$out/lanes.txt"
    tar czf "$out/lanes-logs.tar.gz" -C "$logs" .
    if [ "${PACK_CACHES:-0}" = 1 ]; then python3 scripts/gpu_cache.py pack /tmp/kc "$out" --max-mib 56; fi
    ;;
  caches) python3 scripts/gpu_cache.py pack /tmp/kc "$out" ;;  # to carry to the next machine (see its header)
esac
