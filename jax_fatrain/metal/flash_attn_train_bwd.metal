// FlashAttention-2 training backward, deterministic (no atomics, no float32
// scratch of K/V size). Three dispatches, in order:
//
//  1. flash_attn_train_bwd_compute_d_{dt}: Delta[b, h, i] = rowsum(dO * O),
//     float32 [B, H_q, qL]; grid (ceil(qL / 32), H_q, B), threadgroup (32, 4, 1).
//  2. flash_attn_train_bwd_dq_{dt}_d{D}: Q tiles outer. Grid (ceil(qL / BQ),
//     H_q, B), threadgroup (32, 4, 1), BQ and BK = dq_block_q / dq_block_k
//     (flash_attn_abi.h). The threadgroup stages its Q and dO rows once and
//     sweeps the visible keys BK at a time through a K and a V tile in
//     threadgroup memory (coalesced vector loads, issued into registers
//     before the math on the other tile and stored after it). Per key step:
//       fetch K_j | dP = dO V_j^T | put K_j  (barrier)
//       fetch V_j+1 | S = Q K_j^T, dS, dQ += dS K_j | put V_j+1  (barrier)
//     (plus one barrier before the partial sums when WN > 1). Simdgroup
//     (wm, wn) owns rows wm * 8 .. +7 and head-dim columns wn * D / WN .. as
//     in the forward, keeping dQ in float32 registers:
//       S = Q K^T, P = exp2(S * scale * log2e + mask * log2e - L * log2e),
//       dP = dO V^T, dS = P * (dP - Delta), dQ += dS K; dQ *= scale.
//     dS is rounded to the input dtype for dS K (exact for f32). The key
//     step's mask and key segment ids are fetched with K_j and staged in
//     threadgroup memory, as in the forward.
//  3. flash_attn_train_bwd_dkdv_{dt}_d{D}: KV tiles outer. Grid (ceil(kL /
//     bwd_block_kv), H_kv, B), threadgroup (32, bwd_dkdv_simdgroups, 1); each
//     threadgroup loops over the query heads of its GQA group and the visible
//     query tiles, keeping dK and dV in registers (transposed scores,
//     rows = keys; see the section above the kernel):
//       S^T = K Q^T, P^T, dP^T = V dO^T, dS^T = P^T * (dP^T - Delta),
//       dV += P^T dO, dK += dS^T Q; dK *= scale.
//
// Or, where the plan's scratch budget allows (the fused backward, 5 tile
// products per block instead of 7), after step 1:
//  2. flash_attn_train_bwd_dkdv_dq_{dt}_d{D}: step 3's kernel over the key
//     tiles of nsplit splits, grid (nsplit, H_kv, B), which also adds dS K
//     into float32 dQ accumulator split s (see the section above dkdv_run);
//  3. flash_attn_train_bwd_dq_reduce_{dt}: dQ = scale * the sum of the splits.
//
// Every output element is written by exactly one thread in a fixed order, so
// results are bitwise reproducible. Rows with L = -inf (they saw no key) get
// P = 0 and therefore zero gradients.
//
// Segment ids: as in the forward, the dQ kernel narrows its key sweep to the
// blocks from the first to the last whose ids meet its query rows' id range,
// the dK/dV kernel its query tiles to those meeting its keys' id range, and
// both skip the math of tiles in between that share no id.
//
// Buffers: Q0 K1 V2 O3 params4 mask_params5 mask6 L8 window9 q_lengths10
// kv_lengths11 dO12 Delta13 dQ14 dK15 dV16 q_segment_ids17 kv_segment_ids18.
// Function constants as in the forward; align_Q / align_K say that qL / kL
// are multiples of the dispatch's own query / key tile (dQ: dq_block_q and
// dq_block_k; dK/dV: bwd_dkdv_block_q and bwd_block_kv).

#include "flash_attn_tiles.h"

template <typename T>
[[kernel, max_total_threads_per_threadgroup(kThreadgroupThreads)]] void flash_attn_train_bwd_compute_d(
    const device T* O [[buffer(FATRAIN_BUF_O)]],
    constant AttnParams* params [[buffer(FATRAIN_BUF_PARAMS)]],
    const device T* dO [[buffer(FATRAIN_BUF_DO)]],
    device float* Delta [[buffer(FATRAIN_BUF_DELTA)]],
    uint3 tid [[threadgroup_position_in_grid]],
    uint simd_gid [[simdgroup_index_in_threadgroup]],
    uint simd_lid [[thread_index_in_simdgroup]]) {
  // Each simdgroup reduces 8 rows; lane i dots the 4-element vectors i,
  // i + 32, ... of a row (coalesced 8- or 16-byte loads), then simd_sum.
  // All 8 rows' loads are issued before the first reduction, so their
  // latencies overlap. Lane r keeps row r's sum, so the 8 results leave in
  // one 32-byte store.
  typedef vec4_t<T> V4;
  const int b = int(tid.z);
  const int h = int(tid.y);
  const int ql = params->ql;
  const int d4 = params->d / 4;
  const long base = long(b) * params->o_strides[0] + long(h) * params->o_strides[1];
  const int row0 = int(tid.x) * (8 * kSimdgroups) + int(simd_gid) * 8;
  const int rows = min(8, ql - row0);  // uniform across the simdgroup
  float part[8];  // this lane's share of each row's dot product
#pragma clang loop unroll(full)
  for (int r = 0; r < 8; ++r) {
    part[r] = 0.0f;
    if (r < rows) {
      const long off = base + long(row0 + r) * params->o_strides[2];
      for (int c = int(simd_lid); c < d4; c += 32) {
        const V4 o = *((const device V4*)(O + (off + 4 * c)));
        const V4 g = *((const device V4*)(dO + (off + 4 * c)));
        part[r] += float(o[0]) * float(g[0]);
        part[r] += float(o[1]) * float(g[1]);
        part[r] += float(o[2]) * float(g[2]);
        part[r] += float(o[3]) * float(g[3]);
      }
    }
  }
  float mine = 0.0f;
#pragma clang loop unroll(full)
  for (int r = 0; r < 8; ++r) {
    const float sum = simd_sum(part[r]);  // every lane joins, rows or not
    if (int(simd_lid) == r) mine = sum;
  }
  if (int(simd_lid) < rows) Delta[(long(b) * params->h + h) * ql + row0 + int(simd_lid)] = mine;
}

