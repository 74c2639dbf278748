#!/usr/bin/env bash
# Every GPU test of the CUDA backend, as nine pytest processes at once, and
# compute-sanitizer over one forward and backward of each kernel family
# (tools/cuda_sanitize.py: memcheck in both backward modes and with the sm_80
# kernels, racecheck on the default kernels) as four more processes (the
# longest process sets the time, docs/testing.md has it for an H200; one
# after the other they take several times that), for the GPU machine after
# tools/cuda_device_build.sh:
#   bash tools/cuda_gpu_tests.sh [OUTDIR] [TIMEOUT_S] [tests|sanitizers|NAME_REGEX]
# Each process writes OUTDIR/NAME.txt (default /tmp/cuda_gpu_tests) and is
# stopped after TIMEOUT_S seconds (default 540). The third argument runs only
# the pytest processes ("tests"), only the sanitizer ones ("sanitizers"), or
# the processes whose names match NAME_REGEX. All thirteen at once share one
# GPU and its host's cores (on an H200 most were still running after 7
# minutes), so "tests" and "sanitizers" are best run one after the other.
# Prints one line per process and exits non-zero when a test failed, the
# sanitizer reported an error or a process did not finish. Without a GPU
# every test skips.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-/tmp/cuda_gpu_tests}
limit=${2:-540}
only=${3:-.}
mkdir -p "$out"
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1

backend=tests/test_cuda_backend.py
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
sanitize() {  # NAME TOOL [-- SCRIPT_ARGS...]: our kernels only
  local name=$1 tool=$2
  shift 2
  [[ ${1:-} == -- ]] && shift
  # XLA's autotuner would time its candidate kernels under the sanitizer
  # (minutes), and its command buffers replay kernels as CUDA graphs: both off.
  XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_autotune_level=0 --xla_gpu_enable_command_buffer=" \
  start "$name" compute-sanitizer --tool "$tool" --kernel-name kns=fatrain \
    --error-exitcode 3 python3 tools/cuda_sanitize.py "$@"
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
run shared_rest tests -k "cuda and not compiles" --ignore "$backend" \
  --ignore tests/test_attention.py --ignore tests/test_transforms.py \
  --ignore tests/test_errors.py --ignore tests/test_metal_emulator.py \
  --ignore tests/test_metal_profile.py --ignore tests/test_metal_standin.py
  # (the emulator's tests and the stand-in's, which reuses them: the GPU build
  # leaves the emulator out)
sanitize san_memcheck memcheck
sanitize san_memcheck_det memcheck -- --deterministic
sanitize san_memcheck_sm80 memcheck -- --family mma_sync
sanitize san_racecheck racecheck -- --quick
wait

status=0
for name in "${names[@]}"; do
  if [[ $name == san_* ]]; then
    # compute-sanitizer's closing line: "========= ERROR SUMMARY: 0 errors".
    summary=$(grep -E "ERROR SUMMARY" "$out/$name.txt" | tail -1)
    ran=$(grep -cE "^ok " "$out/$name.txt")
    [[ -n $summary ]] && summary="$ran cases, ${summary#*= }"
    if [[ -n $summary && $summary != *" 0 errors"* ]] || grep -q Traceback "$out/$name.txt"; then
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
