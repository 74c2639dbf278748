// Kernel scratch: per-item buffers and the packed-operand scratch block kept
// between calls.
//
// Part of the CPU kernels compiled once per ISA: see attention_cpu_impl.h.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "vectors.h"

namespace fatrain::cpu::FATRAIN_ISA {
namespace {

static inline float* falloc(int64_t n) {
  size_t bytes = static_cast<size_t>(round_up(n > 0 ? n : 1, 16)) * 4;
  return static_cast<float*>(aligned_alloc(64, bytes));
}

// Large packed-operand scratch, kept in a one-slot cache between calls so
// that repeated calls do not pay page faults for fresh pages (tens of MB at
// long sequence lengths). The slot keeps the largest recently released block
// (at most kCacheMax bytes); take/give use atomic exchanges only, so any
// interleaving of concurrent calls is safe (each block is owned by exactly one
// caller or by the slot). A block is [64-byte header holding its capacity in
// floats][data].
constexpr int64_t kCacheMaxFloats = int64_t(1) << 28;  // 1 GiB
void* g_scratch_slot = nullptr;

static inline int64_t block_cap(void* blk) { return *static_cast<int64_t*>(blk); }

static float* scratch_take(int64_t n, void** handle) {
  n = round_up(n > 0 ? n : 1, 16);
  void* blk = __atomic_exchange_n(&g_scratch_slot, static_cast<void*>(nullptr), __ATOMIC_ACQ_REL);
  if (blk != nullptr && block_cap(blk) < n) {
    free(blk);
    blk = nullptr;
  }
  if (blk == nullptr) {
    blk = aligned_alloc(64, 64 + static_cast<size_t>(n) * 4);
    if (blk == nullptr) return nullptr;
    *static_cast<int64_t*>(blk) = n;
  }
  *handle = blk;
  return reinterpret_cast<float*>(static_cast<char*>(blk) + 64);
}

static void scratch_give(void* blk) {
  if (blk == nullptr) return;
  if (block_cap(blk) > kCacheMaxFloats) {
    free(blk);
    return;
  }
  void* old = __atomic_exchange_n(&g_scratch_slot, blk, __ATOMIC_ACQ_REL);
  if (old == nullptr) return;
  if (block_cap(old) > block_cap(blk)) {
    // Keep the larger block in the slot; free whatever it displaces.
    void* cur = __atomic_exchange_n(&g_scratch_slot, old, __ATOMIC_ACQ_REL);
    free(cur);
  } else {
    free(old);
  }
}

// Carves 64-byte aligned sub-arrays out of one scratch block; with a null
// base it only measures (take returns null, `used` counts the floats).
struct Carver {
  float* base;
  int64_t used;
  float* take(int64_t n) {
    float* p = base ? base + used : nullptr;
    used += round_up(n > 0 ? n : 1, 16);
    return p;
  }
};
static inline int64_t carve_size(int64_t n) { return round_up(n > 0 ? n : 1, 16); }

}  // namespace
}  // namespace fatrain::cpu::FATRAIN_ISA
