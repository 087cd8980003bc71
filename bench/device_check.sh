#!/usr/bin/env bash
# One-shot check on the H200 test machine: build the extension against that machine's own torch
# (2.11+cu130; never pip-install torch there: it has no network), run the `cuda` tests, a short end-to-end
# benchmark, decode eager vs graph, the Triton kernel tests natively, then the groups benchmark; print a
# summary table and pack every log into one archive.
#
#   bash bench/device_check.sh            # outputs in $OUT_DIR, default ${OUT:-./device_out}
#
# The device tool brings back at most 8 files: this writes two, summary.txt and device_check_logs.tar.gz
# (every step's log, the e2e CSVs). Without a CUDA device (a dry run, e.g. on the CPU development
# machine) every GPU step prints "skipped: no CUDA" with the command it would run, and nothing is built.
#
# Budget: a rerun must fit in the same 15 minutes of device time (each machine start costs a minute or
# more), so the whole run stays under 6 minutes by the caps' arithmetic below. Each step runs under
# `timeout --kill-after=GRACE_S CAP`, cut further to the time left, so a step costs at most CAP + GRACE_S.
#
#   | order | step          | cap (s) | worst case (s) | what                                          |
#   | ----- | ------------- | ------- | -------------- | --------------------------------------------- |
#   | 1     | machine       |      10 |             13 | nvidia-smi, versions, is CUDA there           |
#   | 2     | build         |      60 |             63 | pip install -e . (CMake, nvcc sm_90)          |
#   | 3     | cuda-tests    |      65 |             68 | pytest -m cuda, graph and CUDA-path files 1st |
#   | 4     | e2e           |      32 |             35 | bench_e2e 0.5b: sequential vs oppo, 3 steps   |
#   | 5     | twin          |      45 |             48 | calibrate this GPU, the twin vs e2e's steps   |
#   | 6     | decode        |      19 |             22 | bench_decode 0.5b B=32 (graph, eager, HF)     |
#   | 7     | kernel-tests  |      34 |             37 | pytest tests/kernels -m "not cuda" (-n 8)     |
#   | 8     | groups        |      17 |             20 | bench_groups 0.5b n=8, 1 round                |
#   | 9     | fsdp-replica  |      19 |             22 | bench_replica 0.5b, FSDP2 on 1 rank, bf16     |
#   | 10    | remote        |      21 |             24 | bench_remote: actor + service processes       |
#   |       | summary, pack |       5 |              5 |                                               |
#   |       | total         |         |        **357** |                                               |
#   |       | scale-out     |         |          **2** | reserved: SCALEOUT_STEPS below, not yet used  |
#   |       | budget        |         |        **359** | BUDGET_S, under 6 minutes                     |
#
# NOTE: three probes run outside the table, each under its own timeout of 20 s (the build's import check
# and two module probes; a few seconds each in practice): the later steps' limits shrink by what they take
# (`remaining`), so the budget holds.
# NOTE: further scale-out steps go in SCALEOUT_STEPS (after remote) and must fit its 2 s (none can: trim a
# cap above first), grace included; the script refuses to start if the table's arithmetic exceeds BUDGET_S.
set -u

PYTHON=${PYTHON:-python3}
BUDGET_S=${BUDGET_S:-359}
GRACE_S=3
SUMMARY_S=5
SCALEOUT_S=2
# step -> cap, in run order (the table above).
STEPS=(machine build cuda-tests e2e twin decode kernel-tests groups fsdp-replica remote)
# cuda-tests: ~30 Triton variants compile cold (1-2 s each) beside ~24 engine builds and ~35 captures
# (about 65-85 s in one process; four under xdist), so it gets what build (about 45 s expected on 16
# cores: the longest translation unit, ~25 s here, and CMake) can spare. twin: the calibration of this GPU
# (bare GEMMs, the engine's 0.5b forwards, two lanes at once, a streamed step, a training step) and the
# twin's prediction of e2e's workload, in one process; its 48 s came out of every other cap.
declare -A CAP=([machine]=10 [build]=60 [cuda-tests]=65 [e2e]=32 [twin]=45 [decode]=19 [kernel-tests]=34
  [groups]=17 [fsdp-replica]=19 [remote]=21)

worst=$((SUMMARY_S + SCALEOUT_S))
for step in "${STEPS[@]}"; do worst=$((worst + CAP[$step] + GRACE_S)); done
if ((worst > BUDGET_S)); then
  echo "device_check: caps add up to ${worst}s, over the ${BUDGET_S}s budget" >&2
  exit 2
