// Hopper (sm_90a) tensor-core primitives: wgmma operand layouts and fences
// (internal). Used only by the hopper_*.cu kernels, whose bodies compile for
// sm_90a alone.
//
// Shared-memory operand layout ("SW128 tile"): a [R][C] tile of 16-bit
// elements (C a multiple of 64, R a multiple of 8) is stored as C / 64
// column blocks of [R][64]; each row of a block is 128 bytes whose 16-byte
// chunks are XOR-swizzled by (row % 8). This is the canonical 128-byte-swizzle
// layout wgmma reads through a matrix descriptor, and it is conflict-free for
// the cp.async writes that fill it. Tiles start on 1024-byte boundaries (one
// swizzle atom: 8 rows x 128 bytes).
//
// An operand is "K-major" when its reduction (K) dimension runs along the
// tile's columns (Q, K, V as [seq][head_dim] feeding Q Kᵀ), and "MN-major"
// when K runs along the rows (V as [keys][head_dim] feeding P V).
#pragma once

#include "cuda/common.cuh"

namespace fatrain::cuda {

// Byte offset of element (row, col) in a SW128 tile of R rows.
template <int R>
__device__ __forceinline__ uint32_t sw128_offset(int row, int col) {
  return static_cast<uint32_t>((col >> 6) * (R * 128) + row * 128 +
                               ((((col & 63) >> 3) ^ (row & 7)) << 4) + (col & 7) * 2);
}

// Copies rows [r0, r0 + ROWS) of a [*, C] 16-bit sequence slice into a SW128
// tile by cp.async; rows >= rmax are zero-filled. The reference layout that
// tools/tma_check.cu and tools/wgmma_layout_check.cu hold the TMA copies and
// wgmma descriptors to.
template <int ROWS, int C, int NT>
__device__ __forceinline__ void load_tile_sw128(uint32_t tile, const uint16_t* base,
                                                int64_t row_stride, int r0, int rmax, int tid) {
  constexpr int kChunks = ROWS * C / 8;
#pragma unroll
  for (int c = tid; c < kChunks; c += NT) {
    const int r = c / (C / 8), col = (c % (C / 8)) * 8;
    const int row = r0 + r;
    const bool ok = row < rmax;
    const uint16_t* src = ok ? base + static_cast<int64_t>(row) * row_stride + col : base;
    cp_async16(tile + sw128_offset<ROWS>(r, col), src, ok);
  }
}

// wgmma matrix descriptor for a SW128 operand starting at shared address
// `addr` + `offset`. lead / stride: the byte offsets the descriptor calls
// leading and stride dimension offsets. The start address is a 14-bit field
// of 16-byte units in the low word, taken from the address's low 18 bits (a
// block of a thread-block cluster sees its own shared memory at an address
// with its rank in higher bits). Every address in a block's shared memory
// (under 256 KB) fits, so adding offset / 16 to the low word never carries
// out of the field. The callers pass the run-time part of an operand's
// address as addr and the compile-time part (a product's reduction step) as
// offset: the word built from addr is then common to all reduction steps of
// the product, and each step's descriptor costs one add, not the mask, shift
// and or of a descriptor built from scratch (about a dozen integer
// instructions per wgmma of two shared-memory operands).
__device__ __forceinline__ uint64_t sw128_desc(uint32_t addr, uint32_t lead, uint32_t stride,
                                               uint32_t offset = 0) {
  const uint32_t lo =
      (((addr & 0x3FFFF) >> 4) | (((lead >> 4) & 0x3FFF) << 16)) + (offset >> 4);
  const uint32_t hi = ((stride >> 4) & 0x3FFF) | (1u << 30);  // bit 62: 128-byte swizzle
  return (static_cast<uint64_t>(hi) << 32) | lo;
}

// A product's reduction steps from one descriptor: the descriptor of step 0
// (desc_k_major / desc_mn_major with kk = 0, or any SW128 descriptor) moved
// on by `units` x 16 bytes, added to the low word alone (it never carries out
// of the start-address field: see sw128_desc). With the step-0 descriptor
// kept in uniform registers across a tile loop, a step costs one add; a slot
// of a multi-stage ring likewise (units = slot x slot bytes / 16: in 16-byte
// units, so that no mask of a shifted byte offset is needed).
__device__ __forceinline__ uint64_t desc_advance(uint64_t d, uint32_t units) {
  return (d & 0xffffffff00000000ull) | static_cast<uint32_t>(static_cast<uint32_t>(d) + units);
}
// The byte offsets of reduction step kk in a K-major tile of R rows and in an
// MN-major one (what desc_k_major and desc_mn_major add for kk).
template <int R>
__device__ __forceinline__ constexpr uint32_t k_major_step(int kk) {
  return static_cast<uint32_t>(((kk * 16) >> 6) * (R * 128) + ((kk * 16) & 63) * 2);
}
__device__ __forceinline__ constexpr uint32_t mn_major_step(int kk) {
  return static_cast<uint32_t>(kk * 16 * 128);
}

// How desc_k_major and desc_mn_major build a product's descriptors:
// kHoisted passes the reduction step's part of the address as sw128_desc's
// offset (one add per wgmma; every kernel but one); kPerStep builds each
// step's descriptor from its whole address, as bwd_ws_cluster_pair_kernel
// does: there the hoisted form measured 7.5% slower (docs/cuda.md).
enum class DescBuild : int { kHoisted, kPerStep };

// K-major operand: rows [row0, row0 + 64 or N) of a SW128 tile of R rows,
// reduction columns [16 kk, 16 kk + 16). Rows step by 8 every 1024 bytes; the
// 16 columns sit inside one 128-byte row (the leading offset is unused).
template <int R, DescBuild B = DescBuild::kHoisted>
__device__ __forceinline__ uint64_t desc_k_major(uint32_t tile, int row0, int kk) {
  const uint32_t step = k_major_step<R>(kk);
  return B == DescBuild::kHoisted ? sw128_desc(tile + row0 * 128, 16, 1024, step)
                                  : sw128_desc(tile + row0 * 128 + step, 16, 1024);
}

// MN-major operand: reduction rows [16 kk, 16 kk + 16) of a SW128 tile of R
// rows, MN columns from col0 on (a multiple of 64, or 32 inside a block).
// Column blocks of 64 are R * 128 bytes apart, groups of 8 rows 1024.
template <int R, DescBuild B = DescBuild::kHoisted>
__device__ __forceinline__ uint64_t desc_mn_major(uint32_t tile, int col0, int kk) {
  const uint32_t base = tile + (col0 >> 6) * (R * 128) + (col0 & 63) * 2;
  return B == DescBuild::kHoisted ? sw128_desc(base, R * 128, 1024, mn_major_step(kk))
                                  : sw128_desc(base + mn_major_step(kk), R * 128, 1024);
}

template <class E, int N> struct Wgmma;
#include "cuda/wgmma_ops.inc"

// The calling thread's warp in its block (threadIdx.x / 32), read from lane
// 0 so that the compiler knows every lane of the warp holds the same value:
// what the warp-specialised kernels compute from it (a warpgroup's keys and
// tile addresses, hence its wgmma descriptors) can then stay in uniform
// registers instead of being moved there (R2UR) before every wgmma.
__device__ __forceinline__ int warp_index_uniform() {
  return __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x >> 5), 0);
}

