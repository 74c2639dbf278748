// XLA FFI handlers for the CPU backend: they translate XLA buffers and
// attributes into the framework-free structs of cpu/attention_cpu.h, run the
// kernels on XLA's own intra-op thread pool, and turn every problem into an
// ffi::Error (never a crash). The Python layer checks the same rules first
// and gives friendlier messages; these checks are the last line of defence.

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <type_traits>

#include "cpu/attention_cpu.h"
#include "nanobind/nanobind.h"
#include "nanobind/stl/string.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
namespace nb = nanobind;
using fatrain::cpu::AttentionProblem;
using fatrain::cpu::DType;
using fatrain::cpu::ScoreTensor;
using fatrain::cpu::SeqTensor;

namespace {

// Layout codes; must match jax_fatrain/_cpu.py (_LAYOUT_CODES).
constexpr int32_t kLayoutBTNH = 0;
constexpr int32_t kLayoutBNTH = 1;

ffi::Error InvalidArgument(const std::string& message) {
  return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                    "jax_fatrain cpu: " + message);
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
  if (const char* error = fatrain::cpu::validate_problem(*problem)) {
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

// ParallelFor on XLA's intra-op pool. The calling thread takes part and items
// are claimed from a shared counter, so the call finishes even if the pool
// never runs our tasks (e.g. when the caller itself is the pool's only
// thread); helpers that start late find nothing left and return at once.
struct PoolRun {
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> finished{0};
  int64_t count = 0;
  void (*body)(void*, int64_t) = nullptr;
  void* context = nullptr;
  std::mutex mutex;
  std::condition_variable all_done;

  void Work() {
    for (int64_t i; (i = next.fetch_add(1)) < count;) {
      body(context, i);
      if (finished.fetch_add(1) + 1 == count) {
        std::lock_guard<std::mutex> lock(mutex);
        all_done.notify_all();
      }
    }
  }
};

void RunOnPool(void* self, int64_t count, void (*body)(void*, int64_t),
               void* context) {
  if (count <= 0) return;
  auto* pool = static_cast<ffi::ThreadPool*>(self);
  auto run = std::make_shared<PoolRun>();
  run->count = count;
  run->body = body;
  run->context = context;
  const int64_t helpers = std::min<int64_t>(pool->num_threads(), count) - 1;
  for (int64_t h = 0; h < helpers; ++h) {
    pool->Schedule([run] { run->Work(); });
  }
  run->Work();
  std::unique_lock<std::mutex> lock(run->mutex);
  run->all_done.wait(lock, [&] { return run->finished.load() == count; });
}

fatrain::cpu::ParallelFor MakeParallelFor(ffi::ThreadPool& pool) {
  fatrain::cpu::ParallelFor parallel;
  const int64_t threads = pool.num_threads();
  if (threads <= 1) return fatrain::cpu::serial_parallel_for();
  parallel.run = RunOnPool;
  parallel.self = &pool;
  parallel.num_threads = threads;
  return parallel;
}

// Test hook: with JAX_FATRAIN_POISON_OUTPUTS=1 every output is filled with
// NaN (0xFF bytes) before a kernel runs, so an element the kernel forgets to
// write cannot pass a test by inheriting a plausible value.
bool PoisonOutputs() {
  static const bool poison = [] {
    const char* value = std::getenv("JAX_FATRAIN_POISON_OUTPUTS");
    return value != nullptr && value[0] == '1';
  }();
  return poison;
}

void Poison(ffi::AnyBuffer& buffer) {
  if (PoisonOutputs()) std::memset(buffer.untyped_data(), 0xFF, buffer.size_bytes());
}

ffi::Error KernelStatus(const char* error) {
  if (error == nullptr) return ffi::Error::Success();
  return ffi::Error(ffi::ErrorCode::kInternal, std::string("jax_fatrain cpu: ") + error);
}

#define FATRAIN_RETURN_IF_ERROR(expr) \
  if (auto _error = (expr); _error.failure()) return _error

ffi::Error ForwardImpl(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k,
                       ffi::AnyBuffer v, ffi::AnyBuffer bias, ffi::AnyBuffer mask,
                       ffi::Buffer<ffi::S32> q_lengths,
                       ffi::Buffer<ffi::S32> kv_lengths,
                       ffi::Result<ffi::AnyBuffer> o,
                       ffi::Result<ffi::AnyBuffer> lse, Attributes attrs) {
  AttentionProblem problem;
  fatrain::cpu::ForwardOperands ops;
  FATRAIN_RETURN_IF_ERROR(BuildProblem(attrs, q, k, v, bias, mask, q_lengths,
                                       kv_lengths, &problem, &ops.q, &ops.k, &ops.v));
  FATRAIN_RETURN_IF_ERROR(ExpectSameAs("output", *o, "query", q));
  FATRAIN_RETURN_IF_ERROR(ExpectLse(*lse, problem));
  int64_t unused[4];
  FATRAIN_RETURN_IF_ERROR(ReadSeqTensor("output", *o, attrs.layout, unused, &ops.o));
  ops.lse = static_cast<float*>(lse->untyped_data());
  Poison(*o);
  Poison(*lse);
  return KernelStatus(
      fatrain::cpu::attention_forward(problem, ops, MakeParallelFor(pool)));
}

// Shared by the backward and the bias gradient: the forward's operands plus
// O, L and dO.
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

ffi::Error BackwardImpl(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k,
                        ffi::AnyBuffer v, ffi::AnyBuffer bias, ffi::AnyBuffer mask,
                        ffi::Buffer<ffi::S32> q_lengths,
                        ffi::Buffer<ffi::S32> kv_lengths, ffi::AnyBuffer o,
                        ffi::AnyBuffer lse, ffi::AnyBuffer d_o,
                        ffi::Result<ffi::AnyBuffer> dq,
                        ffi::Result<ffi::AnyBuffer> dk,
                        ffi::Result<ffi::AnyBuffer> dv, Attributes attrs) {
  BackwardInputs in;
  FATRAIN_RETURN_IF_ERROR(ReadBackwardInputs(attrs, q, k, v, bias, mask, q_lengths,
                                             kv_lengths, o, lse, d_o, &in));
  FATRAIN_RETURN_IF_ERROR(ExpectSameAs("dq", *dq, "query", q));
  FATRAIN_RETURN_IF_ERROR(ExpectSameAs("dk", *dk, "key", k));
  FATRAIN_RETURN_IF_ERROR(ExpectSameAs("dv", *dv, "value", v));
  fatrain::cpu::BackwardOperands ops;
  ops.q = in.q; ops.k = in.k; ops.v = in.v; ops.o = in.o; ops.d_o = in.d_o;
  ops.lse = in.lse;
  int64_t unused[4];
  FATRAIN_RETURN_IF_ERROR(ReadSeqTensor("dq", *dq, attrs.layout, unused, &ops.dq));
  FATRAIN_RETURN_IF_ERROR(ReadSeqTensor("dk", *dk, attrs.layout, unused, &ops.dk));
  FATRAIN_RETURN_IF_ERROR(ReadSeqTensor("dv", *dv, attrs.layout, unused, &ops.dv));
  Poison(*dq);
  Poison(*dk);
  Poison(*dv);
  return KernelStatus(
      fatrain::cpu::attention_backward(in.problem, ops, MakeParallelFor(pool)));
}

ffi::Error BiasGradImpl(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k,
                        ffi::AnyBuffer v, ffi::AnyBuffer bias, ffi::AnyBuffer mask,
                        ffi::Buffer<ffi::S32> q_lengths,
                        ffi::Buffer<ffi::S32> kv_lengths, ffi::AnyBuffer o,
                        ffi::AnyBuffer lse, ffi::AnyBuffer d_o,
                        ffi::Result<ffi::AnyBuffer> dbias, Attributes attrs) {
  if (!attrs.has_bias) return InvalidArgument("the bias gradient needs a bias");
  BackwardInputs in;
  FATRAIN_RETURN_IF_ERROR(ReadBackwardInputs(attrs, q, k, v, bias, mask, q_lengths,
                                             kv_lengths, o, lse, d_o, &in));
  if (dbias->element_type() != ffi::DataType::F32 ||
      ShapeString(*dbias) != ShapeString(bias)) {
    return InvalidArgument("dbias must be float32 with the bias' shape " +
                           ShapeString(bias) + ", got " + ShapeString(*dbias));
  }
  fatrain::cpu::BiasGradOperands ops;
  ops.q = in.q; ops.k = in.k; ops.v = in.v; ops.o = in.o; ops.d_o = in.d_o;
  ops.lse = in.lse;
  ops.dbias = static_cast<float*>(dbias->untyped_data());
  Poison(*dbias);
  return KernelStatus(
      fatrain::cpu::attention_bias_grad(in.problem, ops, MakeParallelFor(pool)));
}

}  // namespace

// One attribute dictionary for all handlers keeps the three bindings in step
// with the Python side (jax_fatrain/_cpu.py builds the same dictionary).
XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(
    Attributes, ffi::StructMember<float>("scale"),
    ffi::StructMember<bool>("is_causal"), ffi::StructMember<int64_t>("window_left"),
    ffi::StructMember<int64_t>("window_right"), ffi::StructMember<int32_t>("layout"),
    ffi::StructMember<bool>("has_bias"), ffi::StructMember<bool>("has_mask"),
    ffi::StructMember<bool>("has_q_lengths"),
    ffi::StructMember<bool>("has_kv_lengths"));

// The inputs shared by all three targets, in call order.
static auto BindAttentionInputs() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::ThreadPool>()
      .Arg<ffi::AnyBuffer>()          // query
      .Arg<ffi::AnyBuffer>()          // key
      .Arg<ffi::AnyBuffer>()          // value
      .Arg<ffi::AnyBuffer>()          // bias (placeholder when absent)
      .Arg<ffi::AnyBuffer>()          // mask (placeholder when absent)
      .Arg<ffi::Buffer<ffi::S32>>()   // query_seq_lengths (placeholder)
      .Arg<ffi::Buffer<ffi::S32>>();  // key_value_seq_lengths (placeholder)
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(FatrainCpuForward, ForwardImpl,
                              BindAttentionInputs()
                                  .Ret<ffi::AnyBuffer>()  // out
                                  .Ret<ffi::AnyBuffer>()  // lse
                                  .Attrs<Attributes>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(FatrainCpuBackward, BackwardImpl,
                              BindAttentionInputs()
                                  .Arg<ffi::AnyBuffer>()  // out
                                  .Arg<ffi::AnyBuffer>()  // lse
                                  .Arg<ffi::AnyBuffer>()  // d_out
                                  .Ret<ffi::AnyBuffer>()  // dq
                                  .Ret<ffi::AnyBuffer>()  // dk
                                  .Ret<ffi::AnyBuffer>()  // dv
                                  .Attrs<Attributes>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(FatrainCpuBiasGrad, BiasGradImpl,
                              BindAttentionInputs()
                                  .Arg<ffi::AnyBuffer>()  // out
                                  .Arg<ffi::AnyBuffer>()  // lse
                                  .Arg<ffi::AnyBuffer>()  // d_out
                                  .Ret<ffi::AnyBuffer>()  // dbias
                                  .Attrs<Attributes>());

template <typename T>
static nb::capsule EncapsulateFfiHandler(T* fn) {
  static_assert(std::is_invocable_r_v<XLA_FFI_Error*, T, XLA_FFI_CallFrame*>,
                "Encapsulated function must be an XLA FFI handler");
  return nb::capsule(reinterpret_cast<void*>(fn));
}

NB_MODULE(_cpu_ffi, m) {
  m.doc() = "XLA FFI handlers of jax_fatrain's CPU backend.";
  m.def("registrations", []() {
    nb::dict targets;
    targets["jax_fatrain_cpu_forward"] = EncapsulateFfiHandler(FatrainCpuForward);
    targets["jax_fatrain_cpu_backward"] = EncapsulateFfiHandler(FatrainCpuBackward);
    targets["jax_fatrain_cpu_bias_grad"] = EncapsulateFfiHandler(FatrainCpuBiasGrad);
    return targets;
  });
  m.def("selected_isa", []() { return std::string(fatrain::cpu::selected_isa()); },
        "The instruction set the CPU kernels dispatch to on this machine.");
}
