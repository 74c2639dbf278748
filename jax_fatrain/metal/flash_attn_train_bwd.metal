// FlashAttention-2 training backward, deterministic (no atomics, no float32
// scratch of K/V size). Three dispatches, in order:
//
//  1. flash_attn_train_bwd_compute_d_{dt}: Delta[b, h, i] = rowsum(dO * O),
//     float32 [B, H_q, qL]; grid (ceil(qL / 32), H_q, B), threadgroup (32, 4, 1).
//  2. flash_attn_train_bwd_dq_{dt}_d{D}: Q tiles outer. Grid (ceil(qL / BQ),
//     H_q, B), threadgroup (32, 4, 1), BQ and BK = dq_block_q / dq_block_k
//     (flash_attn_abi.h). The threadgroup stages its Q and dO rows once and
//     sweeps the visible keys BK at a time through a K and a V tile in
//     threadgroup memory (coalesced vector loads). Per key step:
//       load K_j | dP = dO V_j^T  (barrier)  load V_j+1 | S = Q K_j^T, dS,
//       dQ += dS K_j  (barrier)
//     (plus one barrier before the partial sums when WN > 1). Simdgroup
//     (wm, wn) owns rows wm * 8 .. +7 and head-dim columns wn * D / WN .. as
//     in the forward, keeping dQ in float32 registers:
//       S = Q K^T, P = exp2(S * scale * log2e + mask * log2e - L * log2e),
//       dP = dO V^T, dS = P * (dP - Delta), dQ += dS K; dQ *= scale.
//     dS is rounded to the input dtype for dS K (exact for f32).
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
// forward, with align_Q = (qL % BQ == 0) and align_K = (kL % BK == 0) for
// dQ, align_Q = (qL % 32 == 0) and align_K = (kL % 32 == 0) for dK/dV.

#include "flash_attn_tiles.h"

