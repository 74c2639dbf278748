// The description of one attention problem and its operands, shared by every
// framework-free kernel library of jax_fatrain (cpp/cpu, cpp/cuda). Plain
// structs: no XLA, JAX or Python; the FFI layers (cpp/ffi) fill them in.
//
// Conventions (shared by every backend of jax_fatrain, see docs/design.md):
//  * S = scale * Q Kᵀ computed in float32; additive bias added after scaling;
//    boolean mask / causal / window / lengths remove scores.
//  * L (logsumexp) is stored in natural log, float32, layout [B, Nq, T].
//  * A row with no visible key: O = 0, L = -inf, all its gradients are 0.
//  * Backward: D = rowsum(dO ∘ O); P = exp(S + bias - L); dS = P ∘ (dP - D).
#pragma once

#include <cstdint>

namespace fatrain {

// Element types of tensors the kernels read or write.
enum class DType : int32_t { kF32 = 0, kBF16 = 1, kF16 = 2, kBool = 3, kI32 = 4 };

// A [batch, seq, head, head_dim] tensor in memory. head_dim is contiguous;
// the other three axes have arbitrary element strides, so BTNH ([B,T,N,H])
// and BNTH ([B,N,T,H]) layouts are both expressed without a transpose.
struct SeqTensor {
  void* data = nullptr;  // const for inputs; written for outputs
  DType dtype = DType::kF32;
  int64_t batch_stride = 0;
  int64_t seq_stride = 0;
  int64_t head_stride = 0;
};

// An optional [B, N, T, S]-broadcastable tensor (additive bias or boolean
// mask). A dimension of size 1 is broadcast through a zero stride; `dims`
// keeps the real sizes (each 1 or the full extent) for the bias gradient.
struct ScoreTensor {
  const void* data = nullptr;  // nullptr: absent
  DType dtype = DType::kF32;   // bias: f32/bf16/f16; mask: kBool (1 byte, 0/1)
  int64_t dims[4] = {1, 1, 1, 1};     // B, N, T, S as stored
  int64_t strides[4] = {0, 0, 0, 0};  // element strides; 0 where broadcast
};

// Everything that defines one attention problem, independent of the operands.
struct AttentionProblem {
  int64_t batch = 0;
  int64_t q_heads = 0;   // N
  int64_t kv_heads = 0;  // K; q head n reads kv head n / (N / K)
  int64_t q_len = 0;     // T
  int64_t kv_len = 0;    // S
  int64_t head_dim = 0;  // H, 1..kMaxHeadDim (32..256 are the supported, tuned range)
  float scale = 1.0f;
  // Top-left causal: query i sees key j only if j <= i.
  bool causal = false;
  // Sliding window: query i sees key j only if i - left <= j <= i + right.
  // A negative value means unbounded on that side.
  int64_t window_left = -1;
  int64_t window_right = -1;
  // Optional padding lengths ([batch] int32, nullptr when absent). Query rows
  // i >= q_lengths[b] see nothing (their O is 0, L is -inf); keys
  // j >= kv_lengths[b] are invisible to every query of that batch.
  const int32_t* q_lengths = nullptr;
  const int32_t* kv_lengths = nullptr;
  // Optional segment ids of packed sequences ([batch, q_len] and
  // [batch, kv_len] int32, contiguous; both or neither): query i of batch b
  // sees key j only if q_segment_ids[b*T + i] == kv_segment_ids[b*S + j].
  // Any int32 values, in any order; tiles are skipped where the ids of a
  // query tile and a key tile cannot meet.
  const int32_t* q_segment_ids = nullptr;
  const int32_t* kv_segment_ids = nullptr;
  ScoreTensor bias;  // additive, added after scaling
  ScoreTensor mask;  // boolean, nonzero = keep
};

constexpr int64_t kMaxHeadDim = 256;

// Operand sets. `lse` is float32 [B, Nq, T] contiguous. Pointers are host
// memory for the CPU kernels and device memory for the CUDA kernels.
struct ForwardOperands {
  SeqTensor q, k, v;  // inputs
  SeqTensor o;        // output, same dtype as q
  float* lse = nullptr;
};

struct BackwardOperands {
  SeqTensor q, k, v, o, d_o;  // inputs (o, d_o: q's layout and dtype)
  const float* lse = nullptr;
  SeqTensor dq, dk, dv;  // outputs, same dtype as q / k / v
};

// The bias gradient: dbias = dS summed over the bias' broadcast dimensions,
// written as float32, contiguous, shape problem.bias.dims.
struct BiasGradOperands {
  SeqTensor q, k, v, o, d_o;
  const float* lse = nullptr;
  float* dbias = nullptr;
};

}  // namespace fatrain
