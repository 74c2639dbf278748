// XLA FFI handlers for the CUDA backend: they translate XLA buffers and
// attributes into the framework-free structs of cuda/attention_cuda.h and
// enqueue the kernels on the stream XLA gives us. Scratch memory comes from
// XLA's allocator; every problem (bad operands, CUDA launch errors) becomes an
// ffi::Error. Mirrors cpu_ffi.cc (same attributes plus `deterministic`).

#include <cstdint>
#include <cstdlib>
#include <optional>
#include <string>
#include <type_traits>

#include <cuda_runtime_api.h>

#include "cuda/attention_cuda.h"
#include "nanobind/nanobind.h"
#include "nanobind/stl/string.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
namespace nb = nanobind;
using fatrain::cuda::AttentionProblem;
using fatrain::cuda::DType;
using fatrain::cuda::ScoreTensor;
using fatrain::cuda::SeqTensor;

namespace {

// Layout codes; must match jax_fatrain/_cpu.py (_LAYOUT_CODES).
constexpr int32_t kLayoutBTNH = 0;
constexpr int32_t kLayoutBNTH = 1;

ffi::Error InvalidArgument(const std::string& message) {
  return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                    "jax_fatrain cuda: " + message);
}

std::string ShapeString(const ffi::AnyBuffer& buffer) {
  std::string out = "[";
  auto dims = buffer.dimensions();
  for (size_t i = 0; i < dims.size(); ++i) {
    out += (i ? ", " : "") + std::to_string(dims[i]);
  }
  return out + "]";
}

bool ToKernelDType(ffi::DataType type, DType* out) {
  switch (type) {
    case ffi::DataType::F32: *out = DType::kF32; return true;
    case ffi::DataType::BF16: *out = DType::kBF16; return true;
    case ffi::DataType::F16: *out = DType::kF16; return true;
    case ffi::DataType::PRED: *out = DType::kBool; return true;
    default: return false;
  }
}

// The static attributes every handler receives.
struct Attributes {
  float scale;
  bool is_causal;
  int64_t window_left;
  int64_t window_right;
  int32_t layout;
  bool has_bias, has_mask, has_q_lengths, has_kv_lengths;
  bool deterministic;
};

// Reads a [B, L, heads, D] (BTNH) or [B, heads, L, D] (BNTH) operand.
ffi::Error ReadSeqTensor(const char* name, const ffi::AnyBuffer& buffer,
                         int32_t layout, int64_t dims_out[4], SeqTensor* out) {
  auto dims = buffer.dimensions();
  if (dims.size() != 4) {
    return InvalidArgument(std::string(name) + " must have rank 4, got shape " +
                           ShapeString(buffer));
  }
  if (!ToKernelDType(buffer.element_type(), &out->dtype) ||
      out->dtype == DType::kBool) {
    return InvalidArgument(std::string(name) +
                           " must be float32, bfloat16 or float16");
  }
  const int64_t b = dims[0], d = dims[3];
  const int64_t seq = layout == kLayoutBTNH ? dims[1] : dims[2];
  const int64_t heads = layout == kLayoutBTNH ? dims[2] : dims[1];
  dims_out[0] = b; dims_out[1] = seq; dims_out[2] = heads; dims_out[3] = d;
  out->data = buffer.untyped_data();
  out->batch_stride = dims[1] * dims[2] * d;
  out->seq_stride = layout == kLayoutBTNH ? heads * d : d;
  out->head_stride = layout == kLayoutBTNH ? d : seq * d;
  return ffi::Error::Success();
}

// Checks that `buffer` has the shape and dtype of `like` (an O/dO/dQ-style
// operand must match its reference exactly).
ffi::Error ExpectSameAs(const char* name, const ffi::AnyBuffer& buffer,
                        const char* like_name, const ffi::AnyBuffer& like) {
  if (buffer.element_type() != like.element_type() ||
      ShapeString(buffer) != ShapeString(like)) {
    return InvalidArgument(std::string(name) + " must have the shape and dtype of " +
                           like_name + " " + ShapeString(like) + ", got " +
                           ShapeString(buffer));
  }
  return ffi::Error::Success();
}

