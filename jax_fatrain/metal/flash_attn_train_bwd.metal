// FlashAttention-2 training backward, deterministic (no atomics, no float32
// scratch of K/V size). Three dispatches, in order:
//
//  1. flash_attn_train_bwd_compute_d_{dt}: Delta[b, h, i] = rowsum(dO * O),
//     float32 [B, H_q, qL]; grid (ceil(qL / 32), H_q, B), threadgroup (32, 4, 1).
//  2. flash_attn_train_bwd_dq_{dt}_d{D}: Q tiles outer. Grid (ceil(qL / 32),
//     H_q, B), threadgroup (32, 4, 1); each simdgroup owns 8 query rows and
//     sweeps all visible keys, keeping dQ in registers:
//       S = Q K^T, P = exp2(S * scale * log2e + mask * log2e - L * log2e),
//       dP = dO V^T, dS = P * (dP - Delta), dQ += dS K; dQ *= scale.
//  3. flash_attn_train_bwd_dkdv_{dt}_d{D}: KV tiles outer. Grid (ceil(kL / 32),
//     H_kv, B), threadgroup (32, 4, 1); each simdgroup owns 8 keys and loops
//     over the query heads of its GQA group and the visible query rows,
//     keeping dK and dV in registers (transposed scores, rows = keys):
//       S^T = K Q^T, P^T, dP^T = V dO^T, dS^T = P^T * (dP^T - Delta),
//       dV += P^T dO, dK += dS^T Q; dK *= scale.
//
// Every output element is written by exactly one thread in a fixed order, so
// results are bitwise reproducible. Rows with L = -inf (they saw no key) get
// P = 0 and therefore zero gradients.
//
// Buffers: Q0 K1 V2 O3 params4 mask_params5 mask6 L8 window9 q_lengths10
// kv_lengths11 dO12 Delta13 dQ14 dK15 dV16. Function constants as in the
// forward, with align_Q = (qL % 32 == 0) and align_K = (kL % 32 == 0).

#include "flash_attn_common.h"

template <typename T>
[[kernel]] void flash_attn_train_bwd_compute_d(
    const device T* O [[buffer(FATRAIN_BUF_O)]],
    constant AttnParams* params [[buffer(FATRAIN_BUF_PARAMS)]],
    const device T* dO [[buffer(FATRAIN_BUF_DO)]],
    device float* Delta [[buffer(FATRAIN_BUF_DELTA)]],
    uint3 tid [[threadgroup_position_in_grid]],
    uint simd_gid [[simdgroup_index_in_threadgroup]],
    uint simd_lid [[thread_index_in_simdgroup]]) {
  const int b = int(tid.z);
  const int h = int(tid.y);
  const int ql = params->ql;
  const int d = params->d;
  const long base = long(b) * params->o_strides[0] + long(h) * params->o_strides[1];
  for (int r = 0; r < 8; ++r) {
    const int row = int(tid.x) * 32 + int(simd_gid) * 8 + r;
    if (row >= ql) break;  // uniform across the simdgroup
    const long off = base + long(row) * params->o_strides[2];
    float acc = 0.0f;
    for (int c = int(simd_lid); c < d; c += 32) acc += float(O[off + c]) * float(dO[off + c]);
    acc = simd_sum(acc);
    if (simd_lid == 0) Delta[(long(b) * params->h + h) * ql + row] = acc;
  }
}

