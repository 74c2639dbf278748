// Planted rule breaks (cpp/metal/emulator/README.md, "Rules", unroll):
// member arrays of a struct in thread memory, indexed by loops that are not
// unrolled, in a member function (line 14) and through a thread reference
// (line 28). The same loop through a threadgroup pointer (line 34) is not
// register memory and is fine.
#include <metal_stdlib>
using namespace metal;

struct Run {
  float v[4];
  float total;

  METAL_FUNC void sum() {
    for (int i = 0; i < 4; ++i) {
      total += v[i];
    }
  }
};

inline void fill(thread Run& r, float x) {
#pragma clang loop unroll(full)
  for (int i = 0; i < 4; ++i) r.v[i] = x + float(i);
  r.total = 0.0f;
}

inline float scaled(thread const Run& r, int n) {
  float s = 0.0f;
  for (int i = 0; i < n; ++i) s += r.v[i];
  return s;
}

inline float shared_sum(threadgroup const Run* t, int n) {
  float s = 0.0f;
  for (int i = 0; i < n; ++i) s += t->v[i];
  return s;
}

[[kernel]] void planted_member_array(device float* out [[buffer(0)]],
                                     uint lane [[thread_index_in_simdgroup]]) {
  threadgroup Run shared;
  Run r;
  fill(r, float(lane));
  r.sum();
  if (lane == 0) shared = r;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  out[lane] = r.total + scaled(r, 4) + shared_sum(&shared, 4);
}
