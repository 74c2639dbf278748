// PhaseScope: adds the cycles of a scope to its phase's counter when the
// kernels are built with FATRAIN_PHASE_TIMERS (../phase_timers.h), and is an
// empty object otherwise.
//
// Part of the CPU kernels compiled once per ISA: see attention_cpu_impl.h.
#pragma once

#include <cstdint>
#include <ctime>

#include "../phase_timers.h"

namespace fatrain::cpu::FATRAIN_ISA {
namespace {

#if defined(FATRAIN_PHASE_TIMERS)
// The time-stamp counter on x86-64 (a constant rate, a few tens of cycles to
// read), else the monotonic clock in nanoseconds: the benchmark reports
// shares of the total, so the unit does not matter.
static inline uint64_t phase_clock() {
#if defined(__x86_64__)
  return __builtin_ia32_rdtsc();
#else
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<uint64_t>(ts.tv_sec) * 1000000000u + static_cast<uint64_t>(ts.tv_nsec);
#endif
}

class PhaseScope {
 public:
  explicit PhaseScope(Phase phase) : phase_(phase), start_(phase_clock()) {}
  ~PhaseScope() {
    __atomic_fetch_add(&g_phase_cycles[phase_], phase_clock() - start_, __ATOMIC_RELAXED);
  }
  PhaseScope(const PhaseScope&) = delete;
  PhaseScope& operator=(const PhaseScope&) = delete;

 private:
  Phase phase_;
  uint64_t start_;
};
#else
class PhaseScope {
 public:
  explicit PhaseScope(Phase) {}
};
#endif

}  // namespace
}  // namespace fatrain::cpu::FATRAIN_ISA
