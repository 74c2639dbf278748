#!/usr/bin/env bash
# The native code on arm64 (aarch64), the instruction set Macs run, on an
# x86-64 Linux machine: cross-built with Debian's aarch64 toolchain and run
# under qemu-user (docs/testing.md, "arm64 under qemu").
#
#   tools/arm64_check.sh cpu [CASE...]   the CPU kernels' C++ test (NEON build, by
#                                        g++ and by clang++);
#                                        default cases: the CI subset below,
#                                        "all": every case
#   tools/arm64_check.sh metal [CASE...] the Metal stand-in on aarch64: its
#                                        self-test and the host driver
#                                        (forward + backward per head dim
#                                        through executor.cc, bitwise against
#                                        the emulator); needs the package's
#                                        virtual environment (python3 with
#                                        jax_fatrain importable)
#   tools/arm64_check.sh all             both
#
# Needs: g++-aarch64-linux-gnu, libc6-dev-arm64-cross, qemu-user, clang, and
# for metal lld. Build directory: $FATRAIN_ARM64_BUILD_DIR (default
# $TMPDIR/fatrain_arm64).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
out="${FATRAIN_ARM64_BUILD_DIR:-${TMPDIR:-/tmp}/fatrain_arm64}"
mkdir -p "$out"
sysroot=/usr/aarch64-linux-gnu
qemu=(qemu-aarch64 -L "$sysroot")

for tool in aarch64-linux-gnu-g++ aarch64-linux-gnu-objdump qemu-aarch64; do
  command -v "$tool" >/dev/null || { echo "arm64_check: $tool not found" >&2; exit 2; }
done

# The CPU cases CI runs (about 16 s of CPU time under qemu; all 33 cases take
# about 205 s): head dims 3, 64, 128 over several tiles and 256, GQA, the
# bias gradient, a mask with a window, unsorted segment ids, and f32, bf16
# and f16 operands.
ci_cases=(causal_gqa2_d64 causal_gqa4_d128_multitile bias_1N1S_bf16bias_gqa2_d256
          window_mask_d128_f16 small_d3_f16 segments_unsorted_d64)