template <typename T, int D, typename MaskT, bool kBoolMask>
[[kernel, max_total_threads_per_threadgroup(kThreadgroupThreads)]] void flash_attn_train_bwd_dq(
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
    const device int* q_segment_ids [[buffer(FATRAIN_BUF_Q_SEGMENT_IDS), function_constant(has_segments)]],
    const device int* kv_segment_ids [[buffer(FATRAIN_BUF_KV_SEGMENT_IDS), function_constant(has_segments)]],
    const device T* dO [[buffer(FATRAIN_BUF_DO)]],
    const device float* Delta [[buffer(FATRAIN_BUF_DELTA)]],
    device T* dQ [[buffer(FATRAIN_BUF_DQ)]],
    threadgroup MaskT* Ms [[threadgroup(FATRAIN_TG_MASK_TILE)]],  // the key step's mask (has_mask)
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
  constexpr int LDM = mask_tile_ld(BK, int(sizeof(MaskT)));
  // The mask tile the plan binds for a masked problem, and the key ids.
  constexpr int kScoreBytes = mask_tile_bytes(BQ, BK, int(sizeof(MaskT))) + BK * 4;
  // Q stays in registers (TD fragments) where its tile does not fit beside
  // dO, K, V and the rest (f32, D = 256); it is staged through the K tile then.
  constexpr bool kQInRegs =
      (2 * BQ + 2 * BK) * LD * int(sizeof(T)) + kSx * 4 + kScoreBytes > kMaxThreadgroupBytes;
  constexpr int kQs = kQInRegs ? 0 : BQ * LD;  // elements of the Q tile
  constexpr int kTgBytes = (kQs + (BQ + 2 * BK) * LD) * int(sizeof(T)) + kSx * 4 + kScoreBytes;
  static_assert(kTgBytes <= kMaxThreadgroupBytes, "threadgroup memory over 30 KiB");
  static_assert(WN * BQ == kSimdgroups * 8 && TD * 8 * WN == D, "tile shape");
  static_assert(!kQInRegs || BK >= BQ, "Q is staged through the K tile");
  static_assert(BQ <= 32 && BK <= 32, "segment ranges read one id per lane");

  threadgroup T dOs[BQ * LD + kQs];  // dO rows, then (when staged) Q rows
  threadgroup T Ks[BK * LD];
  threadgroup T Vs[BK * LD];
  threadgroup float Sx[kSx];
  threadgroup int KvIds[BK];       // the key step's segment ids (has_segments)

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
  // Q rows, then the output dQ rows: after dO's, or (Q in registers) the K tile.
  threadgroup T* q_stage = kQInRegs ? Ks : dOs + BQ * LD;

  const long qbase = long(b) * params->q_strides[0] + long(h) * params->q_strides[1];
  const long obase = long(b) * params->o_strides[0] + long(h) * params->o_strides[1];
  const device T* k_ptr = K + long(b) * params->k_strides[0] + long(h_kv) * params->k_strides[1];
  const device T* v_ptr = V + long(b) * params->v_strides[0] + long(h_kv) * params->v_strides[1];
  const long ks = params->k_strides[2];
  const long vs = params->v_strides[2];

  const ScoreCtx<MaskT, kBoolMask> ctx = make_score_ctx<MaskT, kBoolMask>(
      params, mask, mask_params, window, q_lengths, kv_lengths, q_segment_ids, kv_segment_ids,
      b, h, has_mask, do_causal, has_window, has_q_lengths, has_kv_lengths, has_segments);

  const long lrow = (long(b) * params->h + h) * ql + my_row;
  const float L2 = row_in ? L[lrow] * kLog2e : -INFINITY;
  const float delta = row_in ? Delta[lrow] : 0.0f;

  const int2 tg_keys = visible_keys(ctx, q0, q0 + BQ - 1);
  const int2 sg_keys = visible_keys(ctx, r0, r0 + 7);
  int k_first = (tg_keys.x / BK) * BK;
  int k_stop = tg_keys.y;
  const int q_valid = align_Q ? BQ : min(BQ, ql - q0);
  int2 q_ids = int2(0, 0);  // the query rows' segment id range
  int my_id = 0;            // this lane's row's segment id
  if (has_segments && k_first < k_stop) {
    q_ids = segment_range(ctx.q_seg, q0, q_valid, simd_lid);
    narrow_to_segments(ctx.kv_seg, q_ids, BK, kl, &k_first, &k_stop, simd_lid);
    if (my_row < ctx.q_limit) my_id = ctx.q_seg[my_row];
  }

  FragArray<T, kQInRegs ? TD : 0> Qr;  // Q's fragments when Q is not staged
  frag_t dQf[TD];
#pragma clang loop unroll(full)
  for (int dd = 0; dd < TD; ++dd) dQf[dd] = zero_frag();

  if (k_first < k_stop) {
    tile_load<T, BQ, D, LD>(q_stage, Q + qbase, params->q_strides[2], q0, q_valid, tix);
    tile_load<T, BQ, D, LD>(dOs, dO + obase, params->o_strides[2], q0, q_valid, tix);
    tile_load<T, BK, D, LD>(Vs, v_ptr, vs, k_first, align_K ? BK : min(BK, kl - k_first), tix);
    threadgroup_barrier(mem_flags::mem_threadgroup);
    if constexpr (kQInRegs) {
#pragma clang loop unroll(full)
      for (int dd = 0; dd < TD; ++dd) {
        simdgroup_load(Qr.f[dd], Ks + (wm * 8) * LD + c0 + dd * 8, LD);
      }
      threadgroup_barrier(mem_flags::mem_threadgroup);
    }
  }
  TileRegs<T, BK, D> next;  // this thread's share of the next K or V tile
  ScoreTileRegs<MaskT, BQ, BK> next_score;  // ... of the key step's mask and ids
  for (int kb = k_first; kb < k_stop; kb += BK) {
    const int k_valid = align_K ? BK : min(BK, kl - kb);
    // K_j, the mask and the keys' ids, stored after dP.
    tile_fetch<T, BK, D>(next, k_ptr, ks, kb, k_valid, tix);
    score_tile_fetch<MaskT, kBoolMask, BQ, BK>(next_score, ctx, q0, kb, tix);
    const bool meets = !has_segments ||
                       ranges_meet(q_ids, segment_range(ctx.kv_seg, kb, k_valid, simd_lid));
    bool live[TK];
    bool any_live = false;
#pragma clang loop unroll(full)
    for (int t = 0; t < TK; ++t) {
      live[t] = meets && kb + t * 8 < sg_keys.y && kb + t * 8 + 8 > sg_keys.x;
      any_live = any_live || live[t];
    }
    // dP = dO V^T and S = Q K^T over this simdgroup's columns.
    frag_t S[TK];
    frag_t dP[TK];
    if (any_live) {
#pragma clang loop unroll(full)
      for (int t = 0; t < TK; ++t) dP[t] = zero_frag();
#pragma clang loop unroll(full)
      for (int dd = 0; dd < TD; ++dd) {
        simdgroup_matrix<T, 8, 8> dOf;
        simdgroup_load(dOf, dOs + (wm * 8) * LD + c0 + dd * 8, LD);
#pragma clang loop unroll(full)
        for (int t = 0; t < TK; ++t) {
          if (live[t]) {
            simdgroup_matrix<T, 8, 8> Vt;  // row = head dim, col = key
            simdgroup_load(Vt, Vs + (t * 8) * LD + c0 + dd * 8, LD, ulong2(0, 0), true);
            simdgroup_multiply_accumulate(dP[t], dOf, Vt, dP[t]);
          }
        }
      }
    }
    tile_put<T, BK, D, LD>(Ks, next, tix);
    score_tile_put<MaskT, kBoolMask, BQ, BK, LDM>(Ms, KvIds, next_score, ctx, tix);
    threadgroup_barrier(mem_flags::mem_threadgroup);  // K_j, mask and ids stored, V_j read

    const bool more = kb + BK < k_stop;
    if (more) {  // V_j+1, stored after S, dS and dQ
      tile_fetch<T, BK, D>(next, v_ptr, vs, kb + BK, align_K ? BK : min(BK, kl - kb - BK), tix);
    }
    if (any_live) {
#pragma clang loop unroll(full)
      for (int t = 0; t < TK; ++t) S[t] = zero_frag();
#pragma clang loop unroll(full)
      for (int dd = 0; dd < TD; ++dd) {
        simdgroup_matrix<T, 8, 8> Qf;
        if constexpr (kQInRegs) {
          Qf = Qr.f[dd];
        } else {
          simdgroup_load(Qf, q_stage + (wm * 8) * LD + c0 + dd * 8, LD);
        }
#pragma clang loop unroll(full)
        for (int t = 0; t < TK; ++t) {
          if (live[t]) {
            simdgroup_matrix<T, 8, 8> Kt;  // row = head dim, col = key
            simdgroup_load(Kt, Ks + (t * 8) * LD + c0 + dd * 8, LD, ulong2(0, 0), true);
            simdgroup_multiply_accumulate(S[t], Qf, Kt, S[t]);
          }
        }
      }
      if constexpr (WN > 1) {
#pragma clang loop unroll(full)
        for (int t = 0; t < TK; ++t) {
          if (live[t]) {
            simdgroup_store(S[t], Sx + int(simd_gid) * 8 * BK + t * 8, BK);
            simdgroup_store(dP[t], Sx + (kSimdgroups + int(simd_gid)) * 8 * BK + t * 8, BK);
          }
        }
      }
    }
    if constexpr (WN > 1) threadgroup_barrier(mem_flags::mem_threadgroup);  // partials written
    if (any_live) {
      simdgroup_matrix<T, 8, 8> dS[TK];
      const threadgroup MaskT* my_mask = Ms + (wm * 8 + fr) * LDM + fc;
#pragma clang loop unroll(full)
      for (int t = 0; t < TK; ++t) {
        if (live[t]) {
          if constexpr (WN > 1) {
            // Full S and dP: the partials summed in simdgroup order.
            S[t] = zero_frag();
            dP[t] = zero_frag();
#pragma clang loop unroll(full)
            for (int w = 0; w < WN; ++w) {
              frag_t part_s;
              frag_t part_dp;
              simdgroup_load(part_s, Sx + (wm * WN + w) * 8 * BK + t * 8, BK);
              simdgroup_load(part_dp, Sx + (kSimdgroups + wm * WN + w) * 8 * BK + t * 8, BK);
#pragma clang loop unroll(full)
              for (int j = 0; j < 2; ++j) {
                S[t].thread_elements()[j] += part_s.thread_elements()[j];
                dP[t].thread_elements()[j] += part_dp.thread_elements()[j];
              }
            }
          }
          // dS = P * (dP - Delta); P = 0 for masked scores and rows without keys.
#pragma clang loop unroll(full)
          for (int j = 0; j < 2; ++j) {
            const int c = t * 8 + fc + j;  // key kb + c
            const float s = score2_staged(ctx, S[t].thread_elements()[j], my_row, kb + c,
                                          my_mask + t * 8 + j, KvIds + c, my_id);
            const float p = (s == -INFINITY || L2 == -INFINITY) ? 0.0f : fast::exp2(s - L2);
            dS[t].thread_elements()[j] = T(p * (dP[t].thread_elements()[j] - delta));
          }
        }
      }
      // dQ += dS K.
#pragma clang loop unroll(full)
      for (int dd = 0; dd < TD; ++dd) {
#pragma clang loop unroll(full)
        for (int t = 0; t < TK; ++t) {
          if (live[t]) {
            simdgroup_matrix<T, 8, 8> Kf;  // row = key, col = head dim
            simdgroup_load(Kf, Ks + (t * 8) * LD + c0 + dd * 8, LD);
            simdgroup_multiply_accumulate(dQf[dd], dS[t], Kf, dQf[dd]);
          }
        }
      }
    }
    if (more) tile_put<T, BK, D, LD>(Vs, next, tix);
    threadgroup_barrier(mem_flags::mem_threadgroup);  // K_j and Sx read, V_j+1 stored
  }

  // dQ * scale through the Q staging tile, then coalesced row stores.
  const float scale = params->scale;
#pragma clang loop unroll(full)
  for (int dd = 0; dd < TD; ++dd) {
    simdgroup_matrix<T, 8, 8> out;
    out.thread_elements()[0] = T(dQf[dd].thread_elements()[0] * scale);
    out.thread_elements()[1] = T(dQf[dd].thread_elements()[1] * scale);
    simdgroup_store(out, q_stage + (wm * 8) * LD + c0 + dd * 8, LD);
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  tile_store<T, BQ, D, LD>(dQ + qbase, params->q_strides[2], q0, q_valid, q_stage, tix);
}

// ---------------------------------------------------------------------------
// dK/dV, and the fused dK/dV/dQ kernel: KV tiles outer, staged query tiles,
// head dim split across simdgroups.
//
// flash_attn_train_bwd_dkdv: grid (ceil(kL / BKV), H_kv, B); threadgroup x
// owns key tile x. flash_attn_train_bwd_dkdv_dq: grid (nsplit, H_kv, B);
// threadgroup s walks the key tiles of split s, one after another, in the
// fixed "snake" order j = p * nsplit + (p even ? s : nsplit - 1 - s), p = 0,
// 1, ... (each split gets the p-th tile from alternate ends, which evens out
// causal work), and additionally accumulates dQ / scale = dS K into its own
// float32 accumulator split s (FATRAIN_BUF_DQ_ACCUM): the first visit of a
// row tile stores, later visits add, and rows the split never sees get zeros
// (causal: except those above dq_split_first_row, which it neither writes nor
// the reduce reads).
// No other threadgroup touches split s and the visiting order is fixed, so
// the sums are bitwise reproducible; flash_attn_train_bwd_dq_reduce adds the
// splits in split order.
//
// Per key tile, a threadgroup of NSG = bwd_dkdv_simdgroups simdgroups holds
// BKV = bwd_block_kv keys of one kv head and sweeps the query heads of its
// GQA group and, per head, the query tiles of BQ = bwd_dkdv_block_q rows
// that can see one of its keys. Simdgroup sg owns dK and dV of the 8 keys of
// key block ks = sg / DS and of the W = bwd_dkdv_cols head-dim columns c0 =
// (sg % DS) * W, DS = D / W, in float32 registers; every output element has
// one owner and is written once. Per query tile (Q, dO rows staged in
// threadgroup memory; L, Delta too):
//   1. partial scores over the owner's columns:  S^T  += K[:, c0:c0+W] Q^T,
//                                                 dP^T += V[:, c0:c0+W] dO^T;
//   2. DS > 1: the DS simdgroups of a key block exchange their partials
//      through threadgroup memory and each sums them in the same order, so
//      all DS copies of S^T and dP^T are bitwise equal;
//   3. P^T = exp2(S^T * scale * log2e + mask * log2e - L * log2e),
//      dS^T = P^T * (dP^T - Delta) (masked scores and rows with L = -inf give
//      P = 0, so fast::exp2 only sees finite arguments <= ~0), both rounded to
//      the input dtype for the products (as FlashAttention does);
//   4. fused: the first simdgroup of each key block stores dS (query-major)
//      in threadgroup memory; after a barrier simdgroup sg adds
//      dS[rows, :] K[:, cols] into DqFrags 8x8 fragments of the accumulator
//      (read, multiply-accumulate, write back: always the same simdgroup;
//      on the split's first visit of the row tile, no read);
//   5. dV[:, c0:c0+W] += P^T dO[:, c0:c0+W],  dK[:, c0:c0+W] += dS^T Q[:, c0:c0+W].
// dK *= scale when the key tile is done. No matrix product is computed
// twice: 4 products per (query, key) pair, 5 fused.
//
// K and V: 16-bit inputs stage the tile's BKV keys in threadgroup memory
// (W = 64, so 32 accumulator floats per lane); float32 inputs pass V (and K
// when not fused) through the tile buffers into registers, each simdgroup
// keeping its 8 x W slice (W = 32), because staged f32 K and V would leave no
// threadgroup memory for the query tiles at D = 256. The fused kernel needs
// all of K for dS K, so f32 stages K there too.
//
// Staging: threads move 4-element vectors, consecutive lanes on consecutive
// vectors along the head dim (whole cache lines per simdgroup load). A query
// tile's loads are issued before the previous tile's math and stored to
// threadgroup memory after it; with two buffers (where kBwdMaxThreadgroupBytes
// allow) the stores go to the other buffer and one barrier per tile suffices
// (plus one for the partial-score exchange and one for the staged dS). With
// a mask, each query tile's BQ x BKV mask tile is fetched and stored with
// it (vectors along the keys) and takes buffer 1's space, so a masked
// problem stores after a barrier as with one buffer; the rows' segment ids
// are staged with L and Delta, a lane's key id is read once per key tile.
// Scores read the mask and ids there, not per element from device memory.
// Rows are padded by 16 bytes so that 8x8 fragment loads, plain or
// transposed, fall in distinct banks. dK and dV leave through threadgroup
// memory as vector stores. All operands are simdgroup_load-ed in the input
// dtype.
// ---------------------------------------------------------------------------

// 4-element vectors of the input type: device loads and stores move 8 (16-bit)
// or 16 (f32) bytes per lane, consecutive lanes consecutive vectors along the
// head dim. Row starts are 4-element aligned (the plan requires strides that
// are multiples of 4).
template <typename T> struct DkdvVec4;
template <> struct DkdvVec4<bfloat> { typedef bfloat4 type; };
template <> struct DkdvVec4<half> { typedef half4 type; };
template <> struct DkdvVec4<float> { typedef float4 type; };

// The tiles of the dK/dV kernels (kFusedDq: flash_attn_train_bwd_dkdv_dq;
// MB: bytes of a mask element, 1 for bool masks). Threadgroup memory is one
// array of T (K, V, the dS tile, the query-tile buffers, the mask tile where
// it has its own space), one of floats (L and Delta per buffer, the
// partial-score exchange) and one of ints (the query rows' segment ids per
// buffer).
//
// The mask tile (BQ rows x BKV keys, rows padded to LDM) is staged right
// after query-tile buffer 0: with two buffers, a masked problem uses buffer 1's
// space for it and runs the one-buffer schedule (NBUF is fixed per instance,
// the mask is a function constant); with one buffer it has space of its own.
template <typename T, int D, bool kFusedDq, int MB>
struct DkdvShape {
  enum : int {
    ES = int(sizeof(T)),
    NSG = bwd_dkdv_simdgroups(D, ES, kFusedDq),
    NT = bwd_dkdv_threads(D, ES, kFusedDq),
    W = bwd_dkdv_cols(D, ES),
    BKV = bwd_block_kv(D, ES, kFusedDq),
    BQ = bwd_dkdv_block_q(D, ES),
    DS = D / W,     // simdgroups sharing a key block
    KS = NSG / DS,  // key blocks of 8
    WF = W / 8,     // head-dim fragments per simdgroup
    QF = BQ / 8,    // query fragments per tile
    kKInTg = ES == 2 || kFusedDq,  // K staged for the whole tile (else in registers)
    kVInTg = ES == 2,
    LD = D + 16 / ES,    // padded row of a staged Q / dO / K / V tile
    LDS = BKV + 16 / ES, // padded row of the staged dS tile
    NV = BQ * D / (4 * NT),  // staged 4-element vectors per thread per tensor
    kKElems = kKInTg ? BKV * LD : 0,
    kVElems = kVInTg ? BKV * LD : 0,
    kDsElems = kFusedDq ? BQ * LDS : 0,
    kTileElems = 2 * BQ * LD,
    kTileFloats = 2 * BQ,
    kExFloats = DS > 1 ? NSG * 2 * QF * 64 : 0,
    kFixedBytes = (kKElems + kVElems + kDsElems) * ES + kExFloats * 4,
    kBufBytes = kTileElems * ES + kTileFloats * 4,
    NBUF = kFixedBytes + 2 * kBufBytes <= kBwdMaxThreadgroupBytes ? 2 : 1,
    LDM = mask_tile_ld(BKV, MB),  // padded row of the staged mask tile
    kMaskBytes = mask_tile_bytes(BQ, BKV, MB),
    kMaskElems = NBUF == 1 ? (kMaskBytes + ES - 1) / ES : 0,  // its own space (one buffer)
    kInts = NBUF * BQ,  // segment ids of each buffer's query rows
    kTgBytes = kFixedBytes + NBUF * kBufBytes + kMaskElems * ES + kInts * 4,
    kTElems = kKElems + kVElems + kDsElems + NBUF * kTileElems + kMaskElems,
    kFloats = NBUF * kTileFloats + kExFloats,
    kDqFrags = QF * (D / 8) / NSG,  // fused: dQ fragments per simdgroup and tile
  };
};

// Fragments held in registers only by some instances: an empty struct for
// the others, used only under `if constexpr`.
template <typename T, int N, bool kHeld>
struct DkdvRegs {
  simdgroup_matrix<T, 8, 8> f[N];
};
template <typename T, int N>
struct DkdvRegs<T, N, false> {};

// Where the fused kernel accumulates dQ / scale: split s of the accumulators
// (rows x D floats per query head); the plain dK/dV kernel passes DkdvNoDq.
struct DkdvDqAccum {
  device float* acc;  // split s, batch b, query head 0 of the kv head's group
  int rows;
  int first_row;      // dq_split_first_row: the rows above it are neither written nor read
};
struct DkdvNoDq {};

// Fused: zeros in the accumulator rows [first, stop) (multiples of BQ) of
// every query head of the group, through the fragments the dQ step gives
// this simdgroup (so that the same lane later loads them).
template <int D, int BQ, int NSG, int kDqFrags>
inline void dkdv_zero_rows(thread const DkdvDqAccum& dq, int gqa, int first, int stop, int sg) {
  for (int g = 0; g < gqa; ++g) {
    for (int q0 = first; q0 < stop; q0 += BQ) {
      device float* acc = dq.acc + (long(g) * dq.rows + q0) * D;
#pragma clang loop unroll(full)
      for (int i = 0; i < kDqFrags; ++i) {
        const int f = sg * kDqFrags + i;
        simdgroup_store(zero_frag(), acc + (f / (D / 8)) * 8 * D + (f % (D / 8)) * 8, D);
      }
    }
  }
}

// Rows [row0, row0 + ROWS) x D of a device matrix (row stride `stride`) into
// dst[ROWS][LD]; rows >= limit (when guarded) are zeros, never left
// uninitialised. Vector v = i * NT + tid is row v / (D / 4), columns
// (v % (D / 4)) * 4 .. + 3.
template <typename T, int ROWS, int D, int LD, int NT>
inline void dkdv_stage_rows(threadgroup T* dst, const device T* src, long stride, int row0,
                            int limit, bool guard, int tid) {
  typedef typename DkdvVec4<T>::type V;
  constexpr int kVecs = ROWS * D / 4;
  static_assert(kVecs % NT == 0, "rows must split evenly over the threads");
  for (int i = 0; i < kVecs / NT; ++i) {
    const int v = i * NT + tid;
    const int row = v / (D / 4);
    const int col = (v % (D / 4)) * 4;
    V x;  // rows past the limit are zeros
    if (!guard || row0 + row < limit) {
      x = *((const device V*)(src + (long(row0 + row) * stride + col)));
    } else {
      x = V(T(0.0f));
    }
#pragma clang loop unroll(full)
    for (int e = 0; e < 4; ++e) dst[row * LD + col + e] = x[e];
  }
}

// This thread's share of one query tile, loaded before the current tile's
// math and stored to threadgroup memory after it: NV vectors of Q and of dO,
// and one L * log2(e) (threads 0 .. BQ-1) or Delta (threads BQ .. 2 BQ - 1),
// and with segment ids a query row's id (threads 2 BQ .. 3 BQ - 1).
template <typename T, int NV>
struct DkdvTileRun {
  typename DkdvVec4<T>::type q[NV];
  typename DkdvVec4<T>::type dout[NV];
  float ld;
  int q_id;
};

template <typename T, int D, int BQ, int NV, int NT>
inline void dkdv_fetch_tile(thread DkdvTileRun<T, NV>& r, const device T* Q, const device T* dO,
                            const device float* L, const device float* Delta,
                            const device int* q_seg, constant AttnParams* params, int b, int h,
                            int q0, int tid_tg, bool guard_rows, bool segments) {
  typedef typename DkdvVec4<T>::type V;
  const int ql = params->ql;
  const long qbase = long(b) * params->q_strides[0] + long(h) * params->q_strides[1];
  const long obase = long(b) * params->o_strides[0] + long(h) * params->o_strides[1];
#pragma clang loop unroll(full)
  for (int i = 0; i < NV; ++i) {
    const int v = i * NT + tid_tg;
    const int q = q0 + v / (D / 4);
    const int col = (v % (D / 4)) * 4;
    if (!guard_rows || q < ql) {
      r.q[i] = *((const device V*)(Q + (qbase + long(q) * params->q_strides[2] + col)));
      r.dout[i] = *((const device V*)(dO + (obase + long(q) * params->o_strides[2] + col)));
    } else {
      r.q[i] = V(T(0.0f));
      r.dout[i] = V(T(0.0f));
    }
  }
  r.ld = 0.0f;
  if (tid_tg < 2 * BQ) {
    const int lq = q0 + (tid_tg % BQ);
    const long lrow = (long(b) * params->h + h) * ql + lq;
    if (tid_tg < BQ) {
      r.ld = (!guard_rows || lq < ql) ? L[lrow] * kLog2e : -INFINITY;
    } else {
      r.ld = (!guard_rows || lq < ql) ? Delta[lrow] : 0.0f;
    }
  }
  r.q_id = 0;
  if (segments && tid_tg >= 2 * BQ && tid_tg < 3 * BQ) {
    const int sq = q0 + tid_tg - 2 * BQ;
    if (!guard_rows || sq < ql) r.q_id = q_seg[sq];
  }
}

template <typename T, int D, int BQ, int NV, int NT, int LDQ>
inline void dkdv_store_tile(thread const DkdvTileRun<T, NV>& r, threadgroup T* qs,
                            threadgroup T* dos, threadgroup float* lds, threadgroup int* q_ids,
                            int tid_tg, bool segments) {
#pragma clang loop unroll(full)
  for (int i = 0; i < NV; ++i) {
    const int v = i * NT + tid_tg;
    const int row = v / (D / 4);
    const int col = (v % (D / 4)) * 4;
#pragma clang loop unroll(full)
    for (int e = 0; e < 4; ++e) {
      qs[row * LDQ + col + e] = r.q[i][e];
      dos[row * LDQ + col + e] = r.dout[i][e];
    }
  }
  if (tid_tg < 2 * BQ) lds[tid_tg] = r.ld;
  if (segments && tid_tg >= 2 * BQ && tid_tg < 3 * BQ) q_ids[tid_tg - 2 * BQ] = r.q_id;
}

// Query rows [x, y) that may see one of the keys [k0, k_last] through
// causal, window and length limits (masks and segment ids not considered).
template <typename MaskT, bool kBoolMask>
inline int2 dkdv_visible_rows(thread const ScoreCtx<MaskT, kBoolMask>& c, int k0, int k_last) {
  if (k0 >= c.k_limit) return int2(0, 0);
  k_last = min(k_last, c.k_limit - 1);
  int first = 0;
  long stop = c.q_limit;
  if (c.causal) first = max(first, k0 - c.ql_off);
  if (c.window && c.window_right >= 0) first = max(first, k0 - c.window_right);
  if (c.window && c.window_left >= 0) stop = min64(stop, long(k_last) + c.window_left + 1);
  return int2(first, int(stop));
}

// The function constants, passed from the kernels' bodies (where every use of
// a function constant must be visible: the emulator and the stand-in
// specialise a kernel for the constants its body names).
struct DkdvConstants {
  bool align_q, align_k, mask, causal, window, q_lengths, kv_lengths, segments;
};

// The body of both dK/dV kernels. `tg_t` / `tg_f` / `tg_i`: the threadgroup
// arrays of DkdvShape<T, D, kFusedDq, sizeof(MaskT)>; `dq`: the accumulator
// split (fused) or DkdvNoDq; `fcs`: the function constants.
template <typename T, int D, typename MaskT, bool kBoolMask, bool kFusedDq, typename DqOut>
inline void dkdv_run(
    const device T* Q, const device T* K, const device T* V, constant AttnParams* params,
    constant AttnMaskParams* mask_params, const device MaskT* mask, const device float* L,
    constant WindowParams* window, const device int* q_lengths, const device int* kv_lengths,
    const device int* q_segment_ids, const device int* kv_segment_ids, const device T* dO,
    const device float* Delta, device T* dK, device T* dV, thread const DqOut& dq,
    threadgroup T* tg_t, threadgroup float* tg_f, threadgroup int* tg_i,
    thread const DkdvConstants& fcs, int split, int nsplit, uint3 tid, uint simd_gid,
    uint simd_lid) {
  typedef DkdvShape<T, D, kFusedDq, int(sizeof(MaskT))> Sh;
  constexpr int NSG = Sh::NSG, NT = Sh::NT, W = Sh::W, BKV = Sh::BKV, BQ = Sh::BQ;
  constexpr int DS = Sh::DS, WF = Sh::WF, QF = Sh::QF, KS = Sh::KS;
  constexpr int LD = Sh::LD, LDS = Sh::LDS, NV = Sh::NV, NBUF = Sh::NBUF, LDM = Sh::LDM;
  constexpr bool kKInTg = Sh::kKInTg, kVInTg = Sh::kVInTg;
  constexpr int kTileElems = Sh::kTileElems, kTileFloats = Sh::kTileFloats;
  typedef simdgroup_matrix<T, 8, 8> tfrag_t;
  static_assert(KS * 8 == BKV && KS * DS == NSG && DS * W == D, "dK/dV tile shape");
  static_assert(NV >= 1 && NV * 4 * NT == BQ * D && 3 * BQ <= NT, "dK/dV staging shape");
  static_assert(BQ <= 32 && (BKV <= 32 || BKV % 32 == 0), "segment ranges: 32 ids per read");
  static_assert(Sh::kTgBytes <= kBwdMaxThreadgroupBytes, "dK/dV threadgroup memory");
  static_assert(Sh::NBUF == 1 || Sh::kMaskBytes <= kTileElems * int(sizeof(T)),
                "the mask tile fits query-tile buffer 1");
  static_assert(!kFusedDq || (kDqAccumRowAlign % BQ == 0 &&
                              Sh::kDqFrags * NSG == QF * (D / 8) &&
                              (D / 8) % Sh::kDqFrags == 0), "fused dQ tile shape");

  // Threadgroup memory. K and V at the start of a key tile (f32: those kept
  // in registers through the tile buffers) and dK, dV at its end pass
  // through k_stage and v_stage (BKV x LD each).
  threadgroup T* const k_s = tg_t;
  threadgroup T* const v_s = tg_t + Sh::kKElems;
  threadgroup T* const ds_s = v_s + Sh::kVElems;        // fused: dS, [BQ][LDS]
  threadgroup T* const tile_s = ds_s + Sh::kDsElems;    // NBUF x (Q, dO) [BQ][LD]
  // The staged mask tile [BQ][LDM] (has_mask): after buffer 0, i.e. buffer
  // 1's space, or its own space with one buffer. Its rows start 16-byte
  // aligned (every array before it is a multiple of 16 bytes).
  threadgroup MaskT* const mask_s = (threadgroup MaskT*)(tile_s + kTileElems);
  threadgroup float* const tile_f = tg_f;               // NBUF x (L * log2e, Delta)
  threadgroup float* const ex_s = tg_f + NBUF * kTileFloats;  // partial scores
  threadgroup int* const tile_i = tg_i;                  // NBUF x the rows' segment ids
  threadgroup T* const k_stage = kKInTg ? k_s : tile_s;
  threadgroup T* const v_stage = kVInTg ? v_s : (kKInTg ? tile_s : tile_s + BKV * LD);
  static_assert(kKInTg || NBUF * kTileElems >= 2 * BKV * LD, "K and V pass the tile buffers");
  static_assert(kVInTg || NBUF * kTileElems >= (kKInTg ? 1 : 2) * BKV * LD,
                "V passes the tile buffers");

  const int b = int(tid.z);
  const int h_kv = int(tid.y);
  const int kl = params->kl;
  const int gqa = params->gqa_factor;
  const short fr = frag_row(simd_lid);
  const short fc = frag_col(simd_lid);
  const int sg = int(simd_gid);
  const int tid_tg = sg * 32 + int(simd_lid);
  const int ks = sg / DS;
  const int c0 = (sg % DS) * W;

  const long kbase = long(b) * params->k_strides[0] + long(h_kv) * params->k_strides[1];
  const long vbase = long(b) * params->v_strides[0] + long(h_kv) * params->v_strides[1];
  const long kss = params->k_strides[2];
  const long vss = params->v_strides[2];

  // Visibility does not depend on the query head: limits, causal offset and
  // window are per batch.
  const ScoreCtx<MaskT, kBoolMask> ctx0 = make_score_ctx<MaskT, kBoolMask>(
      params, mask, mask_params, window, q_lengths, kv_lengths, q_segment_ids, kv_segment_ids,
      b, h_kv * gqa, fcs.mask, fcs.causal, fcs.window, fcs.q_lengths, fcs.kv_lengths,
      fcs.segments);

  // Fused: the accumulator rows [w_lo, w_hi) of split s hold its sum so far
  // (multiples of BQ; empty at first). A query tile outside them is stored,
  // not added to, on its first visit (no zero fill, one read less); rows
  // between visited tiles are zeroed (windows, segment ids), so that
  // [w_lo, w_hi) stays fully written, and the rows outside it at the end.
  // Each accumulator element is stored, loaded and stored again by the same
  // lane (the same simdgroup owns the same fragments), so no barrier orders
  // them.
  int w_lo = 0, w_hi = 0;

  const int n_kt = (kl + BKV - 1) / BKV;
  for (int pass = 0;; ++pass) {
    const int j = pass * nsplit + ((pass & 1) == 0 ? split : nsplit - 1 - split);
    if (j >= n_kt) break;
    const int kt0 = j * BKV;  // first key of the tile
    const int kb0 = kt0 + 8 * ks;
    const int my_key = kb0 + fr;

    // K and V of the tile, staged with coalesced vector loads; float32 keeps
    // its slices in registers (A operands, row = key).
    dkdv_stage_rows<T, BKV, D, LD, NT>(k_stage, K + kbase, kss, kt0, kl, !fcs.align_k, tid_tg);
    dkdv_stage_rows<T, BKV, D, LD, NT>(v_stage, V + vbase, vss, kt0, kl, !fcs.align_k, tid_tg);
    threadgroup_barrier(mem_flags::mem_threadgroup);
    DkdvRegs<T, WF, !kKInTg> Kr;
    DkdvRegs<T, WF, !kVInTg> Vr;
    if constexpr (!kKInTg || !kVInTg) {
#pragma clang loop unroll(full)
      for (int dd = 0; dd < WF; ++dd) {
        if constexpr (!kKInTg) simdgroup_load(Kr.f[dd], k_stage + ks * 8 * LD + c0 + dd * 8, LD);
        if constexpr (!kVInTg) simdgroup_load(Vr.f[dd], v_stage + ks * 8 * LD + c0 + dd * 8, LD);
      }
      threadgroup_barrier(mem_flags::mem_threadgroup);
    }

    frag_t dKf[WF];
    frag_t dVf[WF];
#pragma clang loop unroll(full)
    for (int dd = 0; dd < WF; ++dd) {
      dKf[dd] = zero_frag();
      dVf[dd] = zero_frag();
    }

    // Query rows that see a key of the tile (tiles start at multiples of BQ),
    // and per key block (uniform across the threadgroup).
    const int2 tg_rows = dkdv_visible_rows(ctx0, kt0, kt0 + BKV - 1);
    int2 blk_rows[KS];
#pragma clang loop unroll(full)
    for (int t = 0; t < KS; ++t) blk_rows[t] = dkdv_visible_rows(ctx0, kt0 + 8 * t, kt0 + 8 * t + 7);
    int q_first = (max(tg_rows.x, 0) / BQ) * BQ;
    int q_stop = tg_rows.y;
    int2 k_ids = int2(0, 0);  // the keys' segment id range
    if (fcs.segments && q_first < q_stop) {
      k_ids = segment_range_wide<(BKV + 31) / 32>(ctx0.kv_seg, kt0, min(BKV, kl - kt0), simd_lid);
      narrow_to_segments(ctx0.q_seg, k_ids, BQ, params->ql, &q_first, &q_stop, simd_lid);
    }
    int my_key_id = 0;  // the segment id of this lane's key (registers, once per key tile)
    if (fcs.segments && q_first < q_stop && my_key < kl) my_key_id = ctx0.kv_seg[my_key];
    const int n_tiles = q_stop > q_first ? (q_stop - q_first + BQ - 1) / BQ : 0;
    const int n_items = n_tiles * gqa;  // (head, tile) pairs, head-major

    // With a mask, each item's BQ x BKV mask tile is fetched with its Q and
    // dO tile (coalesced vectors along the keys) and staged in mask_s, where
    // the scores read it; the tile buffers no longer take turns then, as
    // buffer 1's space (if any) holds the mask tile.
    const bool one_buf = NBUF == 1 || fcs.mask;  // uniform (a function constant)
    DkdvTileRun<T, NV> run;
    MaskTileRegs<MaskT, BQ, BKV, NT> run_mask;  // the next item's mask tile
    if (n_items > 0) {
      dkdv_fetch_tile<T, D, BQ, NV, NT>(run, Q, dO, L, Delta, ctx0.q_seg, params, b,
                                        h_kv * gqa, q_first, tid_tg, !fcs.align_q,
                                        fcs.segments);
      if (fcs.mask) {
        ScoreCtx<MaskT, kBoolMask> mc = ctx0;
        score_ctx_set_head(mc, mask_params, b, h_kv * gqa);
        mask_tile_fetch<MaskT, kBoolMask, BQ, BKV, NT>(run_mask, mc, q_first, kt0, tid_tg);
      }
      dkdv_store_tile<T, D, BQ, NV, NT, LD>(run, tile_s, tile_s + BQ * LD, tile_f, tile_i, tid_tg,
                                            fcs.segments);
      mask_tile_put<MaskT, kBoolMask, BQ, BKV, LDM, NT>(mask_s, run_mask, ctx0, tid_tg);
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);

    for (int it = 0; it < n_items; ++it) {
      const int g = it / n_tiles;
      const int q0 = q_first + (it - g * n_tiles) * BQ;
      const int buf = one_buf ? 0 : (it & 1);
      const threadgroup T* Qs = tile_s + buf * kTileElems;
      const threadgroup T* dOs = Qs + BQ * LD;
      const threadgroup float* Ls = tile_f + buf * kTileFloats;
      const threadgroup float* Dls = Ls + BQ;
      const threadgroup int* Qids = tile_i + buf * BQ;

      // The next tile's loads are issued now and land in registers while
      // this tile's products run.
      const bool has_next = it + 1 < n_items;
      if (has_next) {
        const int gn = (it + 1) / n_tiles;
        const int qn = q_first + (it + 1 - gn * n_tiles) * BQ;
        dkdv_fetch_tile<T, D, BQ, NV, NT>(run, Q, dO, L, Delta, ctx0.q_seg, params, b,
                                          h_kv * gqa + gn, qn, tid_tg, !fcs.align_q,
                                          fcs.segments);
        if (fcs.mask) {
          ScoreCtx<MaskT, kBoolMask> mc = ctx0;
          score_ctx_set_head(mc, mask_params, b, h_kv * gqa + gn);
          mask_tile_fetch<MaskT, kBoolMask, BQ, BKV, NT>(run_mask, mc, qn, kt0, tid_tg);
        }
      }

      // The query rows' segment ids are staged with the tile (Qids).
      bool meets = true;
      if (fcs.segments) {
        meets = ranges_meet(k_ids,
                            segment_range_of(Qids[int(simd_lid) % min(BQ, params->ql - q0)]));
      }
      bool blk_active[KS];
      bool any_active = false;
#pragma clang loop unroll(full)
      for (int t = 0; t < KS; ++t) {
        blk_active[t] = meets && q0 < blk_rows[t].y && q0 + BQ > blk_rows[t].x;
        any_active = any_active || blk_active[t];
      }
      const bool active = blk_active[ks];
      frag_t S[QF];   // S^T (row = key, col = query)
      frag_t dP[QF];  // dP^T
      if (active) {
#pragma clang loop unroll(full)
        for (int qf = 0; qf < QF; ++qf) {
          S[qf] = zero_frag();
          dP[qf] = zero_frag();
        }
#pragma clang loop unroll(full)
        for (int dd = 0; dd < WF; ++dd) {
          tfrag_t ka;  // row = key, col = head dim
          tfrag_t va;
          if constexpr (kKInTg) {
            simdgroup_load(ka, k_s + ks * 8 * LD + c0 + dd * 8, LD);
          } else {
            ka = Kr.f[dd];
          }
          if constexpr (kVInTg) {
            simdgroup_load(va, v_s + ks * 8 * LD + c0 + dd * 8, LD);
          } else {
            va = Vr.f[dd];
          }
#pragma clang loop unroll(full)
          for (int qf = 0; qf < QF; ++qf) {
            tfrag_t qt;  // row = head dim, col = query
            tfrag_t dot;
            simdgroup_load(qt, Qs + qf * 8 * LD + c0 + dd * 8, LD, ulong2(0, 0), true);
            simdgroup_load(dot, dOs + qf * 8 * LD + c0 + dd * 8, LD, ulong2(0, 0), true);
            simdgroup_multiply_accumulate(S[qf], ka, qt, S[qf]);
            simdgroup_multiply_accumulate(dP[qf], va, dot, dP[qf]);
          }
        }
      }
      if constexpr (DS > 1) {
        threadgroup float* mine = ex_s + sg * (2 * QF * 64);
        if (active) {
#pragma clang loop unroll(full)
          for (int qf = 0; qf < QF; ++qf) {
            simdgroup_store(S[qf], mine + qf * 64, 8);
            simdgroup_store(dP[qf], mine + (QF + qf) * 64, 8);
          }
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);
        if (active) {
          const threadgroup float* part = ex_s + ks * DS * (2 * QF * 64);
#pragma clang loop unroll(full)
          for (int qf = 0; qf < QF; ++qf) {
            simdgroup_load(S[qf], part + qf * 64, 8);
            simdgroup_load(dP[qf], part + (QF + qf) * 64, 8);
#pragma clang loop unroll(full)
            for (int p = 1; p < DS; ++p) {
              frag_t ps;
              frag_t pd;
              simdgroup_load(ps, part + p * (2 * QF * 64) + qf * 64, 8);
              simdgroup_load(pd, part + p * (2 * QF * 64) + (QF + qf) * 64, 8);
#pragma clang loop unroll(full)
              for (int e = 0; e < 2; ++e) {
                S[qf].thread_elements()[e] += ps.thread_elements()[e];
                dP[qf].thread_elements()[e] += pd.thread_elements()[e];
              }
            }
          }
        }
      }
      tfrag_t Pt[QF];   // P^T in the input dtype
      tfrag_t dSt[QF];  // dS^T in the input dtype
      if (active) {
        // The mask and the query ids from the staged tiles, the key's id
        // from a register (ctx0: visibility does not depend on the head).
        const threadgroup MaskT* my_mask = mask_s + 8 * ks + fr;  // this lane's key's column
#pragma clang loop unroll(full)
        for (int qf = 0; qf < QF; ++qf) {
#pragma clang loop unroll(full)
          for (int e = 0; e < 2; ++e) {
            const int ql_idx = qf * 8 + fc + e;
            const float L2 = Ls[ql_idx];
            int q_id = 0;
            if (fcs.segments) q_id = Qids[ql_idx];
            const float s = score2_staged(ctx0, S[qf].thread_elements()[e], q0 + ql_idx, my_key,
                                          my_mask + ql_idx * LDM, my_key_id, q_id);
            const float p = (s == -INFINITY || L2 == -INFINITY) ? 0.0f : fast::exp2(s - L2);
            Pt[qf].thread_elements()[e] = T(p);
            dSt[qf].thread_elements()[e] = T(p * (dP[qf].thread_elements()[e] - Dls[ql_idx]));
          }
        }
      }
      if constexpr (kFusedDq) {
        // dQ / scale += dS K: dS staged query-major by the first simdgroup of
        // each key block, then simdgroup sg owns kDqFrags fragments of the
        // BQ x D tile (row block f / (D / 8), consecutive columns).
        if (active && sg % DS == 0) {
#pragma clang loop unroll(full)
          for (int qf = 0; qf < QF; ++qf) {
            simdgroup_store(dSt[qf], ds_s + qf * 8 * LDS + ks * 8, LDS, ulong2(0, 0), true);
          }
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);
        const bool fresh = q0 < w_lo || q0 >= w_hi;  // first visit of the row tile
        if (any_active || fresh) {
          device float* acc = dq.acc + (long(g) * dq.rows + q0) * D;
#pragma clang loop unroll(full)
          for (int i = 0; i < Sh::kDqFrags; ++i) {
            const int f = sg * Sh::kDqFrags + i;
            const int qf = f / (D / 8);
            const int col = (f % (D / 8)) * 8;
            frag_t a = zero_frag();
            if (!fresh) simdgroup_load(a, (const device float*)(acc + qf * 8 * D + col), D);
#pragma clang loop unroll(full)
            for (int t = 0; t < KS; ++t) {
              if (!blk_active[t]) continue;
              tfrag_t dsf;  // row = query, col = key
              tfrag_t kf;   // row = key, col = head dim
              simdgroup_load(dsf, ds_s + qf * 8 * LDS + t * 8, LDS);
              simdgroup_load(kf, k_s + t * 8 * LD + col, LD);
              simdgroup_multiply_accumulate(a, dsf, kf, a);
            }
            simdgroup_store(a, acc + qf * 8 * D + col, D);
          }
        }
      }
      if (active) {
        // dV += P^T dO, dK += dS^T Q over this simdgroup's columns.
#pragma clang loop unroll(full)
        for (int qf = 0; qf < QF; ++qf) {
#pragma clang loop unroll(full)
          for (int dd = 0; dd < WF; ++dd) {
            tfrag_t dof;  // row = query, col = head dim
            tfrag_t qfr;
            simdgroup_load(dof, dOs + qf * 8 * LD + c0 + dd * 8, LD);
            simdgroup_load(qfr, Qs + qf * 8 * LD + c0 + dd * 8, LD);
            simdgroup_multiply_accumulate(dVf[dd], Pt[qf], dof, dVf[dd]);
            simdgroup_multiply_accumulate(dKf[dd], dSt[qf], qfr, dKf[dd]);
          }
        }
      }

      if (!one_buf) {
        // The other buffer was last read in the previous iteration, before
        // its closing barrier.
        if (has_next) {
          threadgroup T* nq = tile_s + (buf ^ 1) * kTileElems;
          dkdv_store_tile<T, D, BQ, NV, NT, LD>(run, nq, nq + BQ * LD,
                                                tile_f + (buf ^ 1) * kTileFloats,
                                                tile_i + (buf ^ 1) * BQ, tid_tg, fcs.segments);
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);
      } else {
        threadgroup_barrier(mem_flags::mem_threadgroup);  // everyone is done with the tile
        if (has_next) {
          dkdv_store_tile<T, D, BQ, NV, NT, LD>(run, tile_s, tile_s + BQ * LD, tile_f, tile_i,
                                                tid_tg, fcs.segments);
          mask_tile_put<MaskT, kBoolMask, BQ, BKV, LDM, NT>(mask_s, run_mask, ctx0, tid_tg);
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);
      }
    }

    if constexpr (kFusedDq) {
      if (n_items > 0) {
        // Rows between this tile's and the ones written before: zeros.
        const int a = q_first, e = q_first + n_tiles * BQ;
        if (w_lo < w_hi) {
          dkdv_zero_rows<D, BQ, NSG, Sh::kDqFrags>(dq, gqa, e, w_lo, sg);
          dkdv_zero_rows<D, BQ, NSG, Sh::kDqFrags>(dq, gqa, w_hi, a, sg);
          w_lo = min(w_lo, a);
          w_hi = max(w_hi, e);
        } else {
          w_lo = a;
          w_hi = e;
        }
      }
    }

    // dK (scaled) and dV through threadgroup memory, then coalesced vector
    // stores; every key of the kv head is written once (keys past k_limit get
    // zeros). The item loop (or the staging, if it ran no tile) ended with a
    // barrier after the last reads of the buffers.
    const float scale = params->scale;
#pragma clang loop unroll(full)
    for (int dd = 0; dd < WF; ++dd) {
      tfrag_t ko;
      tfrag_t vo;
#pragma clang loop unroll(full)
      for (int e = 0; e < 2; ++e) {
        ko.thread_elements()[e] = T(dKf[dd].thread_elements()[e] * scale);
        vo.thread_elements()[e] = T(dVf[dd].thread_elements()[e]);
      }
      simdgroup_store(ko, k_stage + ks * 8 * LD + c0 + dd * 8, LD);
      simdgroup_store(vo, v_stage + ks * 8 * LD + c0 + dd * 8, LD);
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    {
      typedef typename DkdvVec4<T>::type V4;
      constexpr int kVecs = BKV * D / 4;
      static_assert(kVecs % NT == 0, "dK/dV store shape");
#pragma clang loop unroll(full)
      for (int i = 0; i < kVecs / NT; ++i) {
        const int v = i * NT + tid_tg;
        const int row = v / (D / 4);
        const int col = (v % (D / 4)) * 4;
        const int key = kt0 + row;
        if (fcs.align_k || key < kl) {
          const threadgroup T* dk_in = k_stage + row * LD + col;
          const threadgroup T* dv_in = v_stage + row * LD + col;
          *((device V4*)(dK + (kbase + long(key) * kss + col))) =
              V4(dk_in[0], dk_in[1], dk_in[2], dk_in[3]);
          *((device V4*)(dV + (vbase + long(key) * vss + col))) =
              V4(dv_in[0], dv_in[1], dv_in[2], dv_in[3]);
        }
      }
    }
    // The next key tile's staging overwrites what was just read.
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
  if constexpr (kFusedDq) {
    // Rows no key tile of the split sees are zeros for the reduce, from
    // dq.first_row on: causal problems' rows above it stay unwritten (the
    // reduce skips them; no key of the split is visible there, so the
    // visited rows [w_lo, w_hi) start at or below it).
    if (w_lo < w_hi) {
      dkdv_zero_rows<D, BQ, NSG, Sh::kDqFrags>(dq, gqa, dq.first_row, w_lo, sg);
      dkdv_zero_rows<D, BQ, NSG, Sh::kDqFrags>(dq, gqa, w_hi, dq.rows, sg);
    } else {
      dkdv_zero_rows<D, BQ, NSG, Sh::kDqFrags>(dq, gqa, dq.first_row, dq.rows, sg);
    }
  }
}

template <typename T, int D, typename MaskT, bool kBoolMask>
[[kernel, max_total_threads_per_threadgroup(bwd_dkdv_threads(D, sizeof(T)))]] void
flash_attn_train_bwd_dkdv(
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
    const device int* q_segment_ids [[buffer(FATRAIN_BUF_Q_SEGMENT_IDS), function_constant(has_segments)]],
    const device int* kv_segment_ids [[buffer(FATRAIN_BUF_KV_SEGMENT_IDS), function_constant(has_segments)]],
    const device T* dO [[buffer(FATRAIN_BUF_DO)]],
    const device float* Delta [[buffer(FATRAIN_BUF_DELTA)]],
    device T* dK [[buffer(FATRAIN_BUF_DK)]],
    device T* dV [[buffer(FATRAIN_BUF_DV)]],
    uint3 tid [[threadgroup_position_in_grid]],
    uint3 tgs [[threadgroups_per_grid]],
    uint simd_gid [[simdgroup_index_in_threadgroup]],
    uint simd_lid [[thread_index_in_simdgroup]]) {
  typedef DkdvShape<T, D, false, int(sizeof(MaskT))> Sh;
  threadgroup T tg_t[Sh::kTElems];
  threadgroup float tg_f[Sh::kFloats];
  threadgroup int tg_i[Sh::kInts];
  const DkdvNoDq none;
  const DkdvConstants fcs = {align_Q,    align_K,       has_mask,       do_causal,
                             has_window, has_q_lengths, has_kv_lengths, has_segments};
  // One key tile per threadgroup: "split" x of grid-x splits.
  dkdv_run<T, D, MaskT, kBoolMask, false>(
      Q, K, V, params, mask_params, mask, L, window, q_lengths, kv_lengths, q_segment_ids,
      kv_segment_ids, dO, Delta, dK, dV, none, tg_t, tg_f, tg_i, fcs, int(tid.x), int(tgs.x), tid,
      simd_gid, simd_lid);
}

template <typename T, int D, typename MaskT, bool kBoolMask>
[[kernel, max_total_threads_per_threadgroup(bwd_dkdv_threads(D, sizeof(T), true))]] void
flash_attn_train_bwd_dkdv_dq(
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
    const device int* q_segment_ids [[buffer(FATRAIN_BUF_Q_SEGMENT_IDS), function_constant(has_segments)]],
    const device int* kv_segment_ids [[buffer(FATRAIN_BUF_KV_SEGMENT_IDS), function_constant(has_segments)]],
    const device T* dO [[buffer(FATRAIN_BUF_DO)]],
    const device float* Delta [[buffer(FATRAIN_BUF_DELTA)]],
    device T* dK [[buffer(FATRAIN_BUF_DK)]],
    device T* dV [[buffer(FATRAIN_BUF_DV)]],
    device float* dq_accum [[buffer(FATRAIN_BUF_DQ_ACCUM)]],
    constant DqAccumParams* accum [[buffer(FATRAIN_BUF_DQ_ACCUM_PARAMS)]],
    uint3 tid [[threadgroup_position_in_grid]],
    uint simd_gid [[simdgroup_index_in_threadgroup]],
    uint simd_lid [[thread_index_in_simdgroup]]) {
  typedef DkdvShape<T, D, true, int(sizeof(MaskT))> Sh;
  threadgroup T tg_t[Sh::kTElems];
  threadgroup float tg_f[Sh::kFloats];
  threadgroup int tg_i[Sh::kInts];
  const int split = int(tid.x);
  const int rows = accum->rows;
  DkdvDqAccum dq;
  // Split s, batch b, the first query head of kv head h_kv's group.
  dq.acc = dq_accum + ((long(split) * params->b + int(tid.z)) * params->h +
                       long(tid.y) * params->gqa_factor) * rows * D;
  dq.rows = rows;
  dq.first_row = dq_split_first_row(split, accum->causal_block_kv, params->ql_off);
  const DkdvConstants fcs = {align_Q,    align_K,       has_mask,       do_causal,
                             has_window, has_q_lengths, has_kv_lengths, has_segments};
  dkdv_run<T, D, MaskT, kBoolMask, true>(
      Q, K, V, params, mask_params, mask, L, window, q_lengths, kv_lengths, q_segment_ids,
      kv_segment_ids, dO, Delta, dK, dV, dq, tg_t, tg_f, tg_i, fcs, split, accum->nsplit, tid,
      simd_gid, simd_lid);
}

// dQ = scale * (sum of the accumulator splits in split order), in Q's dtype;
// a block of rows sums the splits that wrote it (dq_split_first_row).
// Grid (ceil(qL / kBwdReduceRows), H_q, B), kBwdReduceThreads threads; thread
// t moves the 4-element vectors t, t + kBwdReduceThreads, ... of the rows
// (coalesced 16-byte loads per split, one 8- or 16-byte store).
template <typename T>
[[kernel, max_total_threads_per_threadgroup(kBwdReduceThreads)]] void
flash_attn_train_bwd_dq_reduce(
    constant AttnParams* params [[buffer(FATRAIN_BUF_PARAMS)]],
    device T* dQ [[buffer(FATRAIN_BUF_DQ)]],
    const device float* dq_accum [[buffer(FATRAIN_BUF_DQ_ACCUM)]],
    constant DqAccumParams* accum [[buffer(FATRAIN_BUF_DQ_ACCUM_PARAMS)]],
    uint3 tid [[threadgroup_position_in_grid]],
    uint tix [[thread_index_in_threadgroup]]) {
  typedef typename DkdvVec4<T>::type V4;
  const int b = int(tid.z);
  const int h = int(tid.y);
  const int d = params->d;
  const int d4 = d / 4;
  const int row0 = int(tid.x) * kBwdReduceRows;
  const int n_rows = min(kBwdReduceRows, params->ql - row0);
  const int nsplit = accum->nsplit;
  const long split_stride = long(params->b) * params->h * accum->rows * d;
  const device float* src = dq_accum + ((long(b) * params->h + h) * accum->rows + row0) * d;
  device T* dst = dQ + long(b) * params->q_strides[0] + long(h) * params->q_strides[1];
  const float scale = params->scale;
  // The splits that wrote this block: those whose first row is at or above
  // row0 (all of them unless causal), a prefix of the split order.
  int n_src = 0;
  while (n_src < nsplit &&
         dq_split_first_row(n_src, accum->causal_block_kv, params->ql_off) <= row0) {
    ++n_src;
  }
  for (int v = int(tix); v < n_rows * d4; v += kBwdReduceThreads) {
    const int r = v / d4;
    const long off = long(r) * d + (v - r * d4) * 4;
    float4 sum = float4(0.0f);
    if (n_src > 0) sum = *((const device float4*)(src + off));
    for (int s = 1; s < n_src; ++s) sum += *((const device float4*)(src + s * split_stride + off));
    *((device V4*)(dst + long(row0 + r) * params->q_strides[2] + (v - r * d4) * 4)) =
        V4(T(sum.x * scale), T(sum.y * scale), T(sum.z * scale), T(sum.w * scale));
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

// The fused backward's kernels (flash_attn_abi.h lists them).
#define FATRAIN_INSTANTIATE_FUSED_BWD(name, T, D)                                                \
  template [[host_name("flash_attn_train_bwd_dkdv_dq_" #name "_d" #D)]] [[kernel]]               \
  decltype(flash_attn_train_bwd_dkdv_dq<T, D, T, false>)                                         \
      flash_attn_train_bwd_dkdv_dq<T, D, T, false>;                                              \
  template [[host_name("flash_attn_train_bwd_dkdv_dq_" #name "_d" #D "_boolmask")]] [[kernel]]   \
  decltype(flash_attn_train_bwd_dkdv_dq<T, D, bool, true>)                                       \
      flash_attn_train_bwd_dkdv_dq<T, D, bool, true>;
#define FATRAIN_INSTANTIATE_FUSED_BWD_ALL_D(name, T)                                   \
  template [[host_name("flash_attn_train_bwd_dq_reduce_" #name)]] [[kernel]]           \
  decltype(flash_attn_train_bwd_dq_reduce<T>) flash_attn_train_bwd_dq_reduce<T>;       \
  FATRAIN_METAL_FOR_EACH_HEAD_DIM(FATRAIN_INSTANTIATE_FUSED_BWD, name, T)
FATRAIN_METAL_FOR_EACH_DTYPE(FATRAIN_INSTANTIATE_FUSED_BWD_ALL_D)
