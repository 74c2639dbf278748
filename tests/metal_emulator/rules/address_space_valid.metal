// Valid MSL address-space idioms the address-space rule must accept
// (tests/test_metal_emulator.py): pointer arithmetic, vector pointer casts
// within a space, thread references, a constant params struct (by pointer
// and by reference), simdgroup_load/store from threadgroup and device
// memory, templates deducing the space, values copied out of every space.
#include <metal_stdlib>
using namespace metal;

struct Params {
  int n;
  float scale;
  long strides[2];
};

template <typename P>
inline float first_of(P p) { return float(p[0]); }

template <typename T>
inline void add_to(thread T& acc, T x) { acc += x; }

inline float4 load4(const device float* p, int i) { return *((const device float4*)(p + i)); }

[[kernel]] void valid_address_spaces(const device float* in [[buffer(0)]],
                                     device float* out [[buffer(1)]],
                                     constant Params* params [[buffer(2)]],
                                     constant Params& same [[buffer(3)]],
                                     uint lane [[thread_index_in_simdgroup]]) {
  threadgroup float tile[64];
  const device float* row = in + params->strides[0] * 0 + lane;
  tile[lane] = row[0] * params->scale;
  tile[lane + 32] = float(same.n);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  simdgroup_matrix<float, 8, 8> m;
  simdgroup_load(m, tile, 8);
  simdgroup_load(m, in, 8);
  simdgroup_store(m, out, 8);
  simdgroup_store(m, tile, 8);
  Params local = *params;
  float acc = first_of(tile) + first_of(in) + first_of(params->strides) + float(local.n);
  add_to(acc, float(tile[lane]));
  const float4 v = load4(in, 4 * int(lane % 8));
  threadgroup float* t = tile + 8;
  out[lane] = acc + v.x + t[1] + (&tile[2])[1];
}
