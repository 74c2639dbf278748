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

// ---- Threadgroup-memory tracking and the race detector ----

// Planted race: every thread writes its slot, then reads another simdgroup's
// slot with no threadgroup_barrier in between.
[[kernel]] void emu_race_missing_barrier(
    device float* out [[buffer(0)]],
    uint tid [[thread_index_in_threadgroup]]) {
  threadgroup float partial[64];
  partial[tid] = float(tid);
  out[tid] = partial[(tid + 32) % 64];
}

// Lanes of one simdgroup exchange through threadgroup memory. mode 0: no
// barrier (a planted race); 1: simdgroup_barrier(mem_threadgroup); 2:
// simdgroup_barrier(mem_none), which orders no memory (still a race); 3:
// threadgroup_barrier(mem_threadgroup).
[[kernel]] void emu_simd_exchange(
    device float* out [[buffer(0)]],
    constant uint& mode [[buffer(1)]],
    uint lane [[thread_index_in_simdgroup]]) {
  threadgroup float slots[32];
  slots[lane] = float(lane) * 2.0f;
  if (mode == 1) simdgroup_barrier(mem_flags::mem_threadgroup);
  if (mode == 2) simdgroup_barrier(mem_flags::mem_none);
  if (mode == 3) threadgroup_barrier(mem_flags::mem_threadgroup);
  out[lane] = slots[lane ^ 1];
}

// Planted bug: a write one row past the end of a threadgroup tile.
[[kernel]] void emu_bug_tg_out_of_bounds(
    device float* out [[buffer(0)]],
    uint tid [[thread_index_in_threadgroup]]) {
  threadgroup float tile[4][32];
  tile[tid / 32 + 1][tid % 32] = 1.0f;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  out[tid] = tile[0][tid % 32];
}

// Stages a 16x32 row-major tile through threadgroup memory the way the
// attention kernels do: vectorised stores through a cast threadgroup
// pointer, a helper taking `threadgroup T*`, simdgroup_load/store of 8x8
// fragments from/to threadgroup memory, a threadgroup scalar, a dynamic
// [[threadgroup(0)]] buffer, vector elements' components, a `threadgroup T&`
// and a `const threadgroup T*` parameter. out = (x * 2)^T per 8x8 block,
// out[512] = the sum of 2x, out[513] = the sum of 2x over rows 0 and 8, + 1.
template <typename T>
inline void scale_rows(threadgroup T* rows, int n, float s) {
  for (int i = 0; i < n; ++i) rows[i] = T(float(rows[i]) * s);
}

inline float sum_row(const threadgroup half* row, int n) {
  float s = 0.0f;
  for (int i = 0; i < n; ++i) s += float(row[i]);
  return s;
}

inline void put2(threadgroup float2& slot, float a, float b) {
  slot.x = a;
  slot.y = b;
}

[[kernel]] void emu_tg_staging(
    const device float* x [[buffer(0)]],
    device float* out [[buffer(1)]],
    threadgroup float* scratch [[threadgroup(0)]],
    uint tid [[thread_index_in_threadgroup]],
    uint sg [[simdgroup_index_in_threadgroup]],
    uint lane [[thread_index_in_simdgroup]]) {
  threadgroup half tile[16 * 32];
  threadgroup float total;
  // 64 threads x 8 halves, stored as two 8-byte vectors per thread.
  const device float* src = x + tid * 8;
  threadgroup half4* dst = (threadgroup half4*)(&tile[tid * 8]);
  dst[0] = half4(half(src[0]), half(src[1]), half(src[2]), half(src[3]));
  dst[1] = half4(half(src[4]), half(src[5]), half(src[6]), half(src[7]));
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (tid < 16) scale_rows(&tile[tid * 32], 32, 2.0f);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  // Each simdgroup transposes its 8 rows x 32 columns as four 8x8 blocks.
  for (int blk = 0; blk < 4; ++blk) {
    simdgroup_matrix<float, 8, 8> m;
    simdgroup_load(m, &tile[sg * 8 * 32 + blk * 8], 32, ulong2(0, 0), true);
    simdgroup_store(m, scratch + sg * 256 + blk * 64, 8);
  }
  simdgroup_barrier(mem_flags::mem_threadgroup);
  for (int i = 0; i < 8; ++i) out[sg * 256 + i * 32 + lane] = scratch[sg * 256 + i * 32 + lane];
  if (tid == 0) total = 0.0f;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (tid == 0) {
    for (int i = 0; i < 16 * 32; ++i) total += float(tile[i]);
    out[512] = total;
  }
  threadgroup float2 red[2];
  if (lane == 0) put2(red[sg], sum_row(&tile[sg * 8 * 32], 32), float(sg));
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (tid == 0) out[513] = red[0].x + red[1].x + red[1].y;
}

