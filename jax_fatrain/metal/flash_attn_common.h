// Shared declarations of jax_fatrain's Metal kernels (MSL, Metal 3.1, Apple7+).
//
// Conventions (docs/design.md, "Numerical conventions"): scores S = scale * Q K^T in float32, additive
// mask added after scaling, boolean mask / causal / window / lengths /
// unequal segment ids remove scores; kernels work in base 2 (scores times log2(e)) and store L in
// natural log; a row that sees no key has O = 0, L = -inf and zero gradients.
//
// simdgroup_matrix<float, 8, 8> fragments are filled and read lane by lane
// through thread_elements(), using Apple's per-lane layout: lane l holds row
// frag_row(l), columns frag_col(l) and frag_col(l) + 1 (the layout MLX's
// BaseMMAFrag uses). This keeps every load bounds-guarded without staging
// tiles in threadgroup memory.
#pragma once

#include <metal_stdlib>
#include "flash_attn_abi.h"
using namespace metal;

constant bool align_Q [[function_constant(FATRAIN_FC_ALIGN_Q)]];
constant bool align_K [[function_constant(FATRAIN_FC_ALIGN_K)]];
constant bool has_mask [[function_constant(FATRAIN_FC_HAS_MASK)]];
constant bool do_causal [[function_constant(FATRAIN_FC_DO_CAUSAL)]];
constant bool has_window [[function_constant(FATRAIN_FC_HAS_WINDOW)]];
constant bool has_q_lengths [[function_constant(FATRAIN_FC_HAS_Q_LENGTHS)]];
constant bool has_kv_lengths [[function_constant(FATRAIN_FC_HAS_KV_LENGTHS)]];
constant bool has_segments [[function_constant(FATRAIN_FC_HAS_SEGMENTS)]];

static constant constexpr const float kLog2e = 1.4426950408889634f;
static constant constexpr const float kLn2 = 0.6931471805599453f;

typedef simdgroup_matrix<float, 8, 8> frag_t;

inline short frag_row(uint lane) { return short(((lane / 4) & 4) + ((lane / 2) % 4)); }
inline short frag_col(uint lane) { return short(((lane / 4) & 2) * 2 + (lane % 2) * 2); }

inline frag_t zero_frag() { return make_filled_simdgroup_matrix<float, 8, 8>(0.0f); }

// N fragments of T kept in registers; FragArray<T, 0> is empty, so a kernel
// variant that does not keep them declares no registers at all.
template <typename T, int N>
struct FragArray {
  simdgroup_matrix<T, 8, 8> f[N];
};
template <typename T>
struct FragArray<T, 0> {};

// Which scores a query row may see, and the additive mask, for one (b, h).
template <typename MaskT, bool kBoolMask>
struct ScoreCtx {
  const device MaskT* mask;
  long mask_base;
  long mask_row_stride;
  int q_limit;  // rows >= q_limit see nothing
  int k_limit;  // keys >= k_limit are invisible
  int ql_off;
  int window_left;
  int window_right;
  float scale2;  // scale * log2(e)
  bool use_mask;
  bool mask_vec4;  // mask rows start 4-element aligned: vector loads allowed
  bool causal;
  bool window;
  bool segments;
  const device int* q_seg;   // segment ids of batch b's queries and keys
  const device int* kv_seg;
};

// Whether query i may see key j through the lengths, causal and window limits.
template <typename MaskT, bool kBoolMask>
inline bool sees(thread const ScoreCtx<MaskT, kBoolMask>& c, int i, int j) {
  if (i >= c.q_limit || j >= c.k_limit) return false;
  if (c.causal && j > i + c.ql_off) return false;
  if (c.window) {
    if (c.window_left >= 0 && j < i - c.window_left) return false;
    if (c.window_right >= 0 && j > i + c.window_right) return false;
  }
  return true;
}

// A base-2 score with the mask element m applied: -inf where a bool mask is
// false, else the additive mask (natural log) added in base 2.
template <typename MaskT, bool kBoolMask>
inline float apply_mask(float s, MaskT m) {
  if constexpr (kBoolMask) {
    return m ? s : -INFINITY;
  } else {
    return s + float(m) * kLog2e;
  }
}

