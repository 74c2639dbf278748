// What the CPU and CUDA FFI handlers share: the attribute dictionary, the
// operand order, and the translation of XLA buffers into the framework-free
// structs of attention_problem.h, with every check the kernels rely on.
// Functions return an empty string on success, else the message to report.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <string>

#include "attention_problem.h"
#include "ffi/handler_common.h"
#include "xla/ffi/api/ffi.h"

namespace fatrain::ffi_glue {

namespace ffi = xla::ffi;

// Layout codes; must match LAYOUT_CODES in jax_fatrain/_backends/_ffi.py.
constexpr int32_t kLayoutBTNH = 0;
constexpr int32_t kLayoutBNTH = 1;

// The attribute dictionary every handler receives (jax_fatrain/_backends/_ffi.py).
struct Attributes {
  float scale;
  bool is_causal;
  int64_t window_left;
  int64_t window_right;
  int32_t layout;
  bool has_bias, has_mask, has_q_lengths, has_kv_lengths;
  bool has_segment_ids;  // q_segment_ids and kv_segment_ids (both or neither)
};

// For XLA_FFI_REGISTER_STRUCT_ATTR_DECODING, in Attributes' member order.
#define FATRAIN_ATTRIBUTE_MEMBERS                                            \
  ::xla::ffi::StructMember<float>("scale"),                                  \
      ::xla::ffi::StructMember<bool>("is_causal"),                           \
      ::xla::ffi::StructMember<int64_t>("window_left"),                      \
      ::xla::ffi::StructMember<int64_t>("window_right"),                     \
      ::xla::ffi::StructMember<int32_t>("layout"),                           \
      ::xla::ffi::StructMember<bool>("has_bias"),                            \
      ::xla::ffi::StructMember<bool>("has_mask"),                            \
      ::xla::ffi::StructMember<bool>("has_q_lengths"),                       \
      ::xla::ffi::StructMember<bool>("has_kv_lengths"),                      \
      ::xla::ffi::StructMember<bool>("has_segment_ids")

// The inputs of every target, in call order, after the handler's context.
#define FATRAIN_BIND_ATTENTION_INPUTS(binding)                                 \
  binding.Arg<::xla::ffi::AnyBuffer>()               /* query */               \
      .Arg<::xla::ffi::AnyBuffer>()                  /* key */                 \
      .Arg<::xla::ffi::AnyBuffer>()                  /* value */               \
      .Arg<::xla::ffi::AnyBuffer>()                  /* bias (placeholder) */  \
      .Arg<::xla::ffi::AnyBuffer>()                  /* mask (placeholder) */  \
      .Arg<::xla::ffi::Buffer<::xla::ffi::S32>>()    /* query lengths */       \
      .Arg<::xla::ffi::Buffer<::xla::ffi::S32>>()    /* key/value lengths */   \
      .Arg<::xla::ffi::Buffer<::xla::ffi::S32>>()    /* query segment ids */   \
      .Arg<::xla::ffi::Buffer<::xla::ffi::S32>>()    /* key/value segment ids */

inline std::string ShapeString(const ffi::AnyBuffer& buffer) {
  std::string out = "[";
  auto dims = buffer.dimensions();
  for (size_t i = 0; i < dims.size(); ++i) {
    out += (i ? ", " : "") + std::to_string(dims[i]);
  }
  return out + "]";
}

inline bool ToKernelDType(ffi::DataType type, DType* out) {
  switch (type) {
    case ffi::DataType::F32: *out = DType::kF32; return true;
    case ffi::DataType::BF16: *out = DType::kBF16; return true;
    case ffi::DataType::F16: *out = DType::kF16; return true;
    case ffi::DataType::PRED: *out = DType::kBool; return true;
    default: return false;
  }
}

// Reads a [B, L, heads, D] (BTNH) or [B, heads, L, D] (BNTH) operand;
// dims_out = {B, L, heads, D}.
inline std::string ReadSeqTensor(const char* name, const ffi::AnyBuffer& buffer,
                                 int32_t layout, int64_t dims_out[4], SeqTensor* out) {
  auto dims = buffer.dimensions();
  if (dims.size() != 4) {
    return std::string(name) + " must have rank 4, got shape " + ShapeString(buffer);
  }
  if (!ToKernelDType(buffer.element_type(), &out->dtype) || out->dtype == DType::kBool) {
    return std::string(name) + " must be float32, bfloat16 or float16";
  }
  const int64_t b = dims[0], d = dims[3];
  const int64_t seq = layout == kLayoutBTNH ? dims[1] : dims[2];
  const int64_t heads = layout == kLayoutBTNH ? dims[2] : dims[1];
  dims_out[0] = b; dims_out[1] = seq; dims_out[2] = heads; dims_out[3] = d;
  out->data = buffer.untyped_data();
  out->batch_stride = dims[1] * dims[2] * d;
  out->seq_stride = layout == kLayoutBTNH ? heads * d : d;
  out->head_stride = layout == kLayoutBTNH ? d : seq * d;
  return "";
}

// An operand that must match its reference exactly (O, dO, dQ, ...).
inline std::string ExpectSameAs(const char* name, const ffi::AnyBuffer& buffer,
                                const char* like_name, const ffi::AnyBuffer& like) {
  if (buffer.element_type() != like.element_type() ||
      ShapeString(buffer) != ShapeString(like)) {
    return std::string(name) + " must have the shape and dtype of " + like_name + " " +
           ShapeString(like) + ", got " + ShapeString(buffer);
  }
  return "";
}

// A bias or mask: rank 4, each dim 1 (broadcast, stride 0) or the full extent.
inline std::string ReadScoreTensor(const char* name, const ffi::AnyBuffer& buffer,
                                   bool want_bool, const int64_t full[4],
                                   ScoreTensor* out) {
  auto dims = buffer.dimensions();
  if (dims.size() != 4) {
    return std::string(name) + " must have rank 4, got shape " + ShapeString(buffer);
  }
  if (!ToKernelDType(buffer.element_type(), &out->dtype) ||
      (out->dtype == DType::kBool) != want_bool) {
    return std::string(name) +
           (want_bool ? " must be bool" : " must be float32, bfloat16 or float16");
  }
  int64_t stride = 1;
  for (int axis = 3; axis >= 0; --axis) {
    if (dims[axis] != 1 && dims[axis] != full[axis]) {
      return std::string(name) + " shape " + ShapeString(buffer) +
             " does not broadcast to [B, N, T, S] = [" + std::to_string(full[0]) + ", " +
             std::to_string(full[1]) + ", " + std::to_string(full[2]) + ", " +
             std::to_string(full[3]) + "]";
    }
    out->dims[axis] = dims[axis];
    out->strides[axis] = dims[axis] == 1 ? 0 : stride;
    stride *= dims[axis];
  }
  out->data = buffer.untyped_data();
  return "";
}

inline std::string ReadLengths(const char* name, const ffi::Buffer<ffi::S32>& buffer,
                               int64_t batch, const int32_t** out) {
  if (buffer.element_count() != static_cast<size_t>(batch)) {
    return std::string(name) + " must have shape [" + std::to_string(batch) + "], got " +
           std::to_string(buffer.element_count()) + " elements";
  }
  *out = buffer.typed_data();
  return "";
}

// Segment ids: int32 [batch, length], contiguous.
inline std::string ReadSegmentIds(const char* name, const ffi::Buffer<ffi::S32>& buffer,
                                  int64_t batch, int64_t length, const char* length_name,
                                  const int32_t** out) {
  auto dims = buffer.dimensions();
  if (dims.size() != 2 || dims[0] != batch || dims[1] != length) {
    std::string got = "[";
    for (size_t i = 0; i < dims.size(); ++i) got += (i ? ", " : "") + std::to_string(dims[i]);
    return std::string(name) + " must have shape [B, " + length_name + "] = [" +
           std::to_string(batch) + ", " + std::to_string(length) + "], got " + got + "]";
  }
  *out = buffer.typed_data();
  return "";
}

#define FATRAIN_RETURN_IF_MESSAGE(expr)                  \
  if (std::string _message = (expr); !_message.empty()) \
  return _message

// q/k/v, the problem sizes, the optional bias/mask/lengths and the
// attributes; `validate` is the backend's own validate_problem.
inline std::string BuildProblem(const Attributes& attrs, const ffi::AnyBuffer& q,
                                const ffi::AnyBuffer& k, const ffi::AnyBuffer& v,
                                const ffi::AnyBuffer& bias, const ffi::AnyBuffer& mask,
                                const ffi::Buffer<ffi::S32>& q_lengths,
                                const ffi::Buffer<ffi::S32>& kv_lengths,
                                const ffi::Buffer<ffi::S32>& q_segment_ids,
                                const ffi::Buffer<ffi::S32>& kv_segment_ids,
                                const char* (*validate)(const AttentionProblem&),
                                AttentionProblem* problem, SeqTensor* q_t,
                                SeqTensor* k_t, SeqTensor* v_t) {
  if (attrs.layout != kLayoutBTNH && attrs.layout != kLayoutBNTH) {
    return "unknown layout code " + std::to_string(attrs.layout);
  }
  int64_t qd[4], kd[4], vd[4];
  FATRAIN_RETURN_IF_MESSAGE(ReadSeqTensor("query", q, attrs.layout, qd, q_t));
  FATRAIN_RETURN_IF_MESSAGE(ReadSeqTensor("key", k, attrs.layout, kd, k_t));
  FATRAIN_RETURN_IF_MESSAGE(ReadSeqTensor("value", v, attrs.layout, vd, v_t));
  FATRAIN_RETURN_IF_MESSAGE(ExpectSameAs("value", v, "key", k));
  if (k.element_type() != q.element_type()) {
    return "query, key and value must share one dtype";
  }
  if (kd[0] != qd[0] || kd[3] != qd[3]) {
    return "key " + ShapeString(k) + " must match query's batch and head_dim, query is " +
           ShapeString(q);
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
    FATRAIN_RETURN_IF_MESSAGE(ReadScoreTensor("bias", bias, false, full, &problem->bias));
  }
  if (attrs.has_mask) {
    FATRAIN_RETURN_IF_MESSAGE(ReadScoreTensor("mask", mask, true, full, &problem->mask));
  }
  if (attrs.has_q_lengths) {
    FATRAIN_RETURN_IF_MESSAGE(ReadLengths("query_seq_lengths", q_lengths, problem->batch,
                                          &problem->q_lengths));
  }
  if (attrs.has_kv_lengths) {
    FATRAIN_RETURN_IF_MESSAGE(ReadLengths("key_value_seq_lengths", kv_lengths,
                                          problem->batch, &problem->kv_lengths));
  }
  if (attrs.has_segment_ids) {
    FATRAIN_RETURN_IF_MESSAGE(ReadSegmentIds("q_segment_ids", q_segment_ids, problem->batch,
                                             problem->q_len, "T", &problem->q_segment_ids));
    FATRAIN_RETURN_IF_MESSAGE(ReadSegmentIds("kv_segment_ids", kv_segment_ids,
                                             problem->batch, problem->kv_len, "S",
                                             &problem->kv_segment_ids));
  }
  if (const char* error = validate(*problem)) return error;
  return "";
}

inline std::string ExpectLse(const ffi::AnyBuffer& lse, const AttentionProblem& p) {
  auto dims = lse.dimensions();
  if (lse.element_type() != ffi::DataType::F32 || dims.size() != 3 ||
      dims[0] != p.batch || dims[1] != p.q_heads || dims[2] != p.q_len) {
    return "lse must be float32 [B, N, T] = [" + std::to_string(p.batch) + ", " +
           std::to_string(p.q_heads) + ", " + std::to_string(p.q_len) + "], got " +
           ShapeString(lse);
  }
  return "";
}

// The forward's operands plus O, L and dO: what the backward and the bias
// gradient both read.
struct BackwardInputs {
  AttentionProblem problem;
  SeqTensor q, k, v, o, d_o;
  const float* lse = nullptr;
};

inline std::string ReadBackwardInputs(
    const Attributes& attrs, const ffi::AnyBuffer& q, const ffi::AnyBuffer& k,
    const ffi::AnyBuffer& v, const ffi::AnyBuffer& bias, const ffi::AnyBuffer& mask,
    const ffi::Buffer<ffi::S32>& q_lengths, const ffi::Buffer<ffi::S32>& kv_lengths,
    const ffi::Buffer<ffi::S32>& q_segment_ids, const ffi::Buffer<ffi::S32>& kv_segment_ids,
    const ffi::AnyBuffer& o, const ffi::AnyBuffer& lse, const ffi::AnyBuffer& d_o,
    const char* (*validate)(const AttentionProblem&), BackwardInputs* in) {
  FATRAIN_RETURN_IF_MESSAGE(BuildProblem(attrs, q, k, v, bias, mask, q_lengths,
                                         kv_lengths, q_segment_ids, kv_segment_ids,
                                         validate, &in->problem, &in->q, &in->k, &in->v));
  FATRAIN_RETURN_IF_MESSAGE(ExpectSameAs("out", o, "query", q));
  FATRAIN_RETURN_IF_MESSAGE(ExpectSameAs("d_out", d_o, "query", q));
  FATRAIN_RETURN_IF_MESSAGE(ExpectLse(lse, in->problem));
  int64_t unused[4];
  FATRAIN_RETURN_IF_MESSAGE(ReadSeqTensor("out", o, attrs.layout, unused, &in->o));
  FATRAIN_RETURN_IF_MESSAGE(ReadSeqTensor("d_out", d_o, attrs.layout, unused, &in->d_o));
  in->lse = static_cast<const float*>(lse.untyped_data());
  return "";
}

// The backward's outputs dQ, dK, dV, each shaped like its input.
inline std::string ReadGradients(int32_t layout, const ffi::AnyBuffer& q,
                                 const ffi::AnyBuffer& k, const ffi::AnyBuffer& v,
                                 ffi::AnyBuffer& dq, ffi::AnyBuffer& dk,
                                 ffi::AnyBuffer& dv, BackwardOperands* ops) {
  FATRAIN_RETURN_IF_MESSAGE(ExpectSameAs("dq", dq, "query", q));
  FATRAIN_RETURN_IF_MESSAGE(ExpectSameAs("dk", dk, "key", k));
  FATRAIN_RETURN_IF_MESSAGE(ExpectSameAs("dv", dv, "value", v));
  int64_t unused[4];
  FATRAIN_RETURN_IF_MESSAGE(ReadSeqTensor("dq", dq, layout, unused, &ops->dq));
  FATRAIN_RETURN_IF_MESSAGE(ReadSeqTensor("dk", dk, layout, unused, &ops->dk));
  FATRAIN_RETURN_IF_MESSAGE(ReadSeqTensor("dv", dv, layout, unused, &ops->dv));
  return "";
}

inline std::string ExpectBiasGradient(const ffi::AnyBuffer& dbias,
                                      const ffi::AnyBuffer& bias) {
  if (dbias.element_type() != ffi::DataType::F32 ||
      ShapeString(dbias) != ShapeString(bias)) {
    return "dbias must be float32 with the bias' shape " + ShapeString(bias) + ", got " +
           ShapeString(dbias);
  }
  return "";
}

}  // namespace fatrain::ffi_glue