fi

OUT_DIR=${OUT_DIR:-${OUT:-./device_out}}
if ! mkdir -p "$OUT_DIR" || ! OUT_DIR=$(cd "$OUT_DIR" && pwd); then
  echo "cannot create OUT_DIR=$OUT_DIR" >&2
  exit 2
fi
LOG_DIR=$(mktemp -d "${TMPDIR:-/tmp}/device_check.XXXXXX") || exit 2
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 2

export PYTHONUNBUFFERED=1 PIP_NO_INDEX=1 PIP_DISABLE_PIP_VERSION_CHECK=1
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}

SUMMARY=()
FAILED=0
BUILD_OK=0
HAVE_CUDA=0

# Kept back from the steps before the scale-out section: its reserve and the remote step's cap.
RESERVE_S=$((SCALEOUT_S + CAP[fsdp-replica] + CAP[remote] + 2 * GRACE_S + SUMMARY_S))
remaining() { echo $((BUDGET_S - RESERVE_S - SECONDS)); }

record() {  # record STEP STATUS SECONDS FIGURE
  SUMMARY+=("$(printf '%-14s %-8s %6s  %s' "$1" "$2" "$3" "$4")")
  case $2 in PASS | EMPTY | SKIP) ;; *) FAILED=1 ;; esac
}

last_line() {  # last_line LOG [PATTERN]: the last non-empty line (matching PATTERN), '=' trimmed, <= 70 chars
  local line
  line=$(grep -E "${2:-.}" "$1" 2>/dev/null | sed -e 's/^[= ]*//' -e 's/[= ]*$//' | grep -v '^$' | tail -n 1)
  echo "${line:0:70}"
}

# run_step STEP LOG CMD...: CMD under timeout min(CAP[STEP], time left); sets STEP_RC and STEP_S.
run_step() {
  local step=$1 log=$2 cap left limit t0
  shift 2
  cap=${CAP[$step]}
  left=$(remaining)
  limit=$((cap < left ? cap : left))
  STEP_S=0
  if ((limit < 5)); then
    STEP_RC=124
    echo "no time left for $step" >"$log"
    return
  fi
  local cmd="$*"
  echo "== $step (limit ${limit}s): ${cmd:0:150}"
  t0=$SECONDS
  timeout --kill-after=$GRACE_S "$limit" "$@" >"$log" 2>&1
  STEP_RC=$?
  STEP_S=$((SECONDS - t0))
}

show_tail() {  # show_tail STEP LOG LINES
  echo "---- $1 FAILED; last $3 lines of $2 ----" >&2
  tail -n "$3" "$2" >&2
  echo "---- end of $2 ----" >&2
}

gpu_ready() {  # gpu_ready STEP CMD...: true if the step may run; otherwise records why not
  local step=$1
  shift
  if [[ $HAVE_CUDA != 1 ]]; then
    echo "== $step: skipped: no CUDA (would run, cap ${CAP[$step]}s: $*)"
    record "$step" SKIP 0 "skipped: no CUDA"
    return 1
  fi
  if [[ $step != build ]] && ((!BUILD_OK)); then
    record "$step" SKIP 0 "build failed"
    FAILED=1
    return 1
  fi
  return 0
}

verdict() {  # verdict STEP LOG PATTERN TAIL_LINES: PASS / EMPTY (pytest rc 5) / TIMEOUT / FAIL from STEP_RC
  case $STEP_RC in
    0) record "$1" PASS "$STEP_S" "$(last_line "$2" "$3")" ;;
    5) record "$1" EMPTY "$STEP_S" "no tests collected" ;;
    124 | 137) record "$1" TIMEOUT "$STEP_S" "$(last_line "$2")" && show_tail "$1" "$2" 30 ;;
    *) record "$1" FAIL "$STEP_S" "rc=$STEP_RC $(last_line "$2")" && show_tail "$1" "$2" "$4" ;;
  esac
}

gpu_step() {  # gpu_step STEP LOG FIGURE_PATTERN CMD...
  local step=$1 log=$2 pattern=$3
  shift 3
  gpu_ready "$step" "$@" || return 0
  run_step "$step" "$log" "$@"
  verdict "$step" "$log" "$pattern" 60
}

