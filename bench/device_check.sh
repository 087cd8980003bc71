#!/usr/bin/env bash
# One-shot check on the H200 test machine: build the extension against that machine's own torch
# (2.11+cu130; never pip-install torch there: it has no network), run the CUDA tests and the Triton kernel
# tests natively, then the attention and end-to-end benchmarks, and print a summary table.
#
#   bash bench/device_check.sh            # outputs in $OUT_DIR, default ${OUT:-./device_out}
#
# Every step runs under `timeout` and reports, whatever happened to the ones before it; the whole script
# ends within 8 minutes (BUDGET_S) and exits non-zero if any step failed. Without a CUDA device (a dry run)
# the CUDA tests are skipped by pytest and the GPU benchmarks are skipped here.
set -u

PYTHON=${PYTHON:-python3}
BUDGET_S=${BUDGET_S:-465}  # 8 minutes, less the summary and one step's --kill-after grace
OUT_DIR=${OUT_DIR:-${OUT:-./device_out}}
if ! mkdir -p "$OUT_DIR" || ! OUT_DIR=$(cd "$OUT_DIR" && pwd); then
  echo "cannot create OUT_DIR=$OUT_DIR" >&2
  exit 2
fi
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 2

export PYTHONUNBUFFERED=1 PIP_NO_INDEX=1 PIP_DISABLE_PIP_VERSION_CHECK=1
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}

SUMMARY=()
FAILED=0
BUILD_OK=0

remaining() { echo $((BUDGET_S - SECONDS)); }

record() {  # record STEP STATUS SECONDS FIGURE
  SUMMARY+=("$(printf '%-16s %-8s %6s  %s' "$1" "$2" "$3" "$4")")
  case $2 in PASS | EMPTY | SKIP) ;; *) FAILED=1 ;; esac
}

last_line() {  # last_line LOG [PATTERN]: the last non-empty line (matching PATTERN), '=' trimmed, <= 70 chars
  local line
  line=$(grep -E "${2:-.}" "$1" 2>/dev/null | sed -e 's/^[= ]*//' -e 's/[= ]*$//' | grep -v '^$' | tail -n 1)
  echo "${line:0:70}"
}

# run_step STEP CAP_S LOG CMD...: CMD under timeout min(CAP_S, time left); sets STEP_RC and STEP_S.
run_step() {
  local step=$1 cap=$2 log=$3 left limit t0
  shift 3
  left=$(remaining)
  limit=$((cap < left ? cap : left))
  STEP_S=0
  if ((limit < 15)); then
    STEP_RC=124
    echo "no time left for $step" >"$log"
    return
  fi
  echo "== $step (limit ${limit}s): $*"
  t0=$SECONDS
  timeout --kill-after=10 "$limit" "$@" >"$log" 2>&1
  STEP_RC=$?
  STEP_S=$((SECONDS - t0))
}

show_tail() {  # show_tail STEP LOG LINES
  echo "---- $1 FAILED; last $3 lines of $2 ----" >&2
  tail -n "$3" "$2" >&2
  echo "---- end of $2 ----" >&2
}

pytest_step() {  # pytest_step STEP CAP LOG ARGS...: rc 5 (nothing collected) is EMPTY, not a failure
  local step=$1 cap=$2 log=$3
  shift 3
  if ((!BUILD_OK)); then
    record "$step" SKIP 0 "build failed"
    FAILED=1
    return
  fi
  run_step "$step" "$cap" "$log" "$PYTHON" -m pytest -q -p no:cacheprovider "$@"
  case $STEP_RC in
    0) record "$step" PASS "$STEP_S" "$(last_line "$log")" ;;
    5) record "$step" EMPTY "$STEP_S" "no tests collected" ;;
    124 | 137) record "$step" TIMEOUT "$STEP_S" "$(last_line "$log")" && show_tail "$step" "$log" 30 ;;
    *) record "$step" FAIL "$STEP_S" "$(last_line "$log")" && show_tail "$step" "$log" 60 ;;
  esac
}

bench_step() {  # bench_step STEP CAP LOG FILE FIGURE_PATTERN CMD...
  local step=$1 cap=$2 log=$3 file=$4 pattern=$5
  shift 5
  if [[ ! -f $file ]]; then
    record "$step" SKIP 0 "$file absent"
  elif ((!BUILD_OK)); then
    record "$step" SKIP 0 "build failed"
    FAILED=1
  elif [[ $HAVE_CUDA != 1 ]]; then
    record "$step" SKIP 0 "no CUDA device"
  else
    run_step "$step" "$cap" "$log" "$@"
    case $STEP_RC in
      0) record "$step" PASS "$STEP_S" "$(last_line "$log" "$pattern")" ;;
      124 | 137) record "$step" TIMEOUT "$STEP_S" "$(last_line "$log")" && show_tail "$step" "$log" 30 ;;
      *) record "$step" FAIL "$STEP_S" "rc=$STEP_RC $(last_line "$log")" && show_tail "$step" "$log" 40 ;;
    esac
  fi
}

