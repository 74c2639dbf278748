// Hopper (sm_90) bulk tensor copies (TMA) and mbarriers (internal).
//
// tools/tma_check.cu checks them on their own (on an H200: every case equal to
// the cp.async tile, byte for byte); hopper_fwd_ws.cu and hopper_bwd_ws.cu
// use them. A producer-warp pipeline: one thread issues a TMA load of a tile
// into shared memory, the load completes on an mbarrier by transaction bytes,
// consumer warpgroups wait on that mbarrier's phase. TMA writes through the
// async proxy, which wgmma reads too, so no proxy fence is needed between them
// (unlike cp.async tiles).
//
// Tensor maps describe one 16-bit [B][T][N][D] operand as a 4-D tensor
// {D, T, N, B} (innermost first) with boxes of {64, ROWS, 1, 1}: 64 elements
// = 128 bytes, the 128-byte swizzle span, so a box lands exactly as one column
// block of a SW128 tile (wgmma.cuh); D > 64 takes D / 64 loads. The float32
// dQ scratch [B][N][T][D] is reduced into in boxes of {32, 16, 1, 1}
// (make_dq_acc_tensor_map, tma_reduce_add_4d).
#pragma once

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace fatrain::cuda {

// ---- host ------------------------------------------------------------------

// The driver's cuTensorMapEncodeTiled, looked up once; nullptr where the
// driver lacks it.
inline PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static PFN_cuTensorMapEncodeTiled_v12000 encode = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult status;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000,
                                         cudaEnableDefault, &status) != cudaSuccess ||
        status != cudaDriverEntryPointSuccess) {
      cudaGetLastError();
      return static_cast<PFN_cuTensorMapEncodeTiled_v12000>(nullptr);
    }
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
  }();
  return encode;
}

// Fills `map` for a 16-bit operand at `base` with element strides
// (seq_stride, head_stride, batch_stride) and dims {d, seq, heads, batch};
// boxes of 64 x `rows`. Rows past `seq` read as zeros. cudaErrorNotSupported
// when the driver lacks cuTensorMapEncodeTiled or the layout does not qualify
// (16-byte aligned base and strides).
inline cudaError_t make_seq_tensor_map(CUtensorMap* map, const void* base, int64_t d,
                                       int64_t seq, int64_t heads, int64_t batch,
                                       int64_t seq_stride, int64_t head_stride,
                                       int64_t batch_stride, int rows) {
  const PFN_cuTensorMapEncodeTiled_v12000 encode = tensor_map_encoder();
  if (encode == nullptr) return cudaErrorNotSupported;
  if (reinterpret_cast<uintptr_t>(base) % 16 != 0) return cudaErrorNotSupported;
  const cuuint64_t dims[4] = {static_cast<cuuint64_t>(d), static_cast<cuuint64_t>(seq),
                              static_cast<cuuint64_t>(heads), static_cast<cuuint64_t>(batch)};
  const cuuint64_t strides[3] = {static_cast<cuuint64_t>(seq_stride) * 2,
                                 static_cast<cuuint64_t>(head_stride) * 2,
                                 static_cast<cuuint64_t>(batch_stride) * 2};
  for (cuuint64_t s : strides)
    if (s % 16 != 0) return cudaErrorNotSupported;
  const cuuint32_t box[4] = {64, static_cast<cuuint32_t>(rows), 1, 1};
  const cuuint32_t elem_strides[4] = {1, 1, 1, 1};
  const CUresult r = encode(map, CU_TENSOR_MAP_DATA_TYPE_UINT16, 4, const_cast<void*>(base), dims,
                            strides, box, elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
                            CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
                            CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return r == CUDA_SUCCESS ? cudaSuccess : cudaErrorInvalidValue;
}

// Fills `map` for the contiguous float32 dQ scratch [batch][heads][seq][d] at
// `base`, as {d, seq, heads, batch} with boxes of box_cols columns x box_rows
// rows: 32 columns (128-byte rows, 128-byte swizzle: dq_box_offset) or 16
// (64-byte rows, 64-byte swizzle: dq_box64_offset); see tma_reduce_add_4d.
// Rows past `seq` are never written.
inline cudaError_t make_dq_acc_tensor_map(CUtensorMap* map, float* base, int64_t d, int64_t seq,
                                          int64_t heads, int64_t batch, int box_rows = 16,
                                          int box_cols = 32) {
  const PFN_cuTensorMapEncodeTiled_v12000 encode = tensor_map_encoder();
  if (encode == nullptr) return cudaErrorNotSupported;
  if (reinterpret_cast<uintptr_t>(base) % 16 != 0 || d % 32 != 0) return cudaErrorNotSupported;
  if (box_cols != 32 && box_cols != 16) return cudaErrorInvalidValue;
  const cuuint64_t dims[4] = {static_cast<cuuint64_t>(d), static_cast<cuuint64_t>(seq),
                              static_cast<cuuint64_t>(heads), static_cast<cuuint64_t>(batch)};
  const cuuint64_t strides[3] = {static_cast<cuuint64_t>(d * 4),
                                 static_cast<cuuint64_t>(seq * d * 4),
                                 static_cast<cuuint64_t>(heads * seq * d * 4)};
  const cuuint32_t box[4] = {static_cast<cuuint32_t>(box_cols), static_cast<cuuint32_t>(box_rows),
                             1, 1};
  const cuuint32_t elem_strides[4] = {1, 1, 1, 1};
  const CUresult r = encode(
      map, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 4, base, dims, strides, box, elem_strides,
      CU_TENSOR_MAP_INTERLEAVE_NONE,
      box_cols == 32 ? CU_TENSOR_MAP_SWIZZLE_128B : CU_TENSOR_MAP_SWIZZLE_64B,
      CU_TENSOR_MAP_L2_PROMOTION_L2_128B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return r == CUDA_SUCCESS ? cudaSuccess : cudaErrorInvalidValue;
}

// ---- device (sm_90) ----------------------------------------------------------

__device__ __forceinline__ void mbar_init(uint32_t bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count));
}
// Makes initialised mbarriers visible to the async proxy (before the
// __syncthreads that publishes them).
__device__ __forceinline__ void fence_mbar_init() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
// Arrives once and adds `bytes` to the transaction count the phase waits for.
__device__ __forceinline__ void mbar_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
// Waits until phase `parity` (0 or 1) of the mbarrier has completed.
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  asm volatile(
      "{\n.reg .pred done;\n"
      "WAIT_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT_%=;\n}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
}

