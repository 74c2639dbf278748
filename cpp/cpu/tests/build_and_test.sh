#!/usr/bin/env bash
# Builds the CPU kernels and their standalone test with g++ (the flags the
# CMake build uses) and runs the suite once per ISA the machine supports.
#   cpp/cpu/tests/build_and_test.sh          build + test exp2 and every ISA
#   cpp/cpu/tests/build_and_test.sh bench [threads reps T ROW]  build + benchmark
#   cpp/cpu/tests/build_and_test.sh phases [threads reps T ROW]  the benchmark built
#       with the phase timers (cpp/cpu/phase_timers.h; its own build directory,
#       FATRAIN_TEST_BUILD_DIR with _phases appended), adding each row's shares
#       of the forward's and the backward's thread time by phase
#   cpp/cpu/tests/build_and_test.sh tiles    build + time the tile products alone
#       (AVX-512, and its bf16 pair or AMX products where the CPU runs them;
#       FATRAIN_TILES_ISA=avx2: the AVX2 ones; FATRAIN_TILES_ONEDNN=1: beside
#       oneDNN's matmul on the same shapes)
#   cpp/cpu/tests/build_and_test.sh compare OTHER [threads rounds T D causal f32|bf16]
#       build + time this tree's AVX-512 kernels against those of the checkout
#       OTHER, alternating calls in one process (compare_trees.cc); with
#       FATRAIN_COMPARE_ISA=avx512_bf16, their bf16 pair path (bf16), with
#       FATRAIN_COMPARE_ISA=avx512_amx, the AMX kernels (bf16), with
#       FATRAIN_COMPARE_ISA=avx2, the AVX2 kernels
# A cross compiler in CXX builds for its target (the x86-64 ISAs only for
# x86-64) and FATRAIN_TEST_RUNNER runs the binary (e.g. qemu-aarch64, see
# tools/arm64_check.sh). FATRAIN_TEST_CXXFLAGS adds compile and link flags and
# FATRAIN_TEST_ISAS chooses the ISAs to test (tools/sanitize.sh: the sanitizers).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
src="$here/.."
out="${FATRAIN_TEST_BUILD_DIR:-${TMPDIR:-/tmp}/fatrain_cpu_test_build}"
CXX="${CXX:-g++}"
common=(-std=c++17 -O3 -ffp-contract=fast -fPIC -Wall -Wextra -Wno-unused-parameter -I"$src/..")
if [[ "${1:-}" == "phases" ]]; then
  out="${out}_phases"
  common+=(-DFATRAIN_PHASE_TIMERS)
fi
mkdir -p "$out"
extra=(${FATRAIN_TEST_CXXFLAGS:-})
common+=("${extra[@]}")
isa_avx2=(-mavx2 -mfma -mf16c)
isa_avx512=(-mavx512f -mavx512bw -mavx512vl -mavx512dq -mfma -mf16c -mavx512bf16 -mprefer-vector-width=512)

"$CXX" "${common[@]}" -c "$src/attention_cpu.cc" -o "$out/attention_cpu.o" &
"$CXX" "${common[@]}" -c "$src/attention_cpu_isa_baseline.cc" -o "$out/isa_baseline.o" &
objs=("$out/attention_cpu.o" "$out/isa_baseline.o")
x86_64=0
[[ "$("$CXX" -dumpmachine)" == x86_64* ]] && x86_64=1
if ((x86_64)); then
  "$CXX" "${common[@]}" "${isa_avx2[@]}" -c "$src/attention_cpu_isa_avx2.cc" -o "$out/isa_avx2.o" &
  "$CXX" "${common[@]}" "${isa_avx2[@]}" -c "$src/attention_cpu_isa_avx2_bf16_emulated.cc" \
    -o "$out/isa_avx2_bf16_emulated.o" &
  "$CXX" "${common[@]}" "${isa_avx512[@]}" -c "$src/attention_cpu_isa_avx512.cc" -o "$out/isa_avx512.o" &
  "$CXX" "${common[@]}" "${isa_avx512[@]}" -mamx-tile -mamx-bf16 -c "$src/attention_cpu_isa_avx512_amx.cc" \
    -o "$out/isa_avx512_amx.o" &
  objs+=("$out/isa_avx2.o" "$out/isa_avx2_bf16_emulated.o" "$out/isa_avx512.o" "$out/isa_avx512_amx.o")
fi
"$CXX" "${common[@]}" -c "$here/test_attention_cpu.cc" -o "$out/test_attention_cpu.o" &
# Wait for each compile by itself, so that one that fails stops the script here.
for job in $(jobs -p); do wait "$job"; done
"$CXX" -o "$out/test_attention_cpu" "$out/test_attention_cpu.o" "${objs[@]}" -pthread "${extra[@]}"

