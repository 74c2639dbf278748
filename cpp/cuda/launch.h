// Internal launchers shared between the kernel translation units (not API).
#pragma once

#include <cuda_runtime_api.h>

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

// The warp-specialised Hopper kernels (bf16/f16; sm_90a builds on a
// compute-capability-9.0 GPU; kernel_choice.h says which problems each
// takes). cudaErrorNotSupported where they do not apply: callers then use
// the mma.sync kernels.
cudaError_t launch_fwd_hopper(const KParams& p, DType dtype, cudaStream_t stream);
cudaError_t launch_bwd_hopper(const KParams& p, DType dtype, bool atomic_dq,
                              cudaStream_t stream);

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