template <typename T, int D, typename MaskT, bool kBoolMask>
[[kernel]] void flash_attn_train_bwd_dq(
    const device T* Q [[buffer(FATRAIN_BUF_Q)]],
    const device T* K [[buffer(FATRAIN_BUF_K)]],
    const device T* V [[buffer(FATRAIN_BUF_V)]],
    constant AttnParams* params [[buffer(FATRAIN_BUF_PARAMS)]],
    constant AttnMaskParams* mask_params [[buffer(FATRAIN_BUF_MASK_PARAMS), function_constant(has_mask)]],
    const device MaskT* mask [[buffer(FATRAIN_BUF_MASK), function_constant(has_mask)]],
    const device float* L [[buffer(FATRAIN_BUF_L)]],
    constant WindowParams* window [[buffer(FATRAIN_BUF_WINDOW), function_constant(has_window)]],
    const device int* q_lengths [[buffer(FATRAIN_BUF_Q_LENGTHS), function_constant(has_q_lengths)]],
    const device int* kv_lengths [[buffer(FATRAIN_BUF_KV_LENGTHS), function_constant(has_kv_lengths)]],
    const device T* dO [[buffer(FATRAIN_BUF_DO)]],
    const device float* Delta [[buffer(FATRAIN_BUF_DELTA)]],
    device T* dQ [[buffer(FATRAIN_BUF_DQ)]],
    uint3 tid [[threadgroup_position_in_grid]],
    uint simd_gid [[simdgroup_index_in_threadgroup]],
    uint simd_lid [[thread_index_in_simdgroup]]) {
  constexpr int BQ = 32;
  constexpr int BK = 16;
  constexpr int TD = D / 8;
  constexpr int TK = BK / 8;

  const int b = int(tid.z);
  const int h = int(tid.y);
  const int ql = params->ql;
  const int kl = params->kl;
  const int h_kv = h / params->gqa_factor;
  const short fr = frag_row(simd_lid);
  const short fc = frag_col(simd_lid);
  const int row0 = int(tid.x) * BQ + int(simd_gid) * 8;
  const int my_row = row0 + fr;
  const bool row_in = align_Q || my_row < ql;

  const long qbase = long(b) * params->q_strides[0] + long(h) * params->q_strides[1];
  const long obase = long(b) * params->o_strides[0] + long(h) * params->o_strides[1];
  const device T* k_ptr = K + long(b) * params->k_strides[0] + long(h_kv) * params->k_strides[1];
  const device T* v_ptr = V + long(b) * params->v_strides[0] + long(h_kv) * params->v_strides[1];
  const long qs = params->q_strides[2];
  const long os = params->o_strides[2];
  const long ks = params->k_strides[2];
  const long vs = params->v_strides[2];

  const ScoreCtx<MaskT, kBoolMask> ctx = make_score_ctx<MaskT, kBoolMask>(
      params, mask, mask_params, window, q_lengths, kv_lengths, b, h, has_mask, do_causal,
      has_window, has_q_lengths, has_kv_lengths);

  frag_t Qf[TD];
  frag_t dOf[TD];
  frag_t dQf[TD];
  for (int dd = 0; dd < TD; ++dd) {
    for (int j = 0; j < 2; ++j) {
      const int col = dd * 8 + fc + j;
      Qf[dd].thread_elements()[j] = row_in ? float(Q[qbase + long(my_row) * qs + col]) : 0.0f;
      dOf[dd].thread_elements()[j] = row_in ? float(dO[obase + long(my_row) * os + col]) : 0.0f;
    }
    dQf[dd] = zero_frag();
  }
  const long lrow = (long(b) * params->h + h) * ql + my_row;
  const float L2 = row_in ? L[lrow] * kLog2e : -INFINITY;
  const float delta = row_in ? Delta[lrow] : 0.0f;

  int k_begin = 0;
  int k_end = ctx.k_limit;
  if (do_causal) k_end = min(k_end, row0 + 7 + ctx.ql_off + 1);
  if (has_window && ctx.window_right >= 0) k_end = min(k_end, row0 + 7 + ctx.window_right + 1);
  if (has_window && ctx.window_left >= 0) k_begin = max(0, row0 - ctx.window_left);
  k_begin = (k_begin / BK) * BK;
  if (row0 >= ctx.q_limit) k_end = 0;

  for (int kb = k_begin; kb < k_end; kb += BK) {
    frag_t S[TK];
    frag_t dP[TK];
    for (int t = 0; t < TK; ++t) {
      S[t] = zero_frag();
      dP[t] = zero_frag();
      for (int dd = 0; dd < TD; ++dd) {
        frag_t Kt;  // row = head dim, col = key
        frag_t Vt;
        for (int j = 0; j < 2; ++j) {
          const int key = kb + t * 8 + fc + j;
          const bool key_in = align_K || key < kl;
          Kt.thread_elements()[j] = key_in ? float(k_ptr[long(key) * ks + dd * 8 + fr]) : 0.0f;
          Vt.thread_elements()[j] = key_in ? float(v_ptr[long(key) * vs + dd * 8 + fr]) : 0.0f;
        }
        simdgroup_multiply_accumulate(S[t], Qf[dd], Kt, S[t]);
        simdgroup_multiply_accumulate(dP[t], dOf[dd], Vt, dP[t]);
      }
      // dS = P * (dP - Delta), in place of S.
      for (int j = 0; j < 2; ++j) {
        const float s = score2(ctx, S[t].thread_elements()[j], my_row, kb + t * 8 + fc + j);
        const float p = (s == -INFINITY || L2 == -INFINITY) ? 0.0f : exp2(s - L2);
        S[t].thread_elements()[j] = p * (dP[t].thread_elements()[j] - delta);
      }
    }
    // dQ += dS K.
    for (int dd = 0; dd < TD; ++dd) {
      for (int t = 0; t < TK; ++t) {
        frag_t Kf;  // row = key, col = head dim
        const int key = kb + t * 8 + fr;
        for (int j = 0; j < 2; ++j) {
          Kf.thread_elements()[j] =
              (align_K || key < kl) ? float(k_ptr[long(key) * ks + dd * 8 + fc + j]) : 0.0f;
        }
        simdgroup_multiply_accumulate(dQf[dd], S[t], Kf, dQf[dd]);
      }
    }
  }

  if (row_in) {
    const float scale = params->scale;
    for (int dd = 0; dd < TD; ++dd) {
      for (int j = 0; j < 2; ++j) {
        dQ[qbase + long(my_row) * qs + dd * 8 + fc + j] = T(dQf[dd].thread_elements()[j] * scale);
      }
    }
  }
}