ffi::Error ReadScoreTensor(const char* name, const ffi::AnyBuffer& buffer,
                           bool want_bool, const int64_t full[4],
                           ScoreTensor* out) {
  auto dims = buffer.dimensions();
  if (dims.size() != 4) {
    return InvalidArgument(std::string(name) + " must have rank 4, got shape " +
                           ShapeString(buffer));
  }
  if (!ToKernelDType(buffer.element_type(), &out->dtype) ||
      (out->dtype == DType::kBool) != want_bool) {
    return InvalidArgument(std::string(name) +
                           (want_bool ? " must be bool"
                                      : " must be float32, bfloat16 or float16"));
  }
  int64_t stride = 1;
  for (int axis = 3; axis >= 0; --axis) {
    if (dims[axis] != 1 && dims[axis] != full[axis]) {
      return InvalidArgument(std::string(name) + " shape " + ShapeString(buffer) +
                             " does not broadcast to [B, N, T, S] = [" +
                             std::to_string(full[0]) + ", " + std::to_string(full[1]) +
                             ", " + std::to_string(full[2]) + ", " +
                             std::to_string(full[3]) + "]");
    }
    out->dims[axis] = dims[axis];
    out->strides[axis] = dims[axis] == 1 ? 0 : stride;
    stride *= dims[axis];
  }
  out->data = buffer.untyped_data();
  return ffi::Error::Success();
}

ffi::Error ReadLengths(const char* name, const ffi::Buffer<ffi::S32>& buffer,
                       int64_t batch, const int32_t** out) {
  if (buffer.element_count() != static_cast<size_t>(batch)) {
    return InvalidArgument(std::string(name) + " must have shape [" +
                           std::to_string(batch) + "], got " +
                           std::to_string(buffer.element_count()) + " elements");
  }
  *out = buffer.typed_data();
  return ffi::Error::Success();
}

// Everything but the operand-specific outputs: q/k/v, problem sizes, the
// optional bias/mask/lengths and the attributes.
ffi::Error BuildProblem(const Attributes& attrs, const ffi::AnyBuffer& q,
                        const ffi::AnyBuffer& k, const ffi::AnyBuffer& v,
                        const ffi::AnyBuffer& bias, const ffi::AnyBuffer& mask,
                        const ffi::Buffer<ffi::S32>& q_lengths,
                        const ffi::Buffer<ffi::S32>& kv_lengths,
                        AttentionProblem* problem, SeqTensor* q_t,
                        SeqTensor* k_t, SeqTensor* v_t) {
  if (attrs.layout != kLayoutBTNH && attrs.layout != kLayoutBNTH) {
    return InvalidArgument("unknown layout code " + std::to_string(attrs.layout));
  }
  int64_t qd[4], kd[4], vd[4];
  if (auto e = ReadSeqTensor("query", q, attrs.layout, qd, q_t); e.failure()) return e;
  if (auto e = ReadSeqTensor("key", k, attrs.layout, kd, k_t); e.failure()) return e;
  if (auto e = ReadSeqTensor("value", v, attrs.layout, vd, v_t); e.failure()) return e;
  if (auto e = ExpectSameAs("value", v, "key", k); e.failure()) return e;
  if (k.element_type() != q.element_type()) {
    return InvalidArgument("query, key and value must share one dtype");
  }
  if (kd[0] != qd[0] || kd[3] != qd[3]) {
    return InvalidArgument("key " + ShapeString(k) +
                           " must match query's batch and head_dim, query is " +
                           ShapeString(q));
  }
  problem->batch = qd[0];
  problem->q_len = qd[1];
  problem->q_heads = qd[2];
  problem->head_dim = qd[3];
  problem->kv_len = kd[1];
  problem->kv_heads = kd[2];
  problem->scale = attrs.scale;
  problem->causal = attrs.is_causal;
  problem->window_left = attrs.window_left;
  problem->window_right = attrs.window_right;
  const int64_t full[4] = {problem->batch, problem->q_heads, problem->q_len,
                           problem->kv_len};
  if (attrs.has_bias) {
    if (auto e = ReadScoreTensor("bias", bias, false, full, &problem->bias); e.failure())
      return e;
  }
  if (attrs.has_mask) {
    if (auto e = ReadScoreTensor("mask", mask, true, full, &problem->mask); e.failure())
      return e;
  }
  if (attrs.has_q_lengths) {
    if (auto e = ReadLengths("query_seq_lengths", q_lengths, problem->batch,
                             &problem->q_lengths); e.failure())
      return e;
  }
  if (attrs.has_kv_lengths) {
    if (auto e = ReadLengths("key_value_seq_lengths", kv_lengths, problem->batch,
                             &problem->kv_lengths); e.failure())
      return e;
  }
  if (const char* error = fatrain::cuda::validate_problem(*problem)) {
    return InvalidArgument(error);
  }
  return ffi::Error::Success();
}

