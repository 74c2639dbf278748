// Internal launchers shared between the kernel translation units (not API).
#pragma once

#include <cuda_runtime_api.h>

#include "cuda/attention_cuda.h"

namespace fatrain::cuda {

struct KParams;

// Tensor-core path (bf16/f16, head_dim 64/128/256).
cudaError_t launch_fwd_tc(const KParams& p, DType dtype, cudaStream_t stream);
cudaError_t launch_bwd_tc(const KParams& p, DType dtype, bool atomic_dq, cudaStream_t stream);
cudaError_t launch_dq_tc(const KParams& p, DType dtype, cudaStream_t stream);
cudaError_t launch_dq_convert(const KParams& p, DType dtype, cudaStream_t stream);

// SIMT float32-accumulating path (any dtype, head_dim <= 256).
cudaError_t launch_dsum(const KParams& p, DType dtype, cudaStream_t stream);
cudaError_t launch_fwd_simt(const KParams& p, DType dtype, cudaStream_t stream);
cudaError_t launch_bwd_simt(const KParams& p, DType dtype, cudaStream_t stream);
cudaError_t launch_dbias_simt(const KParams& p, DType dtype, int64_t elements,
                              cudaStream_t stream);

}  // namespace fatrain::cuda
