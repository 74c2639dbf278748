// What the two FFI front ends of the Metal kernels share: `metal` (the macOS
// host, cpp/ffi/metal_ffi.cc) and `metal_emulated` (the MSL emulator,
// cpp/ffi/metal_emulated_ffi.cc). Both map XLA buffers and the attribute
// dictionary of the cpu target (jax_fatrain/_backends/_ffi.py) onto a
// metal_plan::Problem (the shared AttentionProblem plus the operands' layout)
// and onto host memory per plan role; they differ only in who executes the
// plan.
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

// The attribute dictionary of every backend (attention_ffi.h).
using fatrain::ffi_glue::Attributes;

// `who` prefixes every message, e.g. "jax_fatrain metal".
inline ffi::Error InvalidArgument(const char* who, const std::string& message) {
  return ffi::Error(ffi::ErrorCode::kInvalidArgument, std::string(who) + ": " + message);
}

// A failure of the plan or of its execution.
inline ffi::Error Status(const char* who, const std::string& err) {
  return fatrain::ffi_glue::Status(who, err, ffi::ErrorCode::kInternal);
}

// q, k, v, the optional operands and the attributes, through the checks
// every backend shares (attention_ffi.h), then the plan's own (mp::validate).
inline ffi::Error BuildProblem(const char* who, const Attributes& a, const ffi::AnyBuffer& q,
                               const ffi::AnyBuffer& k, const ffi::AnyBuffer& v,
                               const ffi::AnyBuffer& bias, const ffi::AnyBuffer& mask,
                               const ffi::Buffer<ffi::S32>& q_lengths,
                               const ffi::Buffer<ffi::S32>& kv_lengths,
                               const ffi::Buffer<ffi::S32>& q_segment_ids,
                               const ffi::Buffer<ffi::S32>& kv_segment_ids, mp::Problem* p) {
  SeqTensor qt, kt, vt;
  auto no_backend_checks = [](const AttentionProblem&) -> const char* { return nullptr; };
  if (std::string e = fatrain::ffi_glue::BuildProblem(a, q, k, v, bias, mask, q_lengths,
                                                      kv_lengths, q_segment_ids,
                                                      kv_segment_ids, no_backend_checks, p,
                                                      &qt, &kt, &vt);
      !e.empty()) {
    return InvalidArgument(who, e);
  }
  p->dtype = qt.dtype;
  const SeqTensor* from[3] = {&qt, &kt, &vt};
  mp::Strides* to[3] = {&p->q, &p->k, &p->v};
  for (int i = 0; i < 3; ++i) {
    to[i]->batch = from[i]->batch_stride;
    to[i]->head = from[i]->head_stride;
    to[i]->seq = from[i]->seq_stride;
  }
  p->o = p->q;
  if (std::string e = mp::validate(*p); !e.empty()) return InvalidArgument(who, e);
  return ffi::Error::Success();
}

inline void SetOptional(const Attributes& a, ffi::AnyBuffer& bias, ffi::AnyBuffer& mask,
                        ffi::Buffer<ffi::S32>& ql, ffi::Buffer<ffi::S32>& kl,
                        ffi::Buffer<ffi::S32>& q_seg, ffi::Buffer<ffi::S32>& kv_seg,
                        mp::RoleBuffers* m) {
  if (a.has_bias) m->set(mp::Role::kMask, bias.untyped_data(), bias.size_bytes());
  if (a.has_mask) m->set(mp::Role::kMask, mask.untyped_data(), mask.size_bytes());
  if (a.has_q_lengths) m->set(mp::Role::kQLengths, ql.untyped_data(), ql.size_bytes());
  if (a.has_kv_lengths) m->set(mp::Role::kKVLengths, kl.untyped_data(), kl.size_bytes());
  if (a.has_segment_ids) {
    m->set(mp::Role::kQSegmentIds, q_seg.untyped_data(), q_seg.size_bytes());
    m->set(mp::Role::kKVSegmentIds, kv_seg.untyped_data(), kv_seg.size_bytes());
  }
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
  if (auto e = BuildProblem(who, attrs, q, k, v, bias, mask, q_lengths, kv_lengths,
                            q_segment_ids, kv_segment_ids, p);
      e.failure()) {
    return e;
  }
  if (std::string e = mp::plan_forward(*p, plan); !e.empty()) return InvalidArgument(who, e);
  m->set(mp::Role::kQ, q.untyped_data(), q.size_bytes());
  m->set(mp::Role::kK, k.untyped_data(), k.size_bytes());
  m->set(mp::Role::kV, v.untyped_data(), v.size_bytes());
  m->set(mp::Role::kO, o.untyped_data(), o.size_bytes(), /*is_output=*/true);
  m->set(mp::Role::kL, lse.untyped_data(), lse.size_bytes(), /*is_output=*/true);
  SetOptional(attrs, bias, mask, q_lengths, kv_lengths, q_segment_ids, kv_segment_ids, m);
  return ffi::Error::Success();
}

// The backward plan's options: the GPU's core count (0: not known; the
// caller's, see plan.h) and the test hooks, read at every call (unset: the
// plan's own choice): JAX_FATRAIN_METAL_BWD_NSPLIT=n asks the fused backward
// for n dQ accumulator splits, JAX_FATRAIN_METAL_BWD_SCRATCH_BUDGET=bytes
// replaces its scratch budget (0: always the two-kernel backward).
inline mp::BackwardOptions PlanBackwardOptions(int gpu_cores) {
  mp::BackwardOptions o;
  o.gpu_cores = gpu_cores;
  if (const char* v = std::getenv("JAX_FATRAIN_METAL_BWD_NSPLIT"); v != nullptr && v[0] != 0) {
    o.force_nsplit = std::atoi(v);
  }
  if (const char* v = std::getenv("JAX_FATRAIN_METAL_BWD_SCRATCH_BUDGET");
      v != nullptr && v[0] != 0) {
    o.scratch_budget = std::strtoull(v, nullptr, 10);
  }
  return o;
}

// Backward: problem, plan and memory per role (dQ, dK and dV are outputs);
// `gpu_cores`: the core count of the GPU that runs the plan (0: not known).
inline ffi::Error PrepareBackward(const char* who, const Attributes& attrs, ffi::AnyBuffer& q,
                                  ffi::AnyBuffer& k, ffi::AnyBuffer& v, ffi::AnyBuffer& bias,
                                  ffi::AnyBuffer& mask, ffi::Buffer<ffi::S32>& q_lengths,
                                  ffi::Buffer<ffi::S32>& kv_lengths,
                                  ffi::Buffer<ffi::S32>& q_segment_ids,
                                  ffi::Buffer<ffi::S32>& kv_segment_ids, ffi::AnyBuffer& o,
                                  ffi::AnyBuffer& lse, ffi::AnyBuffer& d_o, ffi::AnyBuffer& dq,
                                  ffi::AnyBuffer& dk, ffi::AnyBuffer& dv, mp::Problem* p,
                                  mp::Plan* plan, mp::RoleBuffers* m, int gpu_cores) {
  if (auto e = BuildProblem(who, attrs, q, k, v, bias, mask, q_lengths, kv_lengths,
                            q_segment_ids, kv_segment_ids, p);
      e.failure()) {
    return e;
  }
  if (std::string e = mp::plan_backward(*p, plan, PlanBackwardOptions(gpu_cores)); !e.empty()) {
    return InvalidArgument(who, e);
  }
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
  SetOptional(attrs, bias, mask, q_lengths, kv_lengths, q_segment_ids, kv_segment_ids, m);
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