template <typename T, int D, typename MaskT, bool kBoolMask>
[[kernel]] void flash_attn_train_bwd_dkdv(
    const device T* Q [[buffer(FATRAIN_BUF_Q)]],
    const device T* K [[buffer(FATRAIN_BUF_K)]],
    const device T* V [[buffer(FATRAIN_BUF_V)]],
    constant AttnParams* params [[buffer(FATRAIN_BUF_PARAMS)]],
    constant AttnMaskParams* mask_params [[buffer(FATRAIN_BUF_MASK_PARAMS), function_constant(has_mask)]],
    const device MaskT* mask [[buffer(FATRAIN_BUF_MASK), function_constant(has_mask)]],
    const device float* L [[buffer(FATRAIN_BUF_L)]],
    constant WindowParams* window [[buffer(FATRAIN_BUF_WINDOW), function_constant(has_window)]],
    const device int* q_lengths [[buffer(FATRAIN_BUF_Q_LENGTHS), function_constant(has_q_lengths)]],
    const device int* kv_lengths [[buffer(FATRAIN_BUF_KV_LENGTHS), function_constant(has_kv_lengths)]],
    const device T* dO [[buffer(FATRAIN_BUF_DO)]],
    const device float* Delta [[buffer(FATRAIN_BUF_DELTA)]],
    device T* dK [[buffer(FATRAIN_BUF_DK)]],
    device T* dV [[buffer(FATRAIN_BUF_DV)]],
    uint3 tid [[threadgroup_position_in_grid]],
    uint simd_gid [[simdgroup_index_in_threadgroup]],
    uint simd_lid [[thread_index_in_simdgroup]]) {
  constexpr int BKV = 32;
  constexpr int TD = D / 8;

  const int b = int(tid.z);
  const int h_kv = int(tid.y);
  const int ql = params->ql;
  const int kl = params->kl;
  const int gqa = params->gqa_factor;
  const short fr = frag_row(simd_lid);
  const short fc = frag_col(simd_lid);
  const int key0 = int(tid.x) * BKV + int(simd_gid) * 8;
  const int my_key = key0 + fr;
  const bool key_in = align_K || my_key < kl;

  const long kbase = long(b) * params->k_strides[0] + long(h_kv) * params->k_strides[1];
  const long vbase = long(b) * params->v_strides[0] + long(h_kv) * params->v_strides[1];
  const long ks = params->k_strides[2];
  const long vs = params->v_strides[2];
  const long qs = params->q_strides[2];
  const long os = params->o_strides[2];

  // This simdgroup's keys (A operands: row = key, col = head dim).
  frag_t Kf[TD];
  frag_t Vf[TD];
  frag_t dKf[TD];
  frag_t dVf[TD];
  for (int dd = 0; dd < TD; ++dd) {
    for (int j = 0; j < 2; ++j) {
      const int col = dd * 8 + fc + j;
      Kf[dd].thread_elements()[j] = key_in ? float(K[kbase + long(my_key) * ks + col]) : 0.0f;
      Vf[dd].thread_elements()[j] = key_in ? float(V[vbase + long(my_key) * vs + col]) : 0.0f;
    }
    dKf[dd] = zero_frag();
    dVf[dd] = zero_frag();
  }

  for (int g = 0; g < gqa; ++g) {
    const int h = h_kv * gqa + g;
    const ScoreCtx<MaskT, kBoolMask> ctx = make_score_ctx<MaskT, kBoolMask>(
        params, mask, mask_params, window, q_lengths, kv_lengths, b, h, has_mask, do_causal,
        has_window, has_q_lengths, has_kv_lengths);
    const device T* q_ptr = Q + long(b) * params->q_strides[0] + long(h) * params->q_strides[1];
    const device T* do_ptr = dO + long(b) * params->o_strides[0] + long(h) * params->o_strides[1];
    const long lbase = (long(b) * params->h + h) * ql;

    // Query rows that can see one of this simdgroup's keys.
    int q_begin = 0;
    int q_end = ctx.q_limit;
    if (do_causal) q_begin = max(q_begin, key0 - ctx.ql_off);
    if (has_window && ctx.window_right >= 0) q_begin = max(q_begin, key0 - ctx.window_right);
    if (has_window && ctx.window_left >= 0) q_end = min(q_end, key0 + 7 + ctx.window_left + 1);
    q_begin = (q_begin / 8) * 8;
    if (key0 >= ctx.k_limit) q_end = 0;

    for (int qb = q_begin; qb < q_end; qb += 8) {
      frag_t ST = zero_frag();   // row = key, col = query
      frag_t dPT = zero_frag();
      for (int dd = 0; dd < TD; ++dd) {
        frag_t Qt;   // row = head dim, col = query
        frag_t dOt;
        for (int j = 0; j < 2; ++j) {
          const int q = qb + fc + j;
          const bool q_in = align_Q || q < ql;
          Qt.thread_elements()[j] = q_in ? float(q_ptr[long(q) * qs + dd * 8 + fr]) : 0.0f;
          dOt.thread_elements()[j] = q_in ? float(do_ptr[long(q) * os + dd * 8 + fr]) : 0.0f;
        }
        simdgroup_multiply_accumulate(ST, Kf[dd], Qt, ST);
        simdgroup_multiply_accumulate(dPT, Vf[dd], dOt, dPT);
      }
      frag_t PT;
      frag_t dST;
      for (int j = 0; j < 2; ++j) {
        const int q = qb + fc + j;
        const bool q_in = align_Q || q < ql;
        const float L2 = q_in ? L[lbase + q] * kLog2e : -INFINITY;
        const float delta = q_in ? Delta[lbase + q] : 0.0f;
        const float s = score2(ctx, ST.thread_elements()[j], q, my_key);
        const float p = (s == -INFINITY || L2 == -INFINITY) ? 0.0f : exp2(s - L2);
        PT.thread_elements()[j] = p;
        dST.thread_elements()[j] = p * (dPT.thread_elements()[j] - delta);
      }
      // dV += P^T dO, dK += dS^T Q.
      const int q_row = qb + fr;
      const bool q_row_in = align_Q || q_row < ql;
      for (int dd = 0; dd < TD; ++dd) {
        frag_t dOf;  // row = query, col = head dim
        frag_t Qf;
        for (int j = 0; j < 2; ++j) {
          const int col = dd * 8 + fc + j;
          dOf.thread_elements()[j] = q_row_in ? float(do_ptr[long(q_row) * os + col]) : 0.0f;
          Qf.thread_elements()[j] = q_row_in ? float(q_ptr[long(q_row) * qs + col]) : 0.0f;
        }
        simdgroup_multiply_accumulate(dVf[dd], PT, dOf, dVf[dd]);
        simdgroup_multiply_accumulate(dKf[dd], dST, Qf, dKf[dd]);
      }
    }
  }

  if (key_in) {
    const float scale = params->scale;
    const long dkbase = long(b) * params->k_strides[0] + long(h_kv) * params->k_strides[1];
    const long dvbase = long(b) * params->v_strides[0] + long(h_kv) * params->v_strides[1];
    for (int dd = 0; dd < TD; ++dd) {
      for (int j = 0; j < 2; ++j) {
        const int col = dd * 8 + fc + j;
        dK[dkbase + long(my_key) * ks + col] = T(dKf[dd].thread_elements()[j] * scale);
        dV[dvbase + long(my_key) * vs + col] = T(dVf[dd].thread_elements()[j]);
      }
    }
  }
}

