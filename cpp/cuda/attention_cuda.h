// Framework-free FlashAttention-2 training kernels for NVIDIA GPUs.
//
// Nothing in cpp/cuda/ knows about XLA, JAX or Python: the FFI layer
// (cpp/ffi/cuda_ffi.cc) translates XLA buffers into the plain structs below.
// The structs mirror cpu/attention_cpu.h; every pointer here is a device
// pointer (lengths included) and every entry point only enqueues work on the
// given stream.
//
// Conventions (DESIGN.md §4): S = scale * Q Kᵀ in float32, bias added after
// scaling, boolean mask / causal (top-left) / window / lengths remove scores,
// L in natural log float32 [B, Nq, T], a row with no visible key has O = 0,
// L = -inf and zero gradients.
//
// Paths:
//  * bf16 / f16 with head_dim 64, 128 or 256 (16-byte aligned operands): tensor
//    cores (mma.sync m16n8k16 + ldmatrix + cp.async), FA-2 tiling, float32
//    accumulation, online softmax in base 2.
//  * everything else (float32 operands, other head dims): a plain float32
//    SIMT path (one warp per row), exact to float32 rounding, slow.
//  * backward: D = rowsum(dO∘O) pre-kernel; KV-tile-outer kernel with dK/dV
//    in registers looping over the GQA group. dQ either by float32 atomics into
//    scratch (default, nondeterministic in the last bits when more than one KV
//    tile contributes) or, with `deterministic`, by a separate Q-tile-outer
//    kernel (bitwise reproducible).
//  * the bias gradient is a separate deterministic kernel (float32 out).
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_runtime_api.h>

namespace fatrain::cuda {

enum class DType : int32_t { kF32 = 0, kBF16 = 1, kF16 = 2, kBool = 3, kI32 = 4 };

// [batch, seq, head, head_dim]; head_dim contiguous, other strides in elements.
struct SeqTensor {
  void* data = nullptr;
  DType dtype = DType::kF32;
  int64_t batch_stride = 0;
  int64_t seq_stride = 0;
  int64_t head_stride = 0;
};

// [B, N, T, S]-broadcastable tensor; stride 0 on broadcast dims.
struct ScoreTensor {
  const void* data = nullptr;  // nullptr: absent
  DType dtype = DType::kF32;   // bias: f32/bf16/f16; mask: kBool
  int64_t dims[4] = {1, 1, 1, 1};
  int64_t strides[4] = {0, 0, 0, 0};
};

struct AttentionProblem {
  int64_t batch = 0;
  int64_t q_heads = 0;
  int64_t kv_heads = 0;
  int64_t q_len = 0;
  int64_t kv_len = 0;
  int64_t head_dim = 0;
  float scale = 1.0f;
  bool causal = false;
  int64_t window_left = -1;
  int64_t window_right = -1;
  const int32_t* q_lengths = nullptr;   // device [B] or nullptr
  const int32_t* kv_lengths = nullptr;  // device [B] or nullptr
  ScoreTensor bias;
  ScoreTensor mask;
};

constexpr int64_t kMaxHeadDim = 256;

struct ForwardOperands {
  SeqTensor q, k, v;
  SeqTensor o;
  float* lse = nullptr;  // [B, Nq, T]
};

struct BackwardOperands {
  SeqTensor q, k, v, o, d_o;
  const float* lse = nullptr;
  SeqTensor dq, dk, dv;
};

struct BiasGradOperands {
  SeqTensor q, k, v, o, d_o;
  const float* lse = nullptr;
  float* dbias = nullptr;  // float32, contiguous, shape problem.bias.dims
};

// nullptr when well formed, else a message naming the field.
const char* validate_problem(const AttentionProblem& problem);

// Device scratch (bytes) each entry point needs; the caller passes at least
// that much, 256-byte aligned.
size_t forward_scratch_bytes(const AttentionProblem& problem);
size_t backward_scratch_bytes(const AttentionProblem& problem, bool deterministic);
size_t bias_grad_scratch_bytes(const AttentionProblem& problem);

// Enqueue on `stream`. Return nullptr on success or a message (validation or
// the CUDA launch error string).
const char* attention_forward(const AttentionProblem& problem,
                              const ForwardOperands& operands, void* scratch,
                              cudaStream_t stream);
const char* attention_backward(const AttentionProblem& problem,
                               const BackwardOperands& operands, bool deterministic,
                               void* scratch, cudaStream_t stream);
const char* attention_bias_grad(const AttentionProblem& problem,
                                const BiasGradOperands& operands, void* scratch,
                                cudaStream_t stream);

// Which path a problem takes ("tensor_core" or "simt"), for tests/benchmarks.
const char* selected_path(const AttentionProblem& problem, DType dtype);

}  // namespace fatrain::cuda