// Known costs: each lane of each simdgroup reads one float of x at
// x[base + lane * stride] and writes one float to out[base + lane]
// (base = 32 * simdgroup). Two simdgroup MMAs per simdgroup.
[[kernel]] void emu_count_accesses(
    const device float* x [[buffer(0)]],
    device float* out [[buffer(1)]],
    constant uint& stride [[buffer(2)]],
    uint sg [[simdgroup_index_in_threadgroup]],
    uint lane [[thread_index_in_simdgroup]],
    uint3 group [[threadgroup_position_in_grid]]) {
  const uint base = (group.x * 2 + sg) * 32;
  float v = x[base * stride + lane * stride];
  simdgroup_matrix<float, 8, 8> a = make_filled_simdgroup_matrix<float, 8, 8>(v);
  simdgroup_matrix<float, 8, 8> c = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
  simdgroup_multiply_accumulate(c, a, a, c);
  simdgroup_multiply_accumulate(c, a, a, c);
  out[base + lane] = c.thread_elements()[0];
}

// C[64 x 64] = A[64 x K] * B[K x 64] (half in, float out) the way a staged
// kernel works: 4 simdgroups (2 x 2, 32 x 32 each), K in tiles of 16 staged
// in threadgroup memory by all 128 threads, a barrier before overwriting a
// tile and one before reading it, fragments loaded with simdgroup_load.
// omit_barrier = 1 plants a race: no barrier before overwriting a tile that
// other simdgroups may still be reading.
template <typename T>
inline void emu_load_tile(threadgroup T* dst, const device T* src, int ld_src, int rows,
                          int cols, uint tid) {
  for (int i = int(tid) * 4; i < rows * cols; i += 128 * 4) {
    const int r = i / cols, c = i % cols;
    for (int j = 0; j < 4; ++j) dst[r * cols + c + j] = src[r * ld_src + c + j];
  }
}

[[kernel]] void emu_staged_gemm(
    const device half* A [[buffer(0)]],
    const device half* B [[buffer(1)]],
    device float* C [[buffer(2)]],
    constant uint& K [[buffer(3)]],
    constant uint& omit_barrier [[buffer(4)]],
    uint tid [[thread_index_in_threadgroup]],
    uint sg [[simdgroup_index_in_threadgroup]]) {
  threadgroup half As[64 * 16];
  threadgroup half Bs[16 * 64];
  const int sm = int(sg / 2) * 32, sn = int(sg % 2) * 32;
  simdgroup_matrix<float, 8, 8> acc[4][4];
#pragma clang loop unroll(full)
  for (int i = 0; i < 4; ++i) {
#pragma clang loop unroll(full)
    for (int j = 0; j < 4; ++j) acc[i][j] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
  }
  for (int k0 = 0; k0 < int(K); k0 += 16) {
    if (omit_barrier == 0) threadgroup_barrier(mem_flags::mem_threadgroup);
    emu_load_tile(As, A + k0, int(K), 64, 16, tid);
    emu_load_tile(Bs, B + k0 * 64, 64, 16, 64, tid);
    threadgroup_barrier(mem_flags::mem_threadgroup);
    for (int kk = 0; kk < 16; kk += 8) {
      simdgroup_matrix<float, 8, 8> a[4], b[4];
#pragma clang loop unroll(full)
      for (int i = 0; i < 4; ++i) simdgroup_load(a[i], &As[(sm + i * 8) * 16 + kk], 16);
#pragma clang loop unroll(full)
      for (int j = 0; j < 4; ++j) simdgroup_load(b[j], &Bs[kk * 64 + sn + j * 8], 64);
#pragma clang loop unroll(full)
      for (int i = 0; i < 4; ++i) {
#pragma clang loop unroll(full)
        for (int j = 0; j < 4; ++j) simdgroup_multiply_accumulate(acc[i][j], a[i], b[j], acc[i][j]);
      }
    }
  }
#pragma clang loop unroll(full)
  for (int i = 0; i < 4; ++i) {
#pragma clang loop unroll(full)
    for (int j = 0; j < 4; ++j) simdgroup_store(acc[i][j], C + (sm + i * 8) * 64 + sn + j * 8, 64);
  }
}

template [[host_name("emu_mma_f32")]] [[kernel]] decltype(emu_mma<float>) emu_mma<float>;
template [[host_name("emu_mma_bf16")]] [[kernel]] decltype(emu_mma<bfloat>) emu_mma<bfloat>;
template [[host_name("emu_mma_f16")]] [[kernel]] decltype(emu_mma<half>) emu_mma<half>;