has_module() { timeout 20 "$PYTHON" -c "import $1" >/dev/null 2>&1; }

# --- 1. the machine ---------------------------------------------------------------------------------------
run_step machine "$LOG_DIR/machine.log" bash -c '
  echo "== device_check $(date -u +%FT%TZ) in $(pwd)"
  if command -v nvidia-smi >/dev/null; then timeout 10 nvidia-smi; else echo "nvidia-smi: not found"; fi
  "$0" - <<EOF
import sys
print("python", sys.version.split()[0], sys.executable)
for name in ("torch", "triton", "transformers"):
    try:
        print(name, __import__(name).__version__)
    except Exception as e:  # noqa: BLE001
        print(name, "unavailable:", e)
import torch
if torch.cuda.is_available():
    print("cuda", torch.version.cuda, torch.cuda.get_device_name(0), "capability", torch.cuda.get_device_capability(0))
    print("HAVE_CUDA=1")
else:
    print("cuda: no device")
EOF' "$PYTHON"
cat "$LOG_DIR/machine.log"
grep -q '^HAVE_CUDA=1$' "$LOG_DIR/machine.log" && HAVE_CUDA=1
if ((!HAVE_CUDA)) && command -v nvidia-smi >/dev/null; then
  # A GPU machine whose torch sees no device: every GPU step would SKIP, and the table read "all passed".
  STEP_RC=1
  echo "nvidia-smi is here but torch sees no CUDA device" >>"$LOG_DIR/machine.log"
fi
verdict machine "$LOG_DIR/machine.log" '^(cuda|python)' 20