ffi::Error ExpectLse(const ffi::AnyBuffer& lse, const AttentionProblem& p) {
  auto dims = lse.dimensions();
  if (lse.element_type() != ffi::DataType::F32 || dims.size() != 3 ||
      dims[0] != p.batch || dims[1] != p.q_heads || dims[2] != p.q_len) {
    return InvalidArgument("lse must be float32 [B, N, T] = [" +
                           std::to_string(p.batch) + ", " + std::to_string(p.q_heads) +
                           ", " + std::to_string(p.q_len) + "], got " +
                           ShapeString(lse));
  }
  return ffi::Error::Success();
}


// Test hook (see cpu_ffi.cc): with JAX_FATRAIN_POISON_OUTPUTS=1 every output is
// filled with NaN (0xFF bytes) before a kernel runs.
bool PoisonOutputs() {
  static const bool poison = [] {
    const char* value = std::getenv("JAX_FATRAIN_POISON_OUTPUTS");
    return value != nullptr && value[0] == '1';
  }();
  return poison;
}

ffi::Error Poison(ffi::AnyBuffer& buffer, cudaStream_t stream) {
  if (!PoisonOutputs() || buffer.size_bytes() == 0) return ffi::Error::Success();
  cudaError_t e = cudaMemsetAsync(buffer.untyped_data(), 0xFF, buffer.size_bytes(), stream);
  if (e != cudaSuccess) {
    return ffi::Error(ffi::ErrorCode::kInternal,
                      std::string("jax_fatrain cuda: poison memset failed: ") +
                          cudaGetErrorString(e));
  }
  return ffi::Error::Success();
}

ffi::Error KernelStatus(const char* error) {
  if (error == nullptr) return ffi::Error::Success();
  std::string message(error);
  if (message.rfind("jax_fatrain cuda:", 0) != 0) message = "jax_fatrain cuda: " + message;
  return ffi::Error(ffi::ErrorCode::kInternal, message);
}

#define FATRAIN_RETURN_IF_ERROR(expr) \
  if (auto _error = (expr); _error.failure()) return _error

// Scratch memory is an extra uint8 output that XLA allocates with the other
// buffers (jax_fatrain/_cuda.py sizes it with the same formula and drops it).
// ffi::ScratchAllocator was tried first: on jax 0.11.2 / H200 its Allocate
// failed even for a few hundred bytes inside jitted programs.
ffi::Error GetScratch(ffi::AnyBuffer& workspace, size_t bytes, void** out) {
  *out = nullptr;
  if (bytes == 0) return ffi::Error::Success();
  if (workspace.size_bytes() < bytes) {
    return InvalidArgument("workspace must hold " + std::to_string(bytes) +
                           " bytes, got " + std::to_string(workspace.size_bytes()));
  }
  *out = workspace.untyped_data();
  return ffi::Error::Success();
}

ffi::Error ForwardImpl(cudaStream_t stream, ffi::AnyBuffer q,
                       ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer bias,
                       ffi::AnyBuffer mask, ffi::Buffer<ffi::S32> q_lengths,
                       ffi::Buffer<ffi::S32> kv_lengths, ffi::Result<ffi::AnyBuffer> o,
                       ffi::Result<ffi::AnyBuffer> lse, Attributes attrs) {
  AttentionProblem problem;
  fatrain::cuda::ForwardOperands ops;
  FATRAIN_RETURN_IF_ERROR(BuildProblem(attrs, q, k, v, bias, mask, q_lengths,
                                       kv_lengths, &problem, &ops.q, &ops.k, &ops.v));
  FATRAIN_RETURN_IF_ERROR(ExpectSameAs("output", *o, "query", q));
  FATRAIN_RETURN_IF_ERROR(ExpectLse(*lse, problem));
  int64_t unused[4];
  FATRAIN_RETURN_IF_ERROR(ReadSeqTensor("output", *o, attrs.layout, unused, &ops.o));
  ops.lse = static_cast<float*>(lse->untyped_data());
  FATRAIN_RETURN_IF_ERROR(Poison(*o, stream));
  FATRAIN_RETURN_IF_ERROR(Poison(*lse, stream));
  return KernelStatus(fatrain::cuda::attention_forward(problem, ops, nullptr, stream));
}

struct BackwardInputs {
  AttentionProblem problem;
  SeqTensor q, k, v, o, d_o;
  const float* lse = nullptr;
};