// Arrives once on `bar` when all of this thread's earlier cp.async copies
// have landed (without adding to the arrivals the phase expects: count it in
// the barrier's init). Waiters on the phase then see the copied data.
__device__ __forceinline__ void cp_async_mbar_arrive(uint32_t bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}

// Waits until all of this thread's earlier cp.async copies have landed,
// committed to a group or not.
__device__ __forceinline__ void cp_async_wait_all() {
  asm volatile("cp.async.wait_all;\n" ::: "memory");
}

// One box of `map` at element coordinates (c0 = column, c1 = row, c2 = head,
// c3 = batch) into shared memory at `dst` (1024-byte aligned), completing on
// `bar` with the box's bytes. One thread issues it.
__device__ __forceinline__ void tma_load_4d(uint32_t dst, const CUtensorMap* map, uint32_t bar,
                                            int c0, int c1, int c2, int c3) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%3, %4, %5, %6}], [%2];\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(bar), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
      : "memory");
}

// Adds a float32 box at shared address `src` (a box of the map's shape,
// laid out as dq_box_offset or dq_box64_offset says) to the tensor of `map`
// (make_dq_acc_tensor_map) at element coordinates (c0 = column, c1 = row, c2
// = head, c3 = batch), in L2, through the async proxy; rows outside the
// tensor are skipped. The writes that filled `src` need fence_proxy_async()
// first. Completion is tracked per thread in bulk groups (bulk_commit /
// bulk_wait_read / bulk_wait).
__device__ __forceinline__ void tma_reduce_add_4d(const CUtensorMap* map, uint32_t src, int c0,
                                                  int c1, int c2, int c3) {
  asm volatile(
      "cp.reduce.async.bulk.tensor.4d.global.shared::cta.add.tile.bulk_group"
      " [%0, {%2, %3, %4, %5}], [%1];\n" ::"l"(reinterpret_cast<uint64_t>(map)),
      "r"(src), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
      : "memory");
}
// Byte offset of float (row, col) in such a box: 128-byte rows whose 16-byte
// chunks are XOR-swizzled by row % 8, as the tensor map's 128-byte swizzle
// expects (and conflict-free for accumulator-layout float2 stores).
__device__ __forceinline__ uint32_t dq_box_offset(int row, int col) {
  return static_cast<uint32_t>(row * 128 + (((col >> 2) ^ (row & 7)) << 4) + (col & 3) * 4);
}
// The same in a box of 16 columns (make_dq_acc_tensor_map's box_cols = 16,
// 512-byte aligned): 64-byte rows whose 16-byte chunks are XOR-swizzled by
// (row / 2) % 4, the tensor map's 64-byte swizzle.
__device__ __forceinline__ uint32_t dq_box64_offset(int row, int col) {
  return static_cast<uint32_t>(row * 64 + (((col >> 2) ^ ((row >> 1) & 3)) << 4) + (col & 3) * 4);
}
__device__ __forceinline__ void bulk_commit() {
  asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
}
// Waits until at most N of this thread's bulk groups still read their shared
// memory sources (which may then be overwritten).
template <int N>
__device__ __forceinline__ void bulk_wait_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(N) : "memory");
}
// Waits until at most N of this thread's bulk groups are incomplete.
template <int N>
__device__ __forceinline__ void bulk_wait() {
  asm volatile("cp.async.bulk.wait_group %0;\n" ::"n"(N) : "memory");
}

