// Internal launchers shared between the kernel translation units (not API).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdlib>
#include <string_view>

#include "cuda/attention_cuda.h"

namespace fatrain::cuda {

struct KParams;

// Raises `kernel`'s dynamic shared-memory limit to `smem_bytes` on the
// current device. Returns cudaErrorNotSupported when the device cannot give
// one block that much (the D = 256 backward needs 209 KB; an A100 allows
// 163 KB): callers then fall back to the SIMT kernels. Called before every
// launch because the limit belongs to each device's context: set once per
// process, it would hold only on the first GPU of a multi-GPU process.
template <class... Params>
cudaError_t allow_smem(void (*kernel)(Params...), int smem_bytes) {
  int device = 0, optin = 0;
  if (cudaError_t e = cudaGetDevice(&device); e != cudaSuccess) return e;
  if (cudaError_t e =
          cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
      e != cudaSuccess)
    return e;
  if (smem_bytes > optin) return cudaErrorNotSupported;
  return cudaFuncSetAttribute(reinterpret_cast<const void*>(kernel),
                              cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes);
}
// Notes `kernel` in the launch record when recording is on
// (attention_cuda.h, set_launch_recording). Every launcher calls it right
// after its launch.
void record_launch(const void* kernel);
template <class... Params>
void record_launch(void (*kernel)(Params...)) {
  record_launch(reinterpret_cast<const void*>(kernel));
}

// Launches a tensor-core kernel with `smem_bytes` of dynamic shared memory
// on the current device; allow_smem's errors return before anything is
// launched.
template <class... Params>
cudaError_t launch_with_smem(void (*kernel)(Params...), dim3 grid, int threads, int smem_bytes,
                             cudaStream_t stream, const Params&... params) {
  if (cudaError_t e = allow_smem(kernel, smem_bytes); e != cudaSuccess) return e;
  kernel<<<grid, threads, smem_bytes, stream>>>(params...);
  record_launch(kernel);
  return cudaGetLastError();
}

// Whether `kernel` will run machine code built for sm_90a on the current
// device. The wgmma kernels compile to an empty body for every other target,
// which must never run. The loaded code tells two cases apart (measured on an
// H200: sm_90a machine code reports binary and PTX version 90; compute_80 PTX
// compiled by the driver reports binary 90, PTX 80), but not sm_90a from plain
// sm_90 (both 90/90): that comes from the build, where cmake/cuda.cmake
// defines JAX_FATRAIN_CUDA_SM90A only when the gencode list has sm_90a.
template <class... Params>
bool has_sm90a_code(void (*kernel)(Params...)) {
#if defined(JAX_FATRAIN_CUDA_SM90A)
  cudaFuncAttributes attr;
  if (cudaFuncGetAttributes(&attr, reinterpret_cast<const void*>(kernel)) != cudaSuccess) {
    cudaGetLastError();  // clear it: the fallback launch reports its own errors
    return false;
  }
  return attr.binaryVersion == 90 && attr.ptxVersion == 90;
#else
  (void)kernel;
  return false;
#endif
}

// Whether environment variable `name` is set to exactly `value`: the kernel
// switches below read it on every launch, so that tests can flip them.
inline bool env_is(const char* name, std::string_view value) {
  const char* v = std::getenv(name);
  return v != nullptr && std::string_view(v) == value;
}

// Whether the Hopper wgmma kernels may be used: JAX_FATRAIN_CUDA_KERNELS=mma_sync
// selects the sm_80 kernels on a Hopper GPU too (for comparing the two).
inline bool wgmma_allowed() { return !env_is("JAX_FATRAIN_CUDA_KERNELS", "mma_sync"); }

// A tuning knob: the integer value of environment variable `name`, read once
// per call site (callers cache it), 0 when unset.
inline int env_tuning_choice(const char* name) {
  const char* v = std::getenv(name);
  return v ? std::atoi(v) : 0;
}

// Hopper wgmma path (bf16/f16; sm_90a builds on a compute-capability-9.0
// GPU; hopper_*.cu say which head dims and problems each covers).
// cudaErrorNotSupported where it does not apply: callers then use the
// mma.sync kernels.
cudaError_t launch_fwd_wgmma(const KParams& p, DType dtype, cudaStream_t stream);
// The warp-specialised variant (hopper_fwd_ws.cu: a TMA producer warpgroup and
// two consumer warpgroups taking turns on the tensor cores).
cudaError_t launch_fwd_wgmma_ws(const KParams& p, DType dtype, cudaStream_t stream);
// Which Hopper forward runs: the warp-specialised kernel, which measured
// faster at every head dim, masked or not (docs/cuda.md), unless
// JAX_FATRAIN_CUDA_HOPPER_FWD=cp_async asks for the other one for every
// problem (read on every launch so that tests can switch it).
inline bool hopper_fwd_use_ws() { return !env_is("JAX_FATRAIN_CUDA_HOPPER_FWD", "cp_async"); }
// Consumer warpgroups of the warp-specialised forward at head dim 64 without
// a mask or bias: JAX_FATRAIN_CUDA_HOPPER_FWD_CONSUMERS=2 or 3 forces two or
// three (read on every launch so that tests can switch it); 0, when unset:
// hopper_fwd_ws.cu decides (three_consumers_pay).
inline int hopper_fwd_consumers_forced() {
  if (env_is("JAX_FATRAIN_CUDA_HOPPER_FWD_CONSUMERS", "2")) return 2;
  if (env_is("JAX_FATRAIN_CUDA_HOPPER_FWD_CONSUMERS", "3")) return 3;
  return 0;
}
cudaError_t launch_bwd_wgmma(const KParams& p, DType dtype, bool atomic_dq, cudaStream_t stream);
// The warp-specialised backward (hopper_bwd_ws.cu: a TMA producer warp and two
// consumer warpgroups that never meet at a block-wide barrier; head dims 64,
// 128 and 256 without a mask or bias, and a staged mask or bias at 64 and 128,
// else cudaErrorNotSupported).
cudaError_t launch_bwd_wgmma_ws(const KParams& p, DType dtype, bool atomic_dq,
                                cudaStream_t stream);
// Which Hopper backward runs where both apply: the warp-specialised kernel,
// unless JAX_FATRAIN_CUDA_HOPPER_BWD=cp_async asks for hopper_bwd.cu (read on
// every launch so that tests can switch it).
inline bool hopper_bwd_use_ws() { return !env_is("JAX_FATRAIN_CUDA_HOPPER_BWD", "cp_async"); }
// Query rows per step of the warp-specialised backward at head dim 64
// without a mask or bias: 128, unless JAX_FATRAIN_CUDA_HOPPER_BWD_ROWS=64 asks
// for the 64-row steps every other problem takes (read on every launch so
// that tests can switch it). A 64-row step's products and waits are too
// small to keep the tensor cores busy at D = 64 (docs/cuda.md).
inline int hopper_bwd_query_rows() {
  return env_is("JAX_FATRAIN_CUDA_HOPPER_BWD_ROWS", "64") ? 64 : 128;
}

// The order in which a warp-specialised backward's key block walks its
// query steps (hopper_bwd_common.cuh, StepOrder): tile by tile from the last
// tile down, every head of the GQA group at each tile, unless
// JAX_FATRAIN_CUDA_HOPPER_BWD_ORDER=heads_outer asks for head by head, tiles
// up (read on every launch so that tests can switch it). Why tiles first:
// the blocks of one KV head then read the same Q and dO tiles at the same
// time, which raises the L2 hit rate (docs/cuda.md).
inline bool hopper_bwd_tiles_outer() {
  return !env_is("JAX_FATRAIN_CUDA_HOPPER_BWD_ORDER", "heads_outer");
}

// Which warp-specialised backward runs at head dim 256 without a mask or
// bias. In the atomic mode bwd_ws_cluster_pair_kernel (two blocks per key
// block, one cluster, splitting the score products), unless
// JAX_FATRAIN_CUDA_HOPPER_BWD_D256 is split_head or shared_keys; in the
// deterministic mode (and where no cluster fits) bwd_ws_split_head_kernel
// (each block one half of the head dim of 128 keys), unless it is
// shared_keys: bwd_ws_d256_kernel (both consumers share 64 keys). Read on
// every launch so that tests can switch it.
// Fastest first: cluster pair, split head, shared keys (docs/cuda.md).
inline bool hopper_bwd_d256_cluster_pair() {
  return !env_is("JAX_FATRAIN_CUDA_HOPPER_BWD_D256", "split_head") &&
         !env_is("JAX_FATRAIN_CUDA_HOPPER_BWD_D256", "shared_keys");
}
// Whether bwd_ws_cluster_pair_kernel folds a causal problem's key blocks
// (each cluster does key blocks m and nkb - 1 - m, launch_cluster_pair),
// unless JAX_FATRAIN_CUDA_HOPPER_BWD_D256_FOLD=off (read on every launch so
// that tests can switch it). Why: a causal key block's work falls with its
// index, so one cluster per key block leaves SMs idle at the end; folding
// pays most where key blocks are few (docs/cuda.md).
inline bool hopper_bwd_d256_fold_causal() {
  return !env_is("JAX_FATRAIN_CUDA_HOPPER_BWD_D256_FOLD", "off");
}
// Whether bwd_ws_kernel (head dims 64 and 128) folds a causal problem's key
// blocks the same way (block m does key blocks nkb - 1 - m and m,
// hopper_bwd_ws.cu's launch), unless JAX_FATRAIN_CUDA_HOPPER_BWD_FOLD=off
// (read on every launch so that tests can switch it). Why: key block j's
// work falls linearly with j, so one block per key block leaves the last
// wave with idle SMs; folding pays most at short sequences (docs/cuda.md).
inline bool hopper_bwd_fold_causal() { return !env_is("JAX_FATRAIN_CUDA_HOPPER_BWD_FOLD", "off"); }
inline bool hopper_bwd_d256_split_head() {
  return !env_is("JAX_FATRAIN_CUDA_HOPPER_BWD_D256", "shared_keys");
}

// How bwd_ws_d256_kernel (JAX_FATRAIN_CUDA_HOPPER_BWD_D256=shared_keys) adds
// dQ in the atomic mode: by tensor reductions staged in the step's Q/dO slot
// (hopper_bwd_ws.cu, REDUCE_DQ), unless
// JAX_FATRAIN_CUDA_HOPPER_BWD_D256_DQ=atomics asks for float2 atomics (read
// on every launch so that tests can switch it). The atomics' REDG
// instructions are that kernel's top stall; the tensor reductions are faster
// (docs/cuda.md).
inline bool hopper_bwd_d256_dq_by_tensor_reduce() {
  return !env_is("JAX_FATRAIN_CUDA_HOPPER_BWD_D256_DQ", "atomics");
}

// Tensor-core path (bf16/f16, head_dim 64/128/256). cudaErrorNotSupported:
// see launch_with_smem.
cudaError_t launch_fwd_tc(const KParams& p, DType dtype, cudaStream_t stream);
cudaError_t launch_bwd_tc(const KParams& p, DType dtype, bool atomic_dq, cudaStream_t stream);
cudaError_t launch_dq_tc(const KParams& p, DType dtype, cudaStream_t stream);
cudaError_t launch_dq_convert(const KParams& p, DType dtype, cudaStream_t stream);

// Segment ids: the tables of KParams (q_seg_meet, kv_seg_meet) in `scratch`
// (segment_table_bytes of it, 256-byte aligned), built on `stream`; sets the
// table pointers of *p. Needs p->q_seg and p->kv_seg.
size_t segment_table_bytes(const AttentionProblem& problem);
cudaError_t launch_segment_tables(KParams* p, void* scratch, cudaStream_t stream);

// SIMT float32-accumulating path (any dtype, head_dim <= 256).
cudaError_t launch_dsum(const KParams& p, DType dtype, cudaStream_t stream);
cudaError_t launch_fwd_simt(const KParams& p, DType dtype, cudaStream_t stream);
cudaError_t launch_bwd_simt(const KParams& p, DType dtype, cudaStream_t stream);
cudaError_t launch_dbias_simt(const KParams& p, DType dtype, int64_t elements,
                              cudaStream_t stream);

}  // namespace fatrain::cuda