ffi::Error ReadBackwardInputs(const Attributes& attrs, const ffi::AnyBuffer& q,
                              const ffi::AnyBuffer& k, const ffi::AnyBuffer& v,
                              const ffi::AnyBuffer& bias, const ffi::AnyBuffer& mask,
                              const ffi::Buffer<ffi::S32>& q_lengths,
                              const ffi::Buffer<ffi::S32>& kv_lengths,
                              const ffi::AnyBuffer& o, const ffi::AnyBuffer& lse,
                              const ffi::AnyBuffer& d_o, BackwardInputs* in) {
  FATRAIN_RETURN_IF_ERROR(BuildProblem(attrs, q, k, v, bias, mask, q_lengths,
                                       kv_lengths, &in->problem, &in->q, &in->k,
                                       &in->v));
  FATRAIN_RETURN_IF_ERROR(ExpectSameAs("out", o, "query", q));
  FATRAIN_RETURN_IF_ERROR(ExpectSameAs("d_out", d_o, "query", q));
  FATRAIN_RETURN_IF_ERROR(ExpectLse(lse, in->problem));
  int64_t unused[4];
  FATRAIN_RETURN_IF_ERROR(ReadSeqTensor("out", o, attrs.layout, unused, &in->o));
  FATRAIN_RETURN_IF_ERROR(ReadSeqTensor("d_out", d_o, attrs.layout, unused, &in->d_o));
  in->lse = static_cast<const float*>(lse.untyped_data());
  return ffi::Error::Success();
}

ffi::Error BackwardImpl(cudaStream_t stream, ffi::AnyBuffer q,
                        ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer bias,
                        ffi::AnyBuffer mask, ffi::Buffer<ffi::S32> q_lengths,
                        ffi::Buffer<ffi::S32> kv_lengths, ffi::AnyBuffer o,
                        ffi::AnyBuffer lse, ffi::AnyBuffer d_o,
                        ffi::Result<ffi::AnyBuffer> dq, ffi::Result<ffi::AnyBuffer> dk,
                        ffi::Result<ffi::AnyBuffer> dv,
                        ffi::Result<ffi::AnyBuffer> workspace, Attributes attrs) {
  BackwardInputs in;
  FATRAIN_RETURN_IF_ERROR(ReadBackwardInputs(attrs, q, k, v, bias, mask, q_lengths,
                                             kv_lengths, o, lse, d_o, &in));
  FATRAIN_RETURN_IF_ERROR(ExpectSameAs("dq", *dq, "query", q));
  FATRAIN_RETURN_IF_ERROR(ExpectSameAs("dk", *dk, "key", k));
  FATRAIN_RETURN_IF_ERROR(ExpectSameAs("dv", *dv, "value", v));
  fatrain::cuda::BackwardOperands ops;
  ops.q = in.q; ops.k = in.k; ops.v = in.v; ops.o = in.o; ops.d_o = in.d_o;
  ops.lse = in.lse;
  int64_t unused[4];
  FATRAIN_RETURN_IF_ERROR(ReadSeqTensor("dq", *dq, attrs.layout, unused, &ops.dq));
  FATRAIN_RETURN_IF_ERROR(ReadSeqTensor("dk", *dk, attrs.layout, unused, &ops.dk));
  FATRAIN_RETURN_IF_ERROR(ReadSeqTensor("dv", *dv, attrs.layout, unused, &ops.dv));
  FATRAIN_RETURN_IF_ERROR(Poison(*dq, stream));
  FATRAIN_RETURN_IF_ERROR(Poison(*dk, stream));
  FATRAIN_RETURN_IF_ERROR(Poison(*dv, stream));
  void* memory = nullptr;
  FATRAIN_RETURN_IF_ERROR(GetScratch(
      *workspace, fatrain::cuda::backward_scratch_bytes(in.problem, attrs.deterministic), &memory));
  return KernelStatus(fatrain::cuda::attention_backward(in.problem, ops, attrs.deterministic,
                                                        memory, stream));
}

