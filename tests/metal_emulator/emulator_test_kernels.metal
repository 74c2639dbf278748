// Small kernels that exercise the MSL emulator itself (not product code).
#include <metal_stdlib>
using namespace metal;

constant bool negate_out [[function_constant(10)]];

// C = A * B + A for 8x8 float matrices via simdgroup_matrix; also writes the
// element each lane holds (through thread_elements) next to the product, so a
// test can check the per-lane layout.
template <typename T>
[[kernel]] void emu_mma(
    const device T* a [[buffer(0)]],
    const device T* b [[buffer(1)]],
    device float* c [[buffer(2)]],
    device float* lanes [[buffer(3)]],
    uint lane [[thread_index_in_simdgroup]]) {
  simdgroup_matrix<float, 8, 8> A, B, C;
  simdgroup_load(A, a, 8);
  simdgroup_load(B, b, 8);
  simdgroup_multiply_accumulate(C, A, B, A);
  simdgroup_store(C, c, 8);
  // Transposed load of A, stored as is: gives A^T.
  simdgroup_matrix<float, 8, 8> At;
  simdgroup_load(At, a, 8, ulong2(0, 0), true);
  simdgroup_store(At, c + 64, 8);
  lanes[2 * lane] = A.thread_elements()[0];
  lanes[2 * lane + 1] = A.thread_elements()[1];
}

// Simd reductions, shuffles, threadgroup memory and barriers.
[[kernel]] void emu_simd_and_barrier(
    const device float* x [[buffer(0)]],
    device float* out [[buffer(1)]],
    constant uint& n [[buffer(2)]],
    uint tid [[thread_index_in_threadgroup]],
    uint sg [[simdgroup_index_in_threadgroup]],
    uint lane [[thread_index_in_simdgroup]],
    uint3 group [[threadgroup_position_in_grid]],
    uint3 tg_size [[threads_per_threadgroup]]) {
  threadgroup float shared[128];
  const uint base = group.x * tg_size.x;
  float v = x[base + tid];
  shared[tid] = v;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  // Neighbour through threadgroup memory (crosses simdgroups).
  float nb = shared[(tid + 1) % tg_size.x];
  float s = simd_sum(v);
  float m = simd_max(v);
  float xr = simd_shuffle_xor(v, ushort(5));
  float dn = simd_shuffle_down(v, ushort(1));
  float r = negate_out ? -1.0f : 1.0f;
  out[(base + tid) * 5 + 0] = r * nb;
  out[(base + tid) * 5 + 1] = r * s;
  out[(base + tid) * 5 + 2] = r * m;
  out[(base + tid) * 5 + 3] = r * xr;
  out[(base + tid) * 5 + 4] = r * dn + float(sg) * 0.0f + float(n) * 0.0f;
  (void)lane;
}

// Planted bug: the last thread writes one element past the end.
[[kernel]] void emu_bug_oob_write(
    device float* out [[buffer(0)]],
    uint gid [[thread_position_in_grid]]) {
  out[gid + 1] = 1.0f;
}

// Planted bug: only half the threads reach the barrier.
[[kernel]] void emu_bug_missing_barrier(
    device float* out [[buffer(0)]],
    uint tid [[thread_index_in_threadgroup]]) {
  threadgroup float shared[64];
  if (tid < 32) {
    shared[tid] = 1.0f;
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
  out[tid] = tid < 32 ? shared[tid] : 0.0f;
}

// Planted bug: reads threadgroup memory nothing wrote (poisoned: NaN).
[[kernel]] void emu_bug_uninitialized_threadgroup(
    device float* out [[buffer(0)]],
    uint tid [[thread_index_in_threadgroup]]) {
  threadgroup float shared[64];
  if (tid < 32) shared[tid] = 2.0f;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  out[tid] = shared[(tid + 16) % 64];
}

// Planted bug: a simd reduction inside divergent control flow.
[[kernel]] void emu_bug_divergent_simd(
    device float* out [[buffer(0)]],
    uint lane [[thread_index_in_simdgroup]]) {
  float v = 1.0f;
  if (lane < 16) v = simd_sum(v);
  out[lane] = v;
}

// Planted bug: reads an optional buffer whose function constant is false.
[[kernel]] void emu_bug_absent_optional(
    device float* out [[buffer(0)]],
    const device float* opt [[buffer(1), function_constant(negate_out)]],
    uint tid [[thread_position_in_grid]]) {
  out[tid] = opt[tid];
}

template [[host_name("emu_mma_f32")]] [[kernel]] decltype(emu_mma<float>) emu_mma<float>;
template [[host_name("emu_mma_bf16")]] [[kernel]] decltype(emu_mma<bfloat>) emu_mma<bfloat>;
template [[host_name("emu_mma_f16")]] [[kernel]] decltype(emu_mma<half>) emu_mma<half>;