if [[ "${1:-}" == "tiles" ]]; then
  ((x86_64)) || { echo "tiles: the tile benchmark is built for the x86-64 kernels"; exit 2; }
  # FATRAIN_TILES_ISA: avx512 (default) or avx2.
  case "${FATRAIN_TILES_ISA:-avx512}" in
    avx512) isa_tiles=("${isa_avx512[@]}" -mamx-tile -mamx-bf16) ;;
    avx2) isa_tiles=("${isa_avx2[@]}") ;;
    *) echo "tiles: FATRAIN_TILES_ISA is avx512 or avx2"; exit 2 ;;
  esac
  # FATRAIN_TILES_ONEDNN=1: each row also times oneDNN's matmul on its shape,
  # from Debian's libdnnl-dev (apt-get install libdnnl-dev), on one thread.
  onednn=()
  if [[ "${FATRAIN_TILES_ONEDNN:-0}" == 1 ]]; then
    [[ -f /usr/include/oneapi/dnnl/dnnl.hpp ]] || {
      echo "tiles: FATRAIN_TILES_ONEDNN=1 needs oneDNN's headers and library: apt-get install libdnnl-dev"
      exit 2
    }
    onednn=(-DFATRAIN_TILES_ONEDNN -ldnnl)
  fi
  "$CXX" "${common[@]}" "${isa_tiles[@]}" -o "$out/bench_tile_products" \
    "$here/bench_tile_products.cc" "${objs[@]}" -pthread "${onednn[@]}" "${extra[@]}"
  OMP_NUM_THREADS=1 ${FATRAIN_TEST_RUNNER:-} "$out/bench_tile_products"
  exit 0
fi

if [[ "${1:-}" == "compare" ]]; then
  ((x86_64)) || { echo "compare: built for the x86-64 kernels"; exit 2; }
  other="${2:?compare: name the root of the other checkout}"
  [[ -f "$other/cpp/cpu/attention_cpu_impl.h" ]] || { echo "compare: $other has no cpp/cpu/attention_cpu_impl.h"; exit 2; }
  # FATRAIN_COMPARE_ISA: avx512 (default), avx512_bf16 (the bf16 pair path,
  # bf16 problems), avx512_amx (the AMX variants, bf16 problems) or avx2; the
  # other checkout is compiled as that variant is.
  flags=("${isa_avx512[@]}") bf16_dot='#define FATRAIN_BF16_DOT 1' variant=()
  case "${FATRAIN_COMPARE_ISA:-avx512}" in
    avx512) ;;
    avx512_bf16) variant=(-DFATRAIN_COMPARE_BF16_PAIRS) ;;
    avx512_amx) flags+=(-mamx-tile -mamx-bf16 -DFATRAIN_AMX=1) variant=(-DFATRAIN_COMPARE_AMX) ;;
    avx2) flags=("${isa_avx2[@]}") bf16_dot='' variant=(-DFATRAIN_COMPARE_AVX2) ;;
    *) echo "compare: FATRAIN_COMPARE_ISA must be avx512, avx512_bf16, avx512_amx or avx2"; exit 2 ;;
  esac
  printf '#define FATRAIN_ISA other\n%s\n#include "%s/cpp/cpu/attention_cpu_impl.h"\n' \
    "$bf16_dot" "$(cd "$other" && pwd)" > "$out/isa_other.cc"
  "$CXX" "${common[@]}" "${flags[@]}" -c "$out/isa_other.cc" -o "$out/isa_other.o"
  "$CXX" "${common[@]}" "${variant[@]}" -o "$out/compare_trees" "$here/compare_trees.cc" \
    "$out/isa_other.o" "${objs[@]}" -pthread "${extra[@]}"
  shift 2
  ${FATRAIN_TEST_RUNNER:-} "$out/compare_trees" "$@"
  exit 0
fi

if [[ "${1:-}" == "bench" || "${1:-}" == "phases" ]]; then
  shift
  for isa in ${FATRAIN_BENCH_ISAS:-avx512}; do
    JAX_FATRAIN_CPU_ISA=$isa ${FATRAIN_TEST_RUNNER:-} "$out/test_attention_cpu" bench "${@:-2}"
  done
  exit 0
fi

status=0
# exp2 against double precision, generic and (x86-64) AVX2 and AVX-512 forms.
"$CXX" "${common[@]}" -o "$out/test_exp2" "$here/test_exp2.cc" "${objs[@]}" -pthread "${extra[@]}"
${FATRAIN_TEST_RUNNER:-} "$out/test_exp2" || status=1
if ((x86_64)); then
  for form in avx2 avx512; do
    flags_name="isa_$form[@]" cpu_flag=$form
    [[ $form == avx512 ]] && cpu_flag=avx512f
    "$CXX" "${common[@]}" "${!flags_name}" -o "$out/test_exp2_$form" "$here/test_exp2.cc" \
      "${objs[@]}" -pthread "${extra[@]}"
    if grep -qw "$cpu_flag" /proc/cpuinfo 2>/dev/null; then
      ${FATRAIN_TEST_RUNNER:-} "$out/test_exp2_$form" || status=1
    else
      echo "test_exp2 ($form form): skipped, this CPU has no $cpu_flag"
    fi
  done
fi
# A variant the CPU lacks is ignored by the dispatcher (the best one runs).
isas=(baseline)
((x86_64)) && isas=(avx512_amx avx512_bf16 avx512 avx2_bf16_emulated avx2 baseline)
[[ -n "${FATRAIN_TEST_ISAS:-}" ]] && read -r -a isas <<<"$FATRAIN_TEST_ISAS"
for isa in "${isas[@]}"; do
  echo "=== JAX_FATRAIN_CPU_ISA=$isa"
  JAX_FATRAIN_CPU_ISA=$isa ${FATRAIN_TEST_RUNNER:-} "$out/test_attention_cpu" "$@" || status=1
done
exit $status
