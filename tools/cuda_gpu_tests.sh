#!/usr/bin/env bash
# Every GPU test of the CUDA backend, as nine pytest processes at once; the
# standalone kernel check (cpp/cuda/tests/kernel_check.cc: every kernel
# family in both backward modes against a double-precision reference, no JAX
# in the process); and compute-sanitizer over that check (memcheck and
# racecheck, each on the default kernels in both backward modes, on the
# mma_sync kernels and on the SIMT kernels) as eight more processes. For the
# GPU machine after tools/cuda_device_build.sh:
#   bash tools/cuda_gpu_tests.sh [OUTDIR] [TIMEOUT_S] [tests|sanitizers|NAME_REGEX]
# Each process writes OUTDIR/NAME.txt (default /tmp/cuda_gpu_tests) and is
# stopped after TIMEOUT_S seconds (default 540). The third argument runs only
# the pytest processes and the plain kernel check ("tests"), only the
# sanitizer ones ("sanitizers"), or the processes whose names match
# NAME_REGEX. They share one GPU and its host's cores, so "tests" and
# "sanitizers" are best run one after the other (docs/testing.md has the
# times). Prints one line per process and exits non-zero when a test or
# check failed, the sanitizer reported an error or a process did not finish.
# Without a GPU every test skips and the kernel check reports no GPU.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-/tmp/cuda_gpu_tests}
limit=${2:-540}
only=${3:-.}
mkdir -p "$out"
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1

backend=tests/test_cuda_backend.py
check=${BUILD_DIR:-/tmp/fatrain_build}/fatrain_cuda_kernel_check
names=()
start() {  # NAME COMMAND...: one process in the background, if NAME is selected
  local name=$1
  shift
  case $only in
    tests) [[ $name != san_* ]] || return 0 ;;
    sanitizers) [[ $name == san_* ]] || return 0 ;;
    *) [[ $name =~ $only ]] || return 0 ;;
  esac
  names+=("$name")
  timeout "$limit" "$@" > "$out/$name.txt" 2>&1 &
}
run() {  # NAME PYTEST_ARGS...
  local name=$1
  shift
  start "$name" python3 -m pytest -q -p no:cacheprovider "$@"
}
sanitize() {  # NAME TOOL [CHECK_ARGS...]: the kernel check, our kernels only
  local name=$1 tool=$2
  shift 2
  start "$name" compute-sanitizer --tool "$tool" --kernel-name kns=fatrain \
    --error-exitcode 3 "$check" "$@"
}
# test_cuda_backend.py by head dim and dQ mode, then the shared suite's
# cuda cases by file.
run d64_atomic "$backend" -k "d64 and atomic"
run d64_det "$backend" -k "d64 and det"
run d128_atomic "$backend" -k "d128 and atomic"
run d128_det "$backend" -k "d128 and det"
run d256_hopper "$backend" -k "d256 and hopper"
run backend_rest "$backend" -k "not d64 and not d128 and not (d256 and hopper)"
run attention tests/test_attention.py -k "cuda and not compiles"
run transforms_errors tests/test_transforms.py tests/test_errors.py \
  -k "cuda or none_picks or dq_mode"
start kernel_check bash -c "for f in hopper mma_sync simt; do
  \"$check\" --family \$f && \"$check\" --family \$f --deterministic || exit 1; done"
run shared_rest tests -k "cuda and not compiles" --ignore "$backend" \
  --ignore tests/test_attention.py --ignore tests/test_transforms.py \
  --ignore tests/test_errors.py --ignore tests/test_metal_emulator.py \
  --ignore tests/test_metal_profile.py --ignore tests/test_metal_standin.py \
  --ignore tests/test_metal_fused_backward.py
  # (the emulator's tests and the stand-in's, which reuses them: the GPU build
  # leaves the emulator out)
sanitize san_memcheck memcheck
sanitize san_memcheck_det memcheck --deterministic
sanitize san_memcheck_sm80 memcheck --family mma_sync
sanitize san_memcheck_simt memcheck --family simt
sanitize san_racecheck racecheck
sanitize san_racecheck_det racecheck --deterministic
sanitize san_racecheck_sm80 racecheck --family mma_sync
sanitize san_racecheck_simt racecheck --family simt
wait

status=0
for name in "${names[@]}"; do
  if [[ $name == san_* || $name == kernel_check ]]; then
    # compute-sanitizer's closing line: "========= ERROR SUMMARY: 0 errors"
    # (memcheck) or "========= RACECHECK SUMMARY: 0 hazards displayed (0
    # errors, 0 warnings)"; the check's, per run: "ALL PASSED" or "FAILED: ...".
    ran=$(grep -c "ok-ish" "$out/$name.txt")
    if [[ $name == san_* ]]; then
      summary=$(grep -E "(ERROR|RACECHECK) SUMMARY" "$out/$name.txt" | tail -1)
      [[ -n $summary ]] && summary="$ran cases, ${summary#*= }"
    else
      summary=$(grep -cE "^ALL PASSED" "$out/$name.txt")
      [[ $summary == 6 ]] && summary="$ran cases, 6 runs passed" || summary=""
      grep -q "no CUDA GPU" "$out/$name.txt" && summary="no GPU, nothing checked"
    fi
    if [[ $summary =~ [1-9][0-9]*\ errors ]] ||
       grep -qE "FAIL" "$out/$name.txt"; then
      summary="FAILED: $summary"
    fi
  else
    # pytest's closing line: "3 passed, 1 skipped, 20 deselected in 9.81s".
    summary=$(grep -E "(passed|failed|skipped|deselected|errors?|no tests ran).* in [0-9.]+s" \
                "$out/$name.txt" | tail -1)
  fi
  if [[ -z $summary ]]; then
    summary="did not finish within ${limit} s: $(head -c 200 "$out/$name.txt" | head -1)"
    status=1
  elif [[ $summary == *failed* || $summary == FAILED* || $summary =~ [1-9][0-9]*\ errors? ]]; then
    status=1
  fi
  printf '%-18s %s\n' "$name" "$summary"
  grep -E "^FAILED|^ERROR" "$out/$name.txt" | head -5
done
exit $status