check_cpu() {
  local cases=("$@")
  ((${#cases[@]})) || cases=("${ci_cases[@]}")
  [[ "${cases[0]}" == all ]] && cases=()
  echo "=== arm64 cpu: cross build (aarch64-linux-gnu-g++) and qemu-aarch64 run"
  # The baseline kernels must be NEON code: vector FMAs on four floats.
  local fmla
  CXX=aarch64-linux-gnu-g++ FATRAIN_TEST_BUILD_DIR="$out/cpu" FATRAIN_TEST_RUNNER="${qemu[*]}" \
    FATRAIN_EXPECT_VECTOR_ISA=neon "$root/cpp/cpu/tests/build_and_test.sh" "${cases[@]}"
  fmla="$(aarch64-linux-gnu-objdump -d --no-show-raw-insn "$out/cpu/isa_baseline.o" |
          grep -cE $'\tfmla\tv[0-9]+\\.4s' || true)"
  echo "NEON fmla v.4s instructions in the baseline kernels: $fmla"
  if ((fmla < 16)); then
    echo "FAILED: the aarch64 baseline kernels are not NEON code" >&2
    return 1
  fi
  # The same cases compiled by clang++, the compiler family that builds the
  # package on macOS (Apple's clang), which has none of GCC's own builtins.
  command -v clang++ >/dev/null || { echo "arm64_check: clang++ not found" >&2; return 2; }
  echo "=== arm64 cpu: cross build (clang++ --target=aarch64-linux-gnu) and qemu-aarch64 run"
  printf '#!/bin/sh\nexec clang++ --target=aarch64-linux-gnu "$@"\n' > "$out/clang-aarch64"
  chmod +x "$out/clang-aarch64"
  CXX="$out/clang-aarch64" FATRAIN_TEST_BUILD_DIR="$out/cpu-clang" FATRAIN_TEST_RUNNER="${qemu[*]}" \
    FATRAIN_EXPECT_VECTOR_ISA=neon "$root/cpp/cpu/tests/build_and_test.sh" "${cases[@]}"
}

# The stand-in for aarch64, compiled by clang++ --target=aarch64-linux-gnu:
# the emulator and the kernels (pre-passed to C++), the host and the stand-in
# (against metal-cpp, with -fblocks), the message send of
# objc_msgsend_aarch64.S, all linked into host_check by aarch64-linux-gnu-g++.
check_metal() {
  echo "=== arm64 metal: the stand-in, executor.cc and host_check for aarch64, under qemu-aarch64"
  local python="${PYTHON:-python3}" m="$out/metal" standin="$root/tests/metal_standin"
  local emulator="$root/cpp/metal/emulator" stubs="$root/tests/metal_typecheck/stubs"
  mkdir -p "$m"
  # The kernel library as the package hands it to newLibraryWithSource, its
  # pre-pass to C++, and the metal-cpp headers (PyPI, checked by SHA-256):
  # standin.py's own steps.
  # FATRAIN_STANDIN_PLANT names one of standin.py's PLANTED host bugs in
  # executor.cc: host_check must then fail.
  local mcpp executor="$root/cpp/metal/host/executor.cc"
  mcpp="$(cd "$root" && "$python" - "$m" "${FATRAIN_STANDIN_PLANT:-}" <<'PY'
import pathlib, sys
sys.path.insert(0, "tests/metal_standin")
import standin
out, plant = pathlib.Path(sys.argv[1]), sys.argv[2]
(out / "library.metal").write_text(standin.library_source())
(out / "executor_planted.cc").unlink(missing_ok=True)
if plant:
  rel, old, new = standin.PLANTED[plant]
  assert rel == "cpp/metal/host/executor.cc", f"{plant} is not a bug of executor.cc"
  text = pathlib.Path(rel).read_text()
  assert text.count(old) == 1, f"planted bug {plant}: its text no longer occurs once"
  (out / "executor_planted.cc").write_text(text.replace(old, new))
print(standin.metal_cpp())
PY
)"
  [[ -f "$m/executor_planted.cc" ]] && executor="$m/executor_planted.cc"
  "$python" "$emulator/msl_prepass.py" "$m/library.metal" "$m/library.cc" --cxx aarch64-linux-gnu-g++
  {
    echo '    .section .rodata'
    echo '    .globl fatrain_standin_library_source'
    echo '    .hidden fatrain_standin_library_source'
    echo '    .globl fatrain_standin_library_source_end'
    echo '    .hidden fatrain_standin_library_source_end'
    echo 'fatrain_standin_library_source:'
    echo "    .incbin \"$m/library.metal\""
    echo 'fatrain_standin_library_source_end:'
    echo '    .byte 0'
    echo '    .section .note.GNU-stack,"",%progbits'
  } >"$m/library_source.S"

  # The emulator's half is _Float16, which aarch64 g++ 12 lacks in C++: clang
  # compiles it too.
  local gxx=(clang++ --target=aarch64-linux-gnu -std=c++17 -O2 -w)
  local clangxx=("${gxx[@]}" -fblocks
                 -include "$stubs/apple_prelude.h" -isystem "$stubs" -isystem "$mcpp")
  local inc=(-I "$root/cpp" -I "$root/jax_fatrain/metal" -I "$emulator/include")
  "${gxx[@]}" "${inc[@]}" -c "$m/library.cc" -o "$m/library.o" &
  "${gxx[@]}" "${inc[@]}" -c "$emulator/src/runtime.cc" -o "$m/runtime.o" &
  "${gxx[@]}" "${inc[@]}" -c "$emulator/src/plan_executor.cc" -o "$m/plan_executor.o" &
  "${gxx[@]}" "${inc[@]}" -c "$root/cpp/metal/plan/plan.cc" -o "$m/plan.o" &
  "${gxx[@]}" "${inc[@]}" -c "$standin/host_check.cc" -o "$m/host_check.o" &
  "${clangxx[@]}" "${inc[@]}" -c "$executor" -o "$m/executor.o" &
  "${clangxx[@]}" -I "$emulator/include" -I "$standin" -c "$standin/metal_standin.cc" \
    -o "$m/metal_standin.o" &
  "${clangxx[@]}" -I "$standin" -c "$standin/standin_selftest.cc" -o "$m/standin_selftest.o" &
  "${clangxx[@]}" -I "$standin" -c "$standin/objc_runtime.cc" -o "$m/objc_runtime.o" &
  aarch64-linux-gnu-g++ -c "$standin/objc_msgsend_aarch64.S" -o "$m/objc_msgsend.o" &
  aarch64-linux-gnu-g++ -c "$m/library_source.S" -o "$m/library_source.o" &
  local job status=0
  for job in $(jobs -p); do wait "$job" || status=1; done
  ((status == 0)) || { echo "FAILED: the aarch64 build of the stand-in" >&2; return 1; }
  aarch64-linux-gnu-g++ -o "$m/host_check" "$m"/*.o -pthread -ldl
  "${qemu[@]}" "$m/host_check" "$@"
}

mode="${1:-all}"
shift || true
case "$mode" in
  cpu) check_cpu "$@" ;;
  metal) check_metal "$@" ;;
  all) check_cpu; check_metal ;;
  *) echo "usage: $0 [cpu [CASE...]|metal [CASE...]|all]" >&2; exit 2 ;;
esac
