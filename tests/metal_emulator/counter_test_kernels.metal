// Small kernels with known values of the MSL emulator's cost counters
// (jax_fatrain.emulator.profile.COUNTERS), checked by tests/test_metal_profile.py
// through a standalone build (jax_fatrain.emulator.msl_standalone).
#include <metal_stdlib>
using namespace metal;

// Per lane: 7 transcendental calls (exp, exp2, fast::exp2, a float2 exp = 2,
// rsqrt, log) and 4 float <-> bfloat conversions (bfloat(v), float(b), a
// bfloat read from device memory as float, a bfloat stored); half
// conversions and the bfloat simdgroup_matrix operands are not counted. Per
// simdgroup: 3 shuffles (xor, broadcast, down) and 3 reductions (sum, max,
// exclusive prefix sum).
[[kernel]] void emu_count_alu(
    const device float* x [[buffer(0)]],
    const device bfloat* xb [[buffer(1)]],
    device float* out [[buffer(2)]],
    device bfloat* outb [[buffer(3)]],
    uint gid [[thread_position_in_grid]]) {
  const float v = x[gid];
  float t = exp(v) + exp2(v) + fast::exp2(v) + rsqrt(v + 2.0f) + log(v + 2.0f);
  const float2 e = exp(float2(v, -v));
  t += e.x + e.y;
  const bfloat b = bfloat(v);
  const float fb = float(b);
  const float fx = xb[gid];
  const half h = half(v);
  simdgroup_matrix<bfloat, 8, 8> a = make_filled_simdgroup_matrix<bfloat, 8, 8>(b);
  simdgroup_matrix<float, 8, 8> c = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
  simdgroup_multiply_accumulate(c, a, a, c);
  float s = simd_shuffle_xor(v, 1) + simd_broadcast(v, 0) + simd_shuffle_down(v, 1);
  s += simd_sum(v) + simd_max(v) + simd_prefix_exclusive_sum(v);
  out[gid] = t + fb + fx + float(h) + s + c.thread_elements()[0];
  outb[gid] = bfloat(t);
}

// Threadgroup (x, y) of 64 threads reads row y of `shared` (256 floats: 8
// lines of 128 bytes, the same for every x), its own 64 floats of `own` (2
// lines) and adds them into its own 64 floats of `out` (2 lines, read and
// written). Per threadgroup: 12 distinct lines; 4 of them are not touched by
// its x neighbour, all 12 not by its y neighbour, 4 by neither.
[[kernel]] void emu_count_lines(
    const device float4* shared [[buffer(0)]],
    const device float* own [[buffer(1)]],
    device float* out [[buffer(2)]],
    uint2 group [[threadgroup_position_in_grid]],
    uint2 groups [[threadgroups_per_grid]],
    uint tid [[thread_index_in_threadgroup]]) {
  const float4 r = shared[group.y * 64 + tid];
  const uint i = (group.y * groups.x + group.x) * 64 + tid;
  out[i] += own[i] + r.x + r.y + r.z + r.w;
}
