// Running a pass's work items on the caller's ParallelFor.
//
// Part of the CPU kernels compiled once per ISA: see attention_cpu_impl.h.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "vectors.h"

namespace fatrain::cpu::FATRAIN_ISA {
namespace {

// ---------------------------------------------------------------------------
// Parallel helpers.
// ---------------------------------------------------------------------------
template <class F>
static void trampoline(void* context, int64_t i) {
  (*static_cast<F*>(context))(i);
}
template <class F>
static void parallel_for(const ParallelFor& pf, int64_t count, F& f) {
  if (count <= 0) return;
  if (pf.run == nullptr || count == 1) {
    for (int64_t i = 0; i < count; ++i) f(i);
  } else {
    pf.run(pf.self, count, &trampoline<F>, &f);
  }
}
static inline void set_fail(int* flag) { __atomic_store_n(flag, 1, __ATOMIC_RELAXED); }

template <class State, void (*Fn)(State&, int64_t)>
struct Bound {
  State* st;
  void operator()(int64_t i) const { Fn(*st, i); }
};

template <class State, void (*Fn)(State&, int64_t)>
static void run_items(const ParallelFor& pf, int64_t count, State& st) {
  Bound<State, Fn> b{&st};
  parallel_for(pf, count, b);
}

static const char* kOom = "jax_fatrain cpu: out of memory for attention scratch";

}  // namespace
}  // namespace fatrain::cpu::FATRAIN_ISA