ffi::Error BiasGradImpl(cudaStream_t stream, ffi::AnyBuffer q,
                        ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer bias,
                        ffi::AnyBuffer mask, ffi::Buffer<ffi::S32> q_lengths,
                        ffi::Buffer<ffi::S32> kv_lengths, ffi::AnyBuffer o,
                        ffi::AnyBuffer lse, ffi::AnyBuffer d_o,
                        ffi::Result<ffi::AnyBuffer> dbias,
                        ffi::Result<ffi::AnyBuffer> workspace, Attributes attrs) {
  if (!attrs.has_bias) return InvalidArgument("the bias gradient needs a bias");
  BackwardInputs in;
  FATRAIN_RETURN_IF_ERROR(ReadBackwardInputs(attrs, q, k, v, bias, mask, q_lengths,
                                             kv_lengths, o, lse, d_o, &in));
  if (dbias->element_type() != ffi::DataType::F32 ||
      ShapeString(*dbias) != ShapeString(bias)) {
    return InvalidArgument("dbias must be float32 with the bias' shape " +
                           ShapeString(bias) + ", got " + ShapeString(*dbias));
  }
  fatrain::cuda::BiasGradOperands ops;
  ops.q = in.q; ops.k = in.k; ops.v = in.v; ops.o = in.o; ops.d_o = in.d_o;
  ops.lse = in.lse;
  ops.dbias = static_cast<float*>(dbias->untyped_data());
  FATRAIN_RETURN_IF_ERROR(Poison(*dbias, stream));
  void* memory = nullptr;
  FATRAIN_RETURN_IF_ERROR(
      GetScratch(*workspace, fatrain::cuda::bias_grad_scratch_bytes(in.problem), &memory));
  return KernelStatus(fatrain::cuda::attention_bias_grad(in.problem, ops, memory, stream));
}

}  // namespace

XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(
    Attributes, ffi::StructMember<float>("scale"),
    ffi::StructMember<bool>("is_causal"), ffi::StructMember<int64_t>("window_left"),
    ffi::StructMember<int64_t>("window_right"), ffi::StructMember<int32_t>("layout"),
    ffi::StructMember<bool>("has_bias"), ffi::StructMember<bool>("has_mask"),
    ffi::StructMember<bool>("has_q_lengths"),
    ffi::StructMember<bool>("has_kv_lengths"),
    ffi::StructMember<bool>("deterministic"));

static auto BindAttentionInputs() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::PlatformStream<cudaStream_t>>()
      .Arg<ffi::AnyBuffer>()          // query
      .Arg<ffi::AnyBuffer>()          // key
      .Arg<ffi::AnyBuffer>()          // value
      .Arg<ffi::AnyBuffer>()          // bias (placeholder when absent)
      .Arg<ffi::AnyBuffer>()          // mask (placeholder when absent)
      .Arg<ffi::Buffer<ffi::S32>>()   // query_seq_lengths (placeholder)
      .Arg<ffi::Buffer<ffi::S32>>();  // key_value_seq_lengths (placeholder)
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(FatrainCudaForward, ForwardImpl,
                              BindAttentionInputs()
                                  .Ret<ffi::AnyBuffer>()  // out
                                  .Ret<ffi::AnyBuffer>()  // lse
                                  .Attrs<Attributes>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(FatrainCudaBackward, BackwardImpl,
                              BindAttentionInputs()
                                  .Arg<ffi::AnyBuffer>()  // out
                                  .Arg<ffi::AnyBuffer>()  // lse
                                  .Arg<ffi::AnyBuffer>()  // d_out
                                  .Ret<ffi::AnyBuffer>()  // dq
                                  .Ret<ffi::AnyBuffer>()  // dk
                                  .Ret<ffi::AnyBuffer>()  // dv
                                  .Ret<ffi::AnyBuffer>()  // workspace (uint8)
                                  .Attrs<Attributes>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(FatrainCudaBiasGrad, BiasGradImpl,
                              BindAttentionInputs()
                                  .Arg<ffi::AnyBuffer>()  // out
                                  .Arg<ffi::AnyBuffer>()  // lse
                                  .Arg<ffi::AnyBuffer>()  // d_out
                                  .Ret<ffi::AnyBuffer>()  // dbias
                                  .Ret<ffi::AnyBuffer>()  // workspace (uint8)
                                  .Attrs<Attributes>());

template <typename T>
static nb::capsule EncapsulateFfiHandler(T* fn) {
  static_assert(std::is_invocable_r_v<XLA_FFI_Error*, T, XLA_FFI_CallFrame*>,
                "Encapsulated function must be an XLA FFI handler");
  return nb::capsule(reinterpret_cast<void*>(fn));
}

NB_MODULE(_cuda_ffi, m) {
  m.doc() = "XLA FFI handlers of jax_fatrain's CUDA backend.";
  m.def("registrations", []() {
    nb::dict targets;
    targets["jax_fatrain_cuda_forward"] = EncapsulateFfiHandler(FatrainCudaForward);
    targets["jax_fatrain_cuda_backward"] = EncapsulateFfiHandler(FatrainCudaBackward);
    targets["jax_fatrain_cuda_bias_grad"] = EncapsulateFfiHandler(FatrainCudaBiasGrad);
    return targets;
  });
  m.def("device_count", []() {
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess) return 0;
    return count;
  }, "Number of CUDA devices the runtime sees (0 when none or no driver).");
}
