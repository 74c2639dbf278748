#!/usr/bin/env bash
# The native code under sanitizers (docs/testing.md, "Sanitizers"):
#
#   1. cpp/cpu/tests under AddressSanitizer + UndefinedBehaviorSanitizer (g++),
#      once per ISA the machine has;
#   2. the same tests under ThreadSanitizer (the kernels' parallel loops run on
#      the test's 4 threads);
#   3. the Python extensions (_cpu_ffi, _metal_emulated_ffi) and the Metal
#      stand-in's _metal_ffi built with -fsanitize=address,undefined (g++; the
#      stand-in's metal-cpp objects with clang++) into a venv of their own
#      (build/sanitize/venv, build dir build/sanitize/{wheel_tag}; the normal
#      build is not touched), and pytest on them with libasan preloaded.
#
# Every sanitizer finding aborts the process (halt_on_error=1, UBSan without
# recovery), so a finding is a failed step. LeakSanitizer runs on the C++ tests;
# it is off in Python (detect_leaks=0): CPython and jaxlib keep objects alive
# until exit by design, and the leak report would be theirs, not ours.
#
#   tools/sanitize.sh            everything (docs/testing.md has the times)
#   tools/sanitize.sh --quick    steps 1 and 2 on the multi-tile cases only
#                                (step 3 needs a sanitizer build of its own,
#                                longer than a CI budget)
#   tools/sanitize.sh --steps=asan,tsan,python   choose steps (default: all)
#
# Needs g++ with libasan, libubsan, libtsan, and clang++ (the stand-in).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"

quick=0
steps="asan,tsan,python"
for arg in "$@"; do
  case "$arg" in
    --quick) quick=1 ;;
    --steps=*) steps="${arg#--steps=}" ;;
    *) echo "usage: $0 [--quick] [--steps=asan,tsan,python]" >&2; exit 2 ;;
  esac
done
has_step() { [[ ",$steps," == *",$1,"* ]]; }

out="$root/build/sanitize"
mkdir -p "$out"
san_flags="-fno-sanitize-recover=all -fno-omit-frame-pointer -g"
status=0
step() {  # step NAME COMMAND...: runs, times and reports one step
  local name="$1"; shift
  local t0=$SECONDS
  echo "=== sanitize: $name"
  if "$@"; then
    echo "=== sanitize: $name passed ($((SECONDS - t0)) s)"
  else
    echo "=== sanitize: $name FAILED ($((SECONDS - t0)) s)"
    status=1
    return 1
  fi
}

# The C++ tests, every ISA the machine has (quick: only the cases named
# *multitile*, whose passes span several work items on several threads).
cpu_tests() {  # cpu_tests BUILD_DIR FLAGS
  local only=()
  [[ $quick == 1 ]] && only=(multitile)
  FATRAIN_TEST_BUILD_DIR="$1" FATRAIN_TEST_CXXFLAGS="$2" \
    cpp/cpu/tests/build_and_test.sh "${only[@]}"
}

if has_step asan; then
  export ASAN_OPTIONS=halt_on_error=1:abort_on_error=1:detect_leaks=1
  export UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1
  step "cpp/cpu/tests, ASan+UBSan" cpu_tests "$out/cpu_asan" "-fsanitize=address,undefined $san_flags" || true
fi

if has_step tsan; then
  export TSAN_OPTIONS=halt_on_error=1:second_deadlock_stack=1
  step "cpp/cpu/tests, TSan" cpu_tests "$out/cpu_tsan" "-fsanitize=thread $san_flags" || true
fi

if has_step python && [[ $quick == 0 ]]; then
  # g++ builds the extensions (and the stand-in's objects that need no clang);
  # its libasan and libubsan also serve the stand-in's clang-built objects, so
  # one runtime, preloaded, covers everything loaded into Python.
  # libstdc++ is preloaded with it: python itself does not link libstdc++, so
  # without it libasan starts before libstdc++ is loaded, cannot intercept
  # __cxa_throw, and its CHECK aborts the first C++ exception jaxlib throws.
  preload="$(g++ -print-file-name=libasan.so) $(g++ -print-file-name=libstdc++.so)"
  venv="$out/venv"
  export JAX_FATRAIN_SANITIZE=address,undefined
  export JAX_FATRAIN_CACHE="$out/cache"   # the stand-in's objects, apart from normal ones
  if [[ ! -x "$venv/bin/python" ]]; then
    # What the build needs (--no-build-isolation below) and what the tests import.
    step "sanitizer venv" bash -c "python3 -m venv '$venv' && '$venv/bin/pip' install -q \
      --upgrade pip && '$venv/bin/pip' install -q scikit-build-core nanobind jax jaxlib \
      'flax>=0.12.8' optax tqdm matplotlib hypothesis pytest numpy" || exit 1
  fi
  step "build (g++ -fsanitize=address,undefined)" "$venv/bin/pip" install -q -e ".[test]" \
    --no-build-isolation -C "build-dir=build/sanitize/{wheel_tag}" \
    -C "cmake.define.JAX_FATRAIN_SANITIZE=address,undefined" || exit 1
  # The tests: the shared suite for cpu, metal_emulated and the stand-in's metal,
  # hostile inputs, properties (derandomised: the "ci" profile), segment ids and
  # the stand-in's tests. xla (jax.nn) runs no code of ours and is left out.
  tests=(
    tests/test_attention.py
    "tests/test_metal_emulator.py::test_shared_suite"
    tests/test_hostile_inputs.py
    tests/test_properties.py
    tests/test_segment_ids.py
    tests/test_metal_standin.py
    -k "not xla"
  )
  # -s: pytest would capture the tests' stderr and lose it (the sanitizer's
  # report) when the sanitizer ends the process.
  step "pytest under ASan+UBSan" env \
    LD_PRELOAD="$preload" JAX_PLATFORMS=cpu \
    ASAN_OPTIONS=halt_on_error=1:abort_on_error=1:detect_leaks=0 \
    UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 \
    JAX_FATRAIN_HYPOTHESIS_PROFILE=ci JAX_FATRAIN_REQUIRE_METAL_STANDIN=1 \
    "$venv/bin/pytest" -q -s -p no:cacheprovider "${tests[@]}" || true
fi

exit $status