// ---- Clusters (sm_90): blocks that read and write each other's shared memory ----

// This block's rank in its cluster.
__device__ __forceinline__ uint32_t cluster_rank() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
  return r;
}
// The shared::cluster address of `addr` (a shared::cta address of this
// block) in the shared memory of the cluster's block `rank`: the same offset,
// since every block of a kernel lays its shared memory out alike.
__device__ __forceinline__ uint32_t map_to_rank(uint32_t addr, uint32_t rank) {
  uint32_t r;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(r) : "r"(addr), "r"(rank));
  return r;
}
// Arrives on an mbarrier of another block of the cluster (an address from
// map_to_rank), ordering nothing: for "done reading" signals whose reads are
// complete (their values used, or their wgmma waited for).
__device__ __forceinline__ void mbar_arrive_remote(uint32_t bar) {
  asm volatile("mbarrier.arrive.relaxed.cluster.shared::cluster.b64 _, [%0];\n" ::"r"(bar)
               : "memory");
}
// Arrives on an mbarrier of another block of the cluster and adds `bytes` to
// the transaction count its phase waits for (those of a bulk_copy_to_rank).
__device__ __forceinline__ void mbar_arrive_expect_tx_remote(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.relaxed.cluster.shared::cluster.b64 _, [%0], %1;\n" ::"r"(
                   bar),
               "r"(bytes)
               : "memory");
}
// Copies `bytes` (a multiple of 16) of this block's shared memory at `src`
// to another block's at `dst` (from map_to_rank), through the async proxy,
// completing on that block's mbarrier `bar` (from map_to_rank) with the
// bytes. The writes that filled `src` need fence_proxy_async() first; the
// issuing thread tracks the read of `src` in bulk groups (bulk_commit,
// bulk_wait_read).
__device__ __forceinline__ void bulk_copy_to_rank(uint32_t dst, uint32_t src, uint32_t bytes,
                                                  uint32_t bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.shared::cta.mbarrier::complete_tx::bytes [%0], [%1], %2, "
      "[%3];\n" ::"r"(dst),
      "r"(src), "r"(bytes), "r"(bar)
      : "memory");
}
// Every thread of every block of the cluster (exited threads excepted)
// arrives, then waits for all: a block-wide barrier that also orders the
// blocks' shared memory accesses to each other.
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release;\nbarrier.cluster.wait.acquire;\n" ::: "memory");
}

// Warpgroup-wide register budget changes (sm_90a): a producer warpgroup gives
// registers back, consumer warpgroups take them. Every thread of the
// warpgroup executes it; N is a multiple of 8 in [24, 256].
template <int N>
__device__ __forceinline__ void setmaxnreg_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N));
}
template <int N>
__device__ __forceinline__ void setmaxnreg_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N));
}

// Named barrier `id` (1..15; 0 is __syncthreads) over `threads` threads.
__device__ __forceinline__ void named_bar_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_bar_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

}  // namespace fatrain::cuda