// A value every lane of the warp holds, read from lane 0 like
// warp_index_uniform: ptxas then keeps it in a uniform register where it
// would otherwise rebuild it from its inputs at each use (a wgmma
// descriptor from the shared-memory base, say).
__device__ __forceinline__ uint64_t uniform_value(uint64_t v) {
  return __shfl_sync(0xffffffffu, static_cast<unsigned long long>(v), 0);
}

// Orders register accesses around asynchronous wgmma: the compiler must not
// move reads or writes of accumulators across a fence or a wait.
template <int N>
__device__ __forceinline__ void fence_regs(float (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i])::"memory");
}
template <int N>
__device__ __forceinline__ void fence_regs(uint32_t (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+r"(r[i])::"memory");
}

__device__ __forceinline__ void wgmma_fence() {
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void wgmma_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Shared memory written by ordinary stores or cp.async and read next by wgmma
// (the async proxy) needs this in each writing thread before the barrier.
__device__ __forceinline__ void fence_proxy_async() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// Accumulator layout of a 64 x N wgmma (float d[N / 2] per thread): warp w of
// the warpgroup owns rows 16 w .. 16 w + 15; d[4 j + e] sits at row
// 16 w + lane / 4 + 8 (e / 2), column 8 j + 2 (lane % 4) + e % 2 (the
// mma.sync m16n8 layout, repeated every 8 columns).
__device__ __forceinline__ int acc_row(int warp_in_group, int lane, int e) {
  return warp_in_group * 16 + (lane >> 2) + (e >> 1) * 8;
}
__device__ __forceinline__ int acc_col(int j, int lane, int e) {
  return j * 8 + (lane & 3) * 2 + (e & 1);
}

// Sets to `hidden` the elements of a 64 x N accumulator whose column lies
// outside its row's interval [cols[r].x, cols[r].y): r = 0 for this thread's
// row lane / 4 (e < 2), r = 1 for lane / 4 + 8, both counted from this
// thread's first column, acc_col(0, lane, 0). So each element costs two
// compares against a compile-time offset. The softmax loops use this for
// lengths, causality and windows (HeadMask::row_keys, key_queries).
template <int N>
__device__ __forceinline__ void hide_outside_intervals(float (&d)[N / 2], const int2 (&cols)[2],
                                                       int lane, float hidden) {
#pragma unroll
  for (int j = 0; j < N / 8; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int c = acc_col(j, lane, e) - acc_col(0, lane, 0);  // a compile-time offset
      const int2 k = cols[e >> 1];
      if (c < k.x || c >= k.y) d[4 * j + e] = hidden;
    }
  }
}

// Stores four 8 x 8 16-bit matrices transposed (stmatrix .trans). Register
// rm holds matrix m as an accumulator-layout pair (row lane / 4, columns
// 2 (lane % 4) and + 1); row r of the transposed matrix m, that is column r
// of the one given, lands as 16 contiguous bytes at the shared address lane
// 8 m + r passes.
__device__ __forceinline__ void stmatrix_x4_trans(uint32_t addr, uint32_t r0, uint32_t r1,
                                                  uint32_t r2, uint32_t r3) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};\n"
               ::"r"(addr), "r"(r0), "r"(r1), "r"(r2), "r"(r3)
               : "memory");
}

// A-operand registers for reduction step kk (columns 16 kk..16 kk + 15) taken
// from a 64 x N float accumulator: the A fragment layout is the accumulator's,
// so P = softmax(S) feeds the next wgmma without touching shared memory.
template <class E, int R>
__device__ __forceinline__ void acc_to_a(const float (&d)[R], int kk, uint32_t (&a)[4]) {
  a[0] = Cvt<E>::pack(d[8 * kk + 0], d[8 * kk + 1]);
  a[1] = Cvt<E>::pack(d[8 * kk + 2], d[8 * kk + 3]);
  a[2] = Cvt<E>::pack(d[8 * kk + 4], d[8 * kk + 5]);
  a[3] = Cvt<E>::pack(d[8 * kk + 6], d[8 * kk + 7]);
}

}  // namespace fatrain::cuda
