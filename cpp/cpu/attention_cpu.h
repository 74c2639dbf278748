// Framework-free FlashAttention-2 training kernels for the CPU.
//
// Nothing in cpp/cpu/ knows about XLA, JAX or Python: the FFI layer
// (cpp/ffi/) translates XLA buffers into the plain structs below, and a
// C++ test could call these functions directly.
//
// Conventions (shared by every backend of jax_fatrain, see DESIGN.md §4):
//  * S = scale * Q Kᵀ computed in float32; additive bias added after scaling;
//    boolean mask / causal / window / lengths remove scores.
//  * L (logsumexp) is stored in natural log, float32, layout [B, Nq, T].
//  * A row with no visible key: O = 0, L = -inf, all its gradients are 0.
//  * Backward: D = rowsum(dO ∘ O); P = exp(S + bias - L); dS = P ∘ (dP - D).
//  * The backward is deterministic: no atomics, fixed reduction order.
#pragma once

#include <cstdint>

namespace fatrain::cpu {

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
  ScoreTensor bias;  // additive, added after scaling
  ScoreTensor mask;  // boolean, nonzero = keep
};

constexpr int64_t kMaxHeadDim = 256;

// Runs body(context, i) for every i in [0, count), possibly concurrently, and
// returns only when all have finished. Items must be independent. The FFI
// layer implements it on XLA's intra-op thread pool; serial_parallel_for runs
// them in order on the calling thread. A plain function pointer (not
// std::function) keeps the ISA-specific translation units free of standard
// library templates, see cpu_attention_impl.h.
struct ParallelFor {
  void (*run)(void* self, int64_t count, void (*body)(void* context, int64_t i),
              void* context) = nullptr;
  void* self = nullptr;
  // Number of worker threads, used only to size per-thread scratch.
  int64_t num_threads = 1;
};
ParallelFor serial_parallel_for();

// Operand sets. `lse` is float32 [B, Nq, T] contiguous.
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

// Returns nullptr when the problem is well formed, else a static or
// thread-local message naming the offending field (never throws).
const char* validate_problem(const AttentionProblem& problem);

// Each entry point validates, runs, and returns nullptr on success or an
// error message (e.g. allocation failure). They never throw or abort.
const char* attention_forward(const AttentionProblem& problem,
                              const ForwardOperands& operands,
                              const ParallelFor& parallel);
const char* attention_backward(const AttentionProblem& problem,
                               const BackwardOperands& operands,
                               const ParallelFor& parallel);
const char* attention_bias_grad(const AttentionProblem& problem,
                                const BiasGradOperands& operands,
                                const ParallelFor& parallel);

// The instruction set the kernels were dispatched to on this machine
// ("avx512", "avx2", "baseline"), for benchmarks and bug reports.
const char* selected_isa();

}  // namespace fatrain::cpu