// One instantiation per (dtype[, head dim, mask kind]), named as
// flash_attn_abi.h lists them.
#define FATRAIN_INSTANTIATE_COMPUTE_D(name, T)                                            \
  template [[host_name("flash_attn_train_bwd_compute_d_" #name)]] [[kernel]]            \
  decltype(flash_attn_train_bwd_compute_d<T>) flash_attn_train_bwd_compute_d<T>;
#define FATRAIN_INSTANTIATE_BWD(name, T, D)                                                   \
  template [[host_name("flash_attn_train_bwd_dq_" #name "_d" #D)]] [[kernel]]                 \
  decltype(flash_attn_train_bwd_dq<T, D, T, false>) flash_attn_train_bwd_dq<T, D, T, false>;  \
  template [[host_name("flash_attn_train_bwd_dq_" #name "_d" #D "_boolmask")]] [[kernel]]     \
  decltype(flash_attn_train_bwd_dq<T, D, bool, true>) flash_attn_train_bwd_dq<T, D, bool, true>; \
  template [[host_name("flash_attn_train_bwd_dkdv_" #name "_d" #D)]] [[kernel]]               \
  decltype(flash_attn_train_bwd_dkdv<T, D, T, false>)                                         \
      flash_attn_train_bwd_dkdv<T, D, T, false>;                                              \
  template [[host_name("flash_attn_train_bwd_dkdv_" #name "_d" #D "_boolmask")]] [[kernel]]   \
  decltype(flash_attn_train_bwd_dkdv<T, D, bool, true>)                                       \
      flash_attn_train_bwd_dkdv<T, D, bool, true>;
#define FATRAIN_INSTANTIATE_BWD_ALL_D(name, T) \
  FATRAIN_INSTANTIATE_COMPUTE_D(name, T)       \
  FATRAIN_METAL_FOR_EACH_HEAD_DIM(FATRAIN_INSTANTIATE_BWD, name, T)
FATRAIN_METAL_FOR_EACH_DTYPE(FATRAIN_INSTANTIATE_BWD_ALL_D)