// The base-2 score of (query i, key j) from the raw dot product, or -inf;
// segment ids and the mask are read from device memory.
template <typename MaskT, bool kBoolMask>
inline float score2(thread const ScoreCtx<MaskT, kBoolMask>& c, float dot, int i, int j) {
  if (!sees(c, i, j)) return -INFINITY;
  if (c.segments && c.q_seg[i] != c.kv_seg[j]) return -INFINITY;
  const float s = dot * c.scale2;
  if (!c.use_mask) return s;
  return apply_mask<MaskT, kBoolMask>(s, c.mask[c.mask_base + long(i) * c.mask_row_stride + long(j)]);
}

// The same score with the mask value and key j's segment id read from
// threadgroup tiles (mask_at: the (i, j) element of the staged mask tile,
// kv_id_at: key j's staged id) and query i's segment id passed in q_id.
template <typename MaskT, bool kBoolMask>
inline float score2_staged(thread const ScoreCtx<MaskT, kBoolMask>& c, float dot, int i, int j,
                           const threadgroup MaskT* mask_at, const threadgroup int* kv_id_at,
                           int q_id) {
  if (!sees(c, i, j)) return -INFINITY;
  if (c.segments && *kv_id_at != q_id) return -INFINITY;
  const float s = dot * c.scale2;
  if (!c.use_mask) return s;
  return apply_mask<MaskT, kBoolMask>(s, *mask_at);
}

// The same with both segment ids in registers (the dK/dV kernels: the lane's
// key id and query i's id).
template <typename MaskT, bool kBoolMask>
inline float score2_staged(thread const ScoreCtx<MaskT, kBoolMask>& c, float dot, int i, int j,
                           const threadgroup MaskT* mask_at, int kv_id, int q_id) {
  if (!sees(c, i, j)) return -INFINITY;
  if (c.segments && kv_id != q_id) return -INFINITY;
  const float s = dot * c.scale2;
  if (!c.use_mask) return s;
  return apply_mask<MaskT, kBoolMask>(s, *mask_at);
}

// Points c at the mask of batch b, query head h (all else in c is per batch).
template <typename MaskT, bool kBoolMask>
inline void score_ctx_set_head(thread ScoreCtx<MaskT, kBoolMask>& c,
                               constant AttnMaskParams* mask_params, int b, int h) {
  c.mask_base = 0;
  c.mask_row_stride = 0;
  if (c.use_mask) {
    c.mask_base = long(b) * mask_params->m_strides[0] + long(h) * mask_params->m_strides[1];
    c.mask_row_stride = mask_params->m_strides[2];
  }
  c.mask_vec4 = c.mask_base % 4 == 0 && c.mask_row_stride % 4 == 0;
}

// Fills ctx for batch b, query head h (kernels pass their function constants
// explicitly so that every use of a constant is visible in the kernel body).
template <typename MaskT, bool kBoolMask>
inline ScoreCtx<MaskT, kBoolMask> make_score_ctx(
    constant AttnParams* params, const device MaskT* mask, constant AttnMaskParams* mask_params,
    constant WindowParams* window, const device int* q_lengths, const device int* kv_lengths,
    const device int* q_segment_ids, const device int* kv_segment_ids, int b, int h,
    bool use_mask, bool causal, bool use_window, bool use_q_lengths, bool use_kv_lengths,
    bool use_segments) {
  ScoreCtx<MaskT, kBoolMask> c;
  c.mask = mask;
  c.use_mask = use_mask;
  score_ctx_set_head(c, mask_params, b, h);
  c.q_limit = params->ql;
  c.k_limit = params->kl;
  if (use_q_lengths) c.q_limit = min(params->ql, max(0, q_lengths[b]));
  if (use_kv_lengths) c.k_limit = min(params->kl, max(0, kv_lengths[b]));
  c.ql_off = params->ql_off;
  c.causal = causal;
  c.window = use_window;
  c.window_left = use_window ? window->window_left : -1;
  c.window_right = use_window ? window->window_right : -1;
  c.scale2 = params->scale * kLog2e;
  c.segments = use_segments;
  c.q_seg = use_segments ? q_segment_ids + long(b) * params->ql : q_segment_ids;
  c.kv_seg = use_segments ? kv_segment_ids + long(b) * params->kl : kv_segment_ids;
  return c;
}
