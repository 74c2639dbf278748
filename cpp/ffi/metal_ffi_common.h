// What the two FFI front ends of the Metal kernels share: `metal` (the macOS
// host, cpp/ffi/metal_ffi.cc) and `metal_emulated` (the MSL emulator,
// cpp/ffi/metal_emulated_ffi.cc). Both map XLA buffers and the attribute
// dictionary of the cpu target (jax_fatrain/_backends/_ffi.py) onto a
// metal_plan::Problem and onto host memory per plan role; they differ only in
// who executes the plan.
//
// The Python side (jax_fatrain/_backends/_metal_common.py) has already padded the head
// dimension to a compiled variant, folded bias and mask into one score operand
// and expanded a mask broadcast over keys, so what arrives here maps 1:1 onto
// the plan.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <utility>

#include "ffi/attention_ffi.h"
#include "metal/plan/plan.h"
#include "metal/plan/role_buffers.h"
#include "xla/ffi/api/ffi.h"

namespace fatrain::metal_ffi {

namespace ffi = xla::ffi;
namespace mp = fatrain::metal_plan;

// The attribute dictionary and layout codes of every backend (attention_ffi.h).
using fatrain::ffi_glue::Attributes;
using fatrain::ffi_glue::kLayoutBNTH;
using fatrain::ffi_glue::kLayoutBTNH;

// `who` prefixes every message, e.g. "jax_fatrain metal".
inline ffi::Error InvalidArgument(const char* who, const std::string& message) {
  return ffi::Error(ffi::ErrorCode::kInvalidArgument, std::string(who) + ": " + message);
}

// A failure of the plan or of its execution.
inline ffi::Error Status(const char* who, const std::string& err) {
  return fatrain::ffi_glue::Status(who, err, ffi::ErrorCode::kInternal);
}

inline bool ToDType(ffi::DataType t, mp::DType* out) {
  switch (t) {
    case ffi::DataType::F32: *out = mp::DType::kF32; return true;
    case ffi::DataType::BF16: *out = mp::DType::kBF16; return true;
    case ffi::DataType::F16: *out = mp::DType::kF16; return true;
    case ffi::DataType::PRED: *out = mp::DType::kBool; return true;
    default: return false;
  }
}

// [B, L, H, D] (BTNH) or [B, H, L, D] (BNTH): dims {b, len, heads, d} and strides.
inline ffi::Error ReadSeq(const char* who, const char* name, const ffi::AnyBuffer& buf,
                          int32_t layout, int64_t dims[4], mp::Strides* s) {
  auto d = buf.dimensions();
  if (d.size() != 4) return InvalidArgument(who, std::string(name) + " must have rank 4");
  const int64_t len = layout == kLayoutBTNH ? d[1] : d[2];
  const int64_t heads = layout == kLayoutBTNH ? d[2] : d[1];
  dims[0] = d[0];
  dims[1] = len;
  dims[2] = heads;
  dims[3] = d[3];
  s->batch = d[1] * d[2] * d[3];
  s->seq = layout == kLayoutBTNH ? heads * d[3] : d[3];
  s->head = layout == kLayoutBTNH ? d[3] : len * d[3];
  return ffi::Error::Success();
}

inline ffi::Error BuildProblem(const char* who, const Attributes& a, const ffi::AnyBuffer& q,
                               const ffi::AnyBuffer& k, const ffi::AnyBuffer& v,
                               const ffi::AnyBuffer& bias, const ffi::AnyBuffer& mask,
                               mp::Problem* p) {
  if (a.layout != kLayoutBTNH && a.layout != kLayoutBNTH) return InvalidArgument(who, "bad layout");
  int64_t qd[4], kd[4], vd[4];
  if (auto e = ReadSeq(who, "query", q, a.layout, qd, &p->q); e.failure()) return e;
  if (auto e = ReadSeq(who, "key", k, a.layout, kd, &p->k); e.failure()) return e;
  if (auto e = ReadSeq(who, "value", v, a.layout, vd, &p->v); e.failure()) return e;
  if (!ToDType(q.element_type(), &p->dtype) || p->dtype == mp::DType::kBool ||
      k.element_type() != q.element_type() || v.element_type() != q.element_type()) {
    return InvalidArgument(who, "query, key and value must share one float dtype");
  }
  for (int i = 0; i < 4; ++i) {
    if (kd[i] != vd[i]) return InvalidArgument(who, "key and value must have the same shape");
  }
  if (kd[0] != qd[0] || kd[3] != qd[3]) {
    return InvalidArgument(who, "key must match query's batch and head_dim");
  }
  p->o = p->q;
  p->batch = qd[0];
  p->q_len = qd[1];
  p->q_heads = qd[2];
  p->head_dim = qd[3];
  p->kv_len = kd[1];
  p->kv_heads = kd[2];
  p->scale = a.scale;
  p->causal = a.is_causal;
  p->window_left = a.window_left;
  p->window_right = a.window_right;
  p->has_q_lengths = a.has_q_lengths;
  p->has_kv_lengths = a.has_kv_lengths;
  if (a.has_bias && a.has_mask) {
    return InvalidArgument(who, "bias and mask must be folded into one operand before the call");
  }
  if (a.has_bias || a.has_mask) {
    const ffi::AnyBuffer& m = a.has_bias ? bias : mask;
    p->mask = a.has_bias ? mp::MaskKind::kAdditive : mp::MaskKind::kBool;
    if (!ToDType(m.element_type(), &p->mask_dtype)) return InvalidArgument(who, "bad mask dtype");
    auto d = m.dimensions();
    const int64_t full[4] = {p->batch, p->q_heads, p->q_len, p->kv_len};
    if (d.size() != 4) return InvalidArgument(who, "bias/mask must have rank 4");
    int64_t stride = 1;
    for (int axis = 3; axis >= 0; --axis) {
      if (d[axis] != 1 && d[axis] != full[axis]) {
        return InvalidArgument(who, "bias/mask does not broadcast to [B, N, T, S]");
      }
      p->mask_strides[axis] = d[axis] == 1 ? 0 : stride;
      stride *= d[axis];
    }
    if (full[3] == 1) p->mask_strides[3] = 1;  // a single key: contiguous either way
  }
  if (std::string e = mp::validate(*p); !e.empty()) return InvalidArgument(who, e);
  return ffi::Error::Success();
}

inline void SetOptional(const Attributes& a, ffi::AnyBuffer& bias, ffi::AnyBuffer& mask,
                        ffi::Buffer<ffi::S32>& ql, ffi::Buffer<ffi::S32>& kl,
                        mp::RoleBuffers* m) {
  if (a.has_bias) m->set(mp::Role::kMask, bias.untyped_data(), bias.size_bytes());
  if (a.has_mask) m->set(mp::Role::kMask, mask.untyped_data(), mask.size_bytes());
  if (a.has_q_lengths) m->set(mp::Role::kQLengths, ql.untyped_data(), ql.size_bytes());
  if (a.has_kv_lengths) m->set(mp::Role::kKVLengths, kl.untyped_data(), kl.size_bytes());
}

// Forward: problem, plan and memory per role (O and L are outputs).
inline ffi::Error PrepareForward(const char* who, const Attributes& attrs, ffi::AnyBuffer& q,
                                 ffi::AnyBuffer& k, ffi::AnyBuffer& v, ffi::AnyBuffer& bias,
                                 ffi::AnyBuffer& mask, ffi::Buffer<ffi::S32>& q_lengths,
                                 ffi::Buffer<ffi::S32>& kv_lengths,
                                 ffi::Buffer<ffi::S32>& q_segment_ids,
                                 ffi::Buffer<ffi::S32>& kv_segment_ids, ffi::AnyBuffer& o,
                                 ffi::AnyBuffer& lse, mp::Problem* p, mp::Plan* plan,
                                 mp::RoleBuffers* m) {
  if (auto e = BuildProblem(who, attrs, q, k, v, bias, mask, p); e.failure()) return e;
  if (attrs.has_segment_ids) return InvalidArgument(who, "segment ids are not supported");
  if (std::string e = mp::plan_forward(*p, plan); !e.empty()) return InvalidArgument(who, e);
  m->set(mp::Role::kQ, q.untyped_data(), q.size_bytes());
  m->set(mp::Role::kK, k.untyped_data(), k.size_bytes());
  m->set(mp::Role::kV, v.untyped_data(), v.size_bytes());
  m->set(mp::Role::kO, o.untyped_data(), o.size_bytes(), /*is_output=*/true);
  m->set(mp::Role::kL, lse.untyped_data(), lse.size_bytes(), /*is_output=*/true);
  SetOptional(attrs, bias, mask, q_lengths, kv_lengths, m);
  return ffi::Error::Success();
}

// Backward: problem, plan and memory per role (dQ, dK and dV are outputs).
inline ffi::Error PrepareBackward(const char* who, const Attributes& attrs, ffi::AnyBuffer& q,
                                  ffi::AnyBuffer& k, ffi::AnyBuffer& v, ffi::AnyBuffer& bias,
                                  ffi::AnyBuffer& mask, ffi::Buffer<ffi::S32>& q_lengths,
                                  ffi::Buffer<ffi::S32>& kv_lengths,
                                  ffi::Buffer<ffi::S32>& q_segment_ids,
                                  ffi::Buffer<ffi::S32>& kv_segment_ids, ffi::AnyBuffer& o,
                                  ffi::AnyBuffer& lse, ffi::AnyBuffer& d_o, ffi::AnyBuffer& dq,
                                  ffi::AnyBuffer& dk, ffi::AnyBuffer& dv, mp::Problem* p,
                                  mp::Plan* plan, mp::RoleBuffers* m) {
  if (auto e = BuildProblem(who, attrs, q, k, v, bias, mask, p); e.failure()) return e;
  if (attrs.has_segment_ids) return InvalidArgument(who, "segment ids are not supported");
  if (std::string e = mp::plan_backward(*p, plan); !e.empty()) return InvalidArgument(who, e);
  if (o.element_type() != q.element_type() || d_o.element_type() != q.element_type() ||
      o.size_bytes() != q.size_bytes() || d_o.size_bytes() != q.size_bytes()) {
    return InvalidArgument(who, "out and d_out must have the shape and dtype of query");
  }
  m->set(mp::Role::kQ, q.untyped_data(), q.size_bytes());
  m->set(mp::Role::kK, k.untyped_data(), k.size_bytes());
  m->set(mp::Role::kV, v.untyped_data(), v.size_bytes());
  m->set(mp::Role::kO, o.untyped_data(), o.size_bytes());
  m->set(mp::Role::kL, lse.untyped_data(), lse.size_bytes());
  m->set(mp::Role::kDO, d_o.untyped_data(), d_o.size_bytes());
  m->set(mp::Role::kDQ, dq.untyped_data(), dq.size_bytes(), /*is_output=*/true);
  m->set(mp::Role::kDK, dk.untyped_data(), dk.size_bytes(), /*is_output=*/true);
  m->set(mp::Role::kDV, dv.untyped_data(), dv.size_bytes(), /*is_output=*/true);
  SetOptional(attrs, bias, mask, q_lengths, kv_lengths, m);
  return ffi::Error::Success();
}

inline bool PoisonOutputs() { return fatrain::ffi_glue::PoisonOutputsRequested(); }

// Fills every output role with 0xFF (see PoisonOutputsRequested).
inline void PoisonHostOutputs(const mp::RoleBuffers& m) {
  if (!PoisonOutputs()) return;
  for (int r = 0; r < mp::RoleBuffers::kRoles; ++r) {
    if (m.output[r] && m.data[r] != nullptr) std::memset(m.data[r], 0xFF, m.size[r]);
  }
}

// The operand list shared by forward and backward handlers, appended to a
// binding (which may already hold context arguments).
template <class Binding>
auto AddInputs(Binding b) {
  return std::move(b)
      .template Arg<ffi::AnyBuffer>()                // q
      .template Arg<ffi::AnyBuffer>()                // k
      .template Arg<ffi::AnyBuffer>()                // v
      .template Arg<ffi::AnyBuffer>()                // bias (or placeholder)
      .template Arg<ffi::AnyBuffer>()                // mask (or placeholder)
      .template Arg<ffi::Buffer<ffi::S32>>()         // q_lengths (or placeholder)
      .template Arg<ffi::Buffer<ffi::S32>>()         // kv_lengths (or placeholder)
      .template Arg<ffi::Buffer<ffi::S32>>()         // q_segment_ids (or placeholder)
      .template Arg<ffi::Buffer<ffi::S32>>();        // kv_segment_ids (or placeholder)
}

}  // namespace fatrain::metal_ffi

XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(fatrain::ffi_glue::Attributes, FATRAIN_ATTRIBUTE_MEMBERS);