# --- 1. the machine ---------------------------------------------------------------------------------------
{
  echo "== device_check $(date -u +%FT%TZ) in $(pwd), outputs in $OUT_DIR"
  if command -v nvidia-smi >/dev/null; then timeout 30 nvidia-smi; else echo "nvidia-smi: not found"; fi
  timeout 120 "$PYTHON" - <<'EOF'
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
else:
    print("cuda: no device")
EOF
} 2>&1 | tee "$OUT_DIR/summary.txt"
HAVE_CUDA=$(timeout 120 "$PYTHON" -c "import torch; print(int(torch.cuda.is_available()))" 2>/dev/null || echo 0)

# --- 2. build and install the extension into this python ---------------------------------------------------
run_step build 240 "$OUT_DIR/build.log" "$PYTHON" -m pip install -v --no-build-isolation --no-deps -e .
if ((STEP_RC == 0)); then
  BUILD_S=$STEP_S
  # A CUDA torch with no CUDA kernel registered means CMake fell back to the CPU ops: count that as failed.
  CHECK=$(timeout 120 "$PYTHON" -c "
import torch, oppo_engine.ops
has = torch._C._dispatch_has_kernel_for_dispatch_key('oppo::reshape_and_cache', 'CUDA')
print('cuda ops registered' if has else 'CPU ops only', int(has or not torch.cuda.is_available()))
" 2>>"$OUT_DIR/build.log")
  [[ -n $CHECK ]] || CHECK="import of oppo_engine.ops failed 0"
  if [[ ${CHECK##* } == 1 ]]; then
    BUILD_OK=1
    record build PASS "$BUILD_S" "${CHECK% *}"
  else
    record build FAIL "$BUILD_S" "${CHECK% *}"
    show_tail build "$OUT_DIR/build.log" 60
  fi
else
  if ((STEP_RC == 124 || STEP_RC == 137)); then
    record build TIMEOUT "$STEP_S" "killed at the time limit"
  else
    record build FAIL "$STEP_S" "rc=$STEP_RC $(last_line "$OUT_DIR/build.log" 'rror')"
  fi
  echo "######## BUILD FAILED (rc=$STEP_RC): the extension is not installed ########" >&2
  show_tail build "$OUT_DIR/build.log" 80
fi

# --- 3. tests ----------------------------------------------------------------------------------------------
pytest_step cuda-tests 120 "$OUT_DIR/cuda_tests.log" -m cuda tests
pytest_step kernel-tests 120 "$OUT_DIR/kernel_tests.log" tests/kernels

# --- 4. benchmarks (GPU only) ------------------------------------------------------------------------------
bench_step bench-attention 90 "$OUT_DIR/bench_attention.log" bench/bench_attention.py . \
  "$PYTHON" bench/bench_attention.py --quick --out "$OUT_DIR/bench_attention.csv"
bench_step bench-decode 60 "$OUT_DIR/bench_decode.log" bench/bench_decode.py 'decode_throughput_engine_vs_hf=' \
  "$PYTHON" -m bench.bench_decode --preset 0.5b --batch-size 32 --new-tokens 64 --repeats 2
bench_step bench-groups 60 "$OUT_DIR/groups.log" bench/bench_groups.py 'speedup_shared_vs_unshared=' \
  "$PYTHON" -m bench.bench_groups --preset 0.5b --n 8 --groups 4 --prompt-len 512 --response-len 32 --rounds 2 \
  --mode intra
bench_step bench-e2e 180 "$OUT_DIR/e2e.log" bench/bench_e2e.py 'speedup_oppo_vs_(sequential|hf)=' \
  "$PYTHON" -m bench.bench_e2e --preset 0.5b --out "$OUT_DIR/e2e"

# The device tool brings back at most 8 files: fold the e2e folder into one archive when there are more.
if (($(find "$OUT_DIR" -type f | wc -l) > 8)) && [[ -d $OUT_DIR/e2e ]]; then
  tar -czf "$OUT_DIR/e2e.tar.gz" -C "$OUT_DIR" e2e && rm -rf "$OUT_DIR/e2e"
fi

# --- 5. summary --------------------------------------------------------------------------------------------
{
  echo
  printf '%-16s %-8s %6s  %s\n' step status seconds "key figure"
  printf '%s\n' "${SUMMARY[@]}"
  echo "total ${SECONDS}s; $( ((FAILED)) && echo 'SOME STEPS FAILED' || echo 'all steps passed')"
} | tee -a "$OUT_DIR/summary.txt"
exit "$FAILED"