# --- 2. build and install the extension into this python ---------------------------------------------------
BUILD_CMD=("$PYTHON" -m pip install -v --no-build-isolation --no-deps -e .)
if gpu_ready build "${BUILD_CMD[@]}"; then
  run_step build "$LOG_DIR/build.log" "${BUILD_CMD[@]}"
  if ((STEP_RC == 0)); then
    # CMake fails a CUDA torch without nvcc; still, a build without the CUDA kernels is not this check.
    CHECK=$(timeout 20 "$PYTHON" -c "
import torch, oppo_engine.ops as ops
gomp = {l.split()[-1] for l in open('/proc/self/maps') if 'libgomp' in l}
print('cuda cache ops registered' if ops.CUDA_CACHE_OPS else 'CPU ops only',
      f'(CPU ops parallel: {ops.CPU_OPS_PARALLEL}, OpenMP runtimes loaded: {len(gomp)})', int(ops.CUDA_CACHE_OPS))
" 2>>"$LOG_DIR/build.log")
    [[ -n $CHECK ]] || CHECK="import of oppo_engine.ops failed 0"
    if [[ ${CHECK##* } == 1 ]]; then
      BUILD_OK=1
      record build PASS "$STEP_S" "${CHECK% *}"
    else
      record build FAIL "$STEP_S" "${CHECK% *}"
      show_tail build "$LOG_DIR/build.log" 60
    fi
  else
    verdict build "$LOG_DIR/build.log" . 80
    echo "######## BUILD FAILED (rc=$STEP_RC): the extension is not installed ########" >&2
  fi
fi

# Per-test timeout where pytest-timeout is installed (the H200 image has it); -n 8 where xdist is.
PYTEST=("$PYTHON" -m pytest -q -p no:cacheprovider)
has_module pytest_timeout && PYTEST+=(--timeout=30)
XDIST=0
has_module xdist && XDIST=1

# --- 3. the cuda tests: captured graphs and the CUDA path first (what a timeout cuts is the rest) -----------
# Every file with a `cuda` test, named in that order (pytest orders a directory's files itself).
CUDA_FILES=(tests/test_graph.py tests/test_cuda_path.py)
for f in $(grep -rl --include='*.py' 'pytest.mark.cuda' tests | sort); do
  [[ " ${CUDA_FILES[*]} " == *" $f "* ]] || CUDA_FILES+=("$f")
done
CUDA_TESTS=("${PYTEST[@]}" -m cuda "${CUDA_FILES[@]}")
# Four processes share the GPU, a file each at a time: the Triton variants compile in parallel (the tests
# read memory in their own process only).
((XDIST)) && CUDA_TESTS+=(-n 4 --dist loadfile)
gpu_step cuda-tests "$LOG_DIR/cuda_tests.log" 'passed|failed' "${CUDA_TESTS[@]}"

# --- 4. end to end: fewer modes and steps ------------------------------------------------------------------
# (3 steps: bench_e2e prints no speed-up below that.)
gpu_step e2e "$LOG_DIR/e2e.log" 'speedup_oppo_vs_sequential=' \
  "$PYTHON" -m bench.bench_e2e --preset 0.5b --modes sequential,oppo --steps 3 --warmup 1 \
  --response-len-cap 256 --out "$LOG_DIR/e2e"

# --- 5. the twin: calibrate this GPU, then predict e2e's steps (its measured steps.csv) ----------------------
# (greenlet may be absent here: the twin's lanes then switch on OS threads, same schedule.)
if [[ -f "$LOG_DIR/e2e/steps.csv" ]] || ((!HAVE_CUDA)); then
  gpu_step twin "$LOG_DIR/twin.log" 'twin_error_oppo=' \
    "$PYTHON" -m bench.bench_twin --device-check --calibrate --preset 0.5b --response-len-cap 256 \
    --e2e "$LOG_DIR/e2e" --profile "$LOG_DIR/profile_gpu.json"
else
  record twin SKIP 0 "no e2e steps to compare with"
fi

# --- 6. decode: the engine with graph=True, with graph=False, and HF generate, alternating ------------------
gpu_step decode "$LOG_DIR/decode.log" 'decode_graph_vs_eager=' \
  "$PYTHON" -m bench.bench_decode --preset 0.5b --batch-size 32 --new-tokens 64 --repeats 2 --graph

# --- 7. the Triton kernel tests, natively (the cuda ones ran in step 3) -------------------------------------
# (Not the sm_90 compile check: on a GPU it repeats, in a subprocess, what these tests compile natively.)
KERNELS=("${PYTEST[@]}" -m "not cuda" tests/kernels --ignore=tests/kernels/test_sm90_compile.py)
((XDIST)) && KERNELS+=(-n 8)
gpu_step kernel-tests "$LOG_DIR/kernel_tests.log" 'passed|failed' "${KERNELS[@]}"

# --- 8. groups ----------------------------------------------------------------------------------------------
gpu_step groups "$LOG_DIR/groups.log" 'speedup_shared_vs_unshared=' \
  "$PYTHON" -m bench.bench_groups --preset 0.5b --n 8 --groups 4 --prompt-len 512 --response-len 32 --rounds 1 \
  --mode intra

# --- 9. scale-out: the FSDP2 replica sync, then remote scorers (SCALEOUT_S = 2 s left, grace included) -----
# SCALEOUT_STEPS: add each step to STEPS and CAP above (the arithmetic check counts it) and a gpu_step
# line here; their caps plus GRACE_S each must fit SCALEOUT_S.
RESERVE_S=$((SCALEOUT_S + CAP[remote] + GRACE_S + SUMMARY_S))
# FSDP2 actor on one rank (NCCL, shards nothing but runs the code): update_policy() gathers bf16 replicas,
# checked bit for bit against the gathered weights, timed against a full state dict; then a 4-token step.
gpu_step fsdp-replica "$LOG_DIR/fsdp_replica.log" 'replica_sync_s=' \
  "$PYTHON" -m bench.bench_replica --preset 0.5b --rollout-dtype bf16 --rounds 2
RESERVE_S=$SUMMARY_S

# Remote scorers: an actor process and a ScorerService process sharing the one GPU (messages on gloo),
# beside the same work colocated in one process.
gpu_step remote "$LOG_DIR/remote.log" 'remote_intra_vs_sequential=' \
  "$PYTHON" -m bench.bench_remote --device cuda --actor small --scorer small --rounds 1 --steps 1 \
  --batch-size 8 --max-new-tokens 32

# --- 10. summary and one archive ----------------------------------------------------------------------------
{
  echo
  printf '%-14s %-8s %6s  %s\n' step status seconds "key figure"
  printf '%s\n' "${SUMMARY[@]}"
  echo "total ${SECONDS}s of a ${BUDGET_S}s budget; $( ((FAILED)) && echo 'SOME STEPS FAILED' || echo 'all steps passed')"
} | tee "$LOG_DIR/summary.txt"
cp "$LOG_DIR/summary.txt" "$OUT_DIR/summary.txt"
tar -czf "$OUT_DIR/device_check_logs.tar.gz" -C "$LOG_DIR" . && rm -rf "$LOG_DIR"
exit "$FAILED"