template <typename T>
[[kernel]] void flash_attn_train_bwd_compute_d(
    const device T* O [[buffer(FATRAIN_BUF_O)]],
    constant AttnParams* params [[buffer(FATRAIN_BUF_PARAMS)]],
    const device T* dO [[buffer(FATRAIN_BUF_DO)]],
    device float* Delta [[buffer(FATRAIN_BUF_DELTA)]],
    uint3 tid [[threadgroup_position_in_grid]],
    uint simd_gid [[simdgroup_index_in_threadgroup]],
    uint simd_lid [[thread_index_in_simdgroup]]) {
  // Each simdgroup reduces 8 rows; lane i dots the 4-element vectors i,
  // i + 32, ... of a row (coalesced 8- or 16-byte loads), then simd_sum.
  // Lane r keeps row r's sum, so the 8 results leave in one 32-byte store.
  typedef vec4_t<T> V4;
  const int b = int(tid.z);
  const int h = int(tid.y);
  const int ql = params->ql;
  const int d4 = params->d / 4;
  const long base = long(b) * params->o_strides[0] + long(h) * params->o_strides[1];
  const int row0 = int(tid.x) * (8 * kSimdgroups) + int(simd_gid) * 8;
  const int rows = min(8, ql - row0);  // uniform across the simdgroup
  float mine = 0.0f;
  for (int r = 0; r < rows; ++r) {
    const long off = base + long(row0 + r) * params->o_strides[2];
    float acc = 0.0f;
    for (int c = int(simd_lid); c < d4; c += 32) {
      const V4 o = *((const device V4*)(O + (off + 4 * c)));
      const V4 g = *((const device V4*)(dO + (off + 4 * c)));
      acc += float(o[0]) * float(g[0]);
      acc += float(o[1]) * float(g[1]);
      acc += float(o[2]) * float(g[2]);
      acc += float(o[3]) * float(g[3]);
    }
    acc = simd_sum(acc);
    if (int(simd_lid) == r) mine = acc;
  }
  if (int(simd_lid) < rows) Delta[(long(b) * params->h + h) * ql + row0 + int(simd_lid)] = mine;
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
  constexpr int BQ = dq_block_q(D, sizeof(T));
  constexpr int BK = dq_block_k(D, sizeof(T));
  constexpr int WN = kSimdgroups * 8 / BQ;  // simdgroups sharing 8 query rows
  constexpr int DW = D / WN;                // head-dim columns per simdgroup
  constexpr int TD = DW / 8;
  constexpr int TK = BK / 8;
  constexpr int LD = D + kTilePad;
  constexpr int kSx = WN > 1 ? 2 * kSimdgroups * 8 * BK : 1;  // partial S and dP
  // Q stays in registers (TD fragments) where its tile does not fit beside
  // dO, K and V (f32, D = 256); it is staged through the K tile then.
  constexpr bool kQInRegs =
      (2 * BQ + 2 * BK) * LD * int(sizeof(T)) + kSx * 4 > kMaxThreadgroupBytes;
  constexpr int kQs = kQInRegs ? 1 : BQ * LD;
  constexpr int kTgBytes = (kQs + (BQ + 2 * BK) * LD) * int(sizeof(T)) + kSx * 4;
  static_assert(kTgBytes <= kMaxThreadgroupBytes, "threadgroup memory over 32 KiB");
  static_assert(WN * BQ == kSimdgroups * 8 && TD * 8 * WN == D, "tile shape");
  static_assert(!kQInRegs || BK >= BQ, "Q is staged through the K tile");

  threadgroup T Qs[kQs];      // Q rows, then the output dQ rows
  threadgroup T dOs[BQ * LD];
  threadgroup T Ks[BK * LD];
  threadgroup T Vs[BK * LD];
  threadgroup float Sx[kSx];

  const int b = int(tid.z);
  const int h = int(tid.y);
  const int ql = params->ql;
  const int kl = params->kl;
  const int h_kv = h / params->gqa_factor;
  const int tix = int(simd_gid) * 32 + int(simd_lid);
  const int wm = int(simd_gid) / WN;
  const int wn = int(simd_gid) % WN;
  const short fr = frag_row(simd_lid);
  const short fc = frag_col(simd_lid);
  const int q0 = int(tid.x) * BQ;
  const int r0 = q0 + wm * 8;
  const int c0 = wn * DW;
  const int my_row = r0 + fr;
  const bool row_in = align_Q || my_row < ql;
  threadgroup T* q_stage = kQInRegs ? Ks : Qs;

  const long qbase = long(b) * params->q_strides[0] + long(h) * params->q_strides[1];
  const long obase = long(b) * params->o_strides[0] + long(h) * params->o_strides[1];
  const device T* k_ptr = K + long(b) * params->k_strides[0] + long(h_kv) * params->k_strides[1];
  const device T* v_ptr = V + long(b) * params->v_strides[0] + long(h_kv) * params->v_strides[1];
  const long ks = params->k_strides[2];
  const long vs = params->v_strides[2];

  const ScoreCtx<MaskT, kBoolMask> ctx = make_score_ctx<MaskT, kBoolMask>(
      params, mask, mask_params, window, q_lengths, kv_lengths, b, h, has_mask, do_causal,
      has_window, has_q_lengths, has_kv_lengths);

  const long lrow = (long(b) * params->h + h) * ql + my_row;
  const float L2 = row_in ? L[lrow] * kLog2e : -INFINITY;
  const float delta = row_in ? Delta[lrow] : 0.0f;

  const int2 tg_keys = visible_keys(ctx, q0, q0 + BQ - 1);
  const int2 sg_keys = visible_keys(ctx, r0, r0 + 7);
  const int k_first = (tg_keys.x / BK) * BK;
  const int k_stop = tg_keys.y;
  const int q_valid = align_Q ? BQ : min(BQ, ql - q0);

  simdgroup_matrix<T, 8, 8> Qr[kQInRegs ? TD : 1];
  frag_t dQf[TD];
  for (int dd = 0; dd < TD; ++dd) dQf[dd] = zero_frag();

  if (k_first < k_stop) {
    tile_load<T, BQ, D, LD>(q_stage, Q + qbase, params->q_strides[2], q0, q_valid, tix);
    tile_load<T, BQ, D, LD>(dOs, dO + obase, params->o_strides[2], q0, q_valid, tix);
    tile_load<T, BK, D, LD>(Vs, v_ptr, vs, k_first, align_K ? BK : min(BK, kl - k_first), tix);
    threadgroup_barrier(mem_flags::mem_threadgroup);
    if (kQInRegs) {
      for (int dd = 0; dd < TD; ++dd) {
        simdgroup_load(Qr[kQInRegs ? dd : 0], Ks + (wm * 8) * LD + c0 + dd * 8, LD);
      }
      threadgroup_barrier(mem_flags::mem_threadgroup);
    }
  }
  for (int kb = k_first; kb < k_stop; kb += BK) {
    const int k_valid = align_K ? BK : min(BK, kl - kb);
    tile_load<T, BK, D, LD>(Ks, k_ptr, ks, kb, k_valid, tix);  // overlaps dP = dO V^T
    bool live[TK];
    bool any_live = false;
    for (int t = 0; t < TK; ++t) {
      live[t] = kb + t * 8 < sg_keys.y && kb + t * 8 + 8 > sg_keys.x;
      any_live = any_live || live[t];
    }
    // dP = dO V^T and S = Q K^T over this simdgroup's columns.
    frag_t S[TK];
    frag_t dP[TK];
    if (any_live) {
      for (int t = 0; t < TK; ++t) dP[t] = zero_frag();
      for (int dd = 0; dd < TD; ++dd) {
        simdgroup_matrix<T, 8, 8> dOf;
        simdgroup_load(dOf, dOs + (wm * 8) * LD + c0 + dd * 8, LD);
        for (int t = 0; t < TK; ++t) {
          if (!live[t]) continue;
          simdgroup_matrix<T, 8, 8> Vt;  // row = head dim, col = key
          simdgroup_load(Vt, Vs + (t * 8) * LD + c0 + dd * 8, LD, ulong2(0, 0), true);
          simdgroup_multiply_accumulate(dP[t], dOf, Vt, dP[t]);
        }
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);  // K_j loaded, V_j read

    if (kb + BK < k_stop) {  // overlaps S, dS and dQ
      tile_load<T, BK, D, LD>(Vs, v_ptr, vs, kb + BK, align_K ? BK : min(BK, kl - kb - BK), tix);
    }
    if (any_live) {
      for (int t = 0; t < TK; ++t) S[t] = zero_frag();
      for (int dd = 0; dd < TD; ++dd) {
        simdgroup_matrix<T, 8, 8> Qf;
        if (kQInRegs) {
          Qf = Qr[kQInRegs ? dd : 0];
        } else {
          simdgroup_load(Qf, Qs + (wm * 8) * LD + c0 + dd * 8, LD);
        }
        for (int t = 0; t < TK; ++t) {
          if (!live[t]) continue;
          simdgroup_matrix<T, 8, 8> Kt;  // row = head dim, col = key
          simdgroup_load(Kt, Ks + (t * 8) * LD + c0 + dd * 8, LD, ulong2(0, 0), true);
          simdgroup_multiply_accumulate(S[t], Qf, Kt, S[t]);
        }
      }
      if (WN > 1) {
        for (int t = 0; t < TK; ++t) {
          if (!live[t]) continue;
          simdgroup_store(S[t], Sx + int(simd_gid) * 8 * BK + t * 8, BK);
          simdgroup_store(dP[t], Sx + (kSimdgroups + int(simd_gid)) * 8 * BK + t * 8, BK);
        }
      }
    }
    if (WN > 1) threadgroup_barrier(mem_flags::mem_threadgroup);  // partials written
    if (any_live) {
      simdgroup_matrix<T, 8, 8> dS[TK];
      for (int t = 0; t < TK; ++t) {
        if (!live[t]) continue;
        if (WN > 1) {
          // Full S and dP: the partials summed in simdgroup order.
          S[t] = zero_frag();
          dP[t] = zero_frag();
          for (int w = 0; w < WN; ++w) {
            frag_t part_s;
            frag_t part_dp;
            simdgroup_load(part_s, Sx + (wm * WN + w) * 8 * BK + t * 8, BK);
            simdgroup_load(part_dp, Sx + (kSimdgroups + wm * WN + w) * 8 * BK + t * 8, BK);
            for (int j = 0; j < 2; ++j) {
              S[t].thread_elements()[j] += part_s.thread_elements()[j];
              dP[t].thread_elements()[j] += part_dp.thread_elements()[j];
            }
          }
        }
        // dS = P * (dP - Delta); P = 0 for masked scores and rows without keys.
        for (int j = 0; j < 2; ++j) {
          const float s = score2(ctx, S[t].thread_elements()[j], my_row, kb + t * 8 + fc + j);
          const float p = (s == -INFINITY || L2 == -INFINITY) ? 0.0f : fast::exp2(s - L2);
          dS[t].thread_elements()[j] = T(p * (dP[t].thread_elements()[j] - delta));
        }
      }
      // dQ += dS K.
      for (int dd = 0; dd < TD; ++dd) {
        for (int t = 0; t < TK; ++t) {
          if (!live[t]) continue;
          simdgroup_matrix<T, 8, 8> Kf;  // row = key, col = head dim
          simdgroup_load(Kf, Ks + (t * 8) * LD + c0 + dd * 8, LD);
          simdgroup_multiply_accumulate(dQf[dd], dS[t], Kf, dQf[dd]);
        }
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);  // K_j and Sx read, V_j+1 loaded
  }

  // dQ * scale through the Q staging tile, then coalesced row stores.
  const float scale = params->scale;
  for (int dd = 0; dd < TD; ++dd) {
    simdgroup_matrix<T, 8, 8> out;
    out.thread_elements()[0] = T(dQf[dd].thread_elements()[0] * scale);
    out.thread_elements()[1] = T(dQf[dd].thread_elements()[1] * scale);
    simdgroup_store(out, q_stage + (wm * 8) * LD + c0 + dd * 8, LD);
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  tile_store<T, BQ, D, LD>(dQ + qbase, params->q_strides[2], q0, q_valid, q_stage, tix);
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
