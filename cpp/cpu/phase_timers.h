// Where the CPU kernels spend their time, by phase: cycle counters for the
// C++ benchmark (cpp/cpu/tests/build_and_test.sh phases).
//
// Built with FATRAIN_PHASE_TIMERS defined, the kernels add the cycles of each
// phase they run to g_phase_cycles, summed over the threads that run it
// (kernels/phase_scope.h); the counters live in attention_cpu.cc. Built
// without it (the package, and every other build), there are no counters and
// the kernels carry no timing code.
#pragma once

#include <cstdint>

namespace fatrain::cpu {

enum Phase : int {
  // Packing operands before the items run (fwd_pack_keys, fwd_amx_pack_keys,
  // fwd_pack_words, bwd_pack): K and V for the forward; Q, dO, K, V, their
  // other forms and Drow for the backward.
  kPhasePack,
  // Inside the forward's items: reading a query tile of q (transposed or as
  // bf16 pairs) and writing its rows of O and L.
  kPhaseLoadQ,
  kPhaseStoreO,
  // Inside every item: the tile products that compute scores (S = Q K^T and
  // dP = dO V^T; score_gemm, amx_gemm) and those that accumulate (O, dV, dK
  // and dQ; acc_gemm, acc_gemm_at, amx_acc_gemm, amx_acc_steps).
  kPhaseScoreProducts,
  kPhaseAccProducts,
  // The items whole (fwd_item; bwd_fused, or bwd_pass1 and bwd_pass2): the
  // phases above that run inside them plus the softmax, masking, the bf16
  // rounding of P and dS, and writing the gradients.
  kPhaseItems,
  kPhaseCount
};

#if defined(FATRAIN_PHASE_TIMERS)
extern uint64_t g_phase_cycles[kPhaseCount];
#endif

}  // namespace fatrain::cpu
