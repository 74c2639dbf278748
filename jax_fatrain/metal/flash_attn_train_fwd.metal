// FlashAttention-2 training forward: O and the natural-log logsumexp L.
//
// Grid (ceil(qL / BQ), H_q, B), threadgroup (32, 4, 1); BQ and BK (keys per
// step) per head dim and dtype from flash_attn_abi.h. The threadgroup stages
// its BQ query rows once, then sweeps the visible keys BK at a time through
// two threadgroup tiles, K and V, loaded cooperatively with coalesced vector
// loads. Each thread issues its share of a tile's device loads into registers
// before the math on the other tile and stores them to threadgroup memory
// after it:
//
//   fetch V_j | S = Q K_j^T | put V_j  (barrier)
//   fetch K_j+1 | O += P V_j | put K_j+1  (barrier)
//
// so every load's latency overlaps the other operand's math, at two barriers
// per key step. Simdgroup (wm, wn) owns query rows wm * 8 .. +7 and head-dim
// columns wn * D / WN .. (WN = 4 * 8 / BQ simdgroups share a row block at
// D = 256 and f32 D = 128; their partial scores over their columns are summed
// through threadgroup memory, in a fixed order, so all of them hold the same
// scores). Fragments are simdgroup_load-ed from the tiles (K transposed);
// Q K^T and P V are 8x8 simdgroup multiply-accumulates into float32; P is
// rounded to the input dtype for P V (exact for f32). Online softmax in base
// 2 (scores times scale * log2(e)); L is stored in natural log. A simdgroup
// skips the 8-key fragments its rows cannot see (causal, window, lengths).
// Segment ids (packed sequences): the id range of the threadgroup's query
// rows is computed once, the sweep is narrowed to the first through the last
// key block whose ids meet it, and blocks in between that share no id are
// not computed; ids are compared per score. The key step's mask (BQ x BK,
// coalesced vector loads) and its keys' segment ids are fetched with V_j and
// staged in threadgroup memory beside it, so scores read them there.
// A row that sees no key gets O = 0 and L = -inf exactly (masked scores are
// -inf and give p = 0 without evaluating exp2).
//
// Buffers: Q0 K1 V2 O3 params4 mask_params5 mask6 L8 window9 q_lengths10
// kv_lengths11 q_segment_ids17 kv_segment_ids18. Function constants: 200
// align_Q (qL % BQ == 0), 201 align_K (kL % BK == 0), 300 has_mask,
// 301 do_causal, 302 has_window, 303 has_q_lengths, 304 has_kv_lengths,
// 305 has_segments.

#include "flash_attn_tiles.h"

template <typename T, int D, typename MaskT, bool kBoolMask>
[[kernel, max_total_threads_per_threadgroup(kThreadgroupThreads)]] void flash_attn_train_fwd(
    const device T* Q [[buffer(FATRAIN_BUF_Q)]],
    const device T* K [[buffer(FATRAIN_BUF_K)]],
    const device T* V [[buffer(FATRAIN_BUF_V)]],
    device T* O [[buffer(FATRAIN_BUF_O)]],
    constant AttnParams* params [[buffer(FATRAIN_BUF_PARAMS)]],
    constant AttnMaskParams* mask_params [[buffer(FATRAIN_BUF_MASK_PARAMS), function_constant(has_mask)]],
    const device MaskT* mask [[buffer(FATRAIN_BUF_MASK), function_constant(has_mask)]],
    device float* L [[buffer(FATRAIN_BUF_L)]],
    constant WindowParams* window [[buffer(FATRAIN_BUF_WINDOW), function_constant(has_window)]],
    const device int* q_lengths [[buffer(FATRAIN_BUF_Q_LENGTHS), function_constant(has_q_lengths)]],
    const device int* kv_lengths [[buffer(FATRAIN_BUF_KV_LENGTHS), function_constant(has_kv_lengths)]],
    const device int* q_segment_ids [[buffer(FATRAIN_BUF_Q_SEGMENT_IDS), function_constant(has_segments)]],
    const device int* kv_segment_ids [[buffer(FATRAIN_BUF_KV_SEGMENT_IDS), function_constant(has_segments)]],
    threadgroup MaskT* Ms [[threadgroup(FATRAIN_TG_MASK_TILE)]],  // the key step's mask (has_mask)
    uint3 tid [[threadgroup_position_in_grid]],
    uint simd_gid [[simdgroup_index_in_threadgroup]],
    uint simd_lid [[thread_index_in_simdgroup]]) {
  constexpr int BQ = fwd_block_q(D, sizeof(T));
  constexpr int BK = fwd_block_k(D, sizeof(T));
  constexpr int WN = kSimdgroups * 8 / BQ;  // simdgroups sharing 8 query rows
  constexpr int DW = D / WN;                // head-dim columns per simdgroup
  constexpr int TD = DW / 8;
  constexpr int TK = BK / 8;
  constexpr int LD = D + kTilePad;
  constexpr int kSx = WN > 1 ? kSimdgroups * 8 * BK : 1;  // partial scores
  constexpr int LDM = mask_tile_ld(BK, int(sizeof(MaskT)));
  // Static arrays plus the mask tile the plan binds for a masked problem.
  constexpr int kTgBytes = (BQ + 2 * BK) * LD * int(sizeof(T)) + kSx * 4 +
                           mask_tile_bytes(BQ, BK, int(sizeof(MaskT))) + BK * 4;
  static_assert(kTgBytes <= kMaxThreadgroupBytes, "threadgroup memory over 30 KiB");
  static_assert(WN * BQ == kSimdgroups * 8 && TD * 8 * WN == D, "tile shape");
  static_assert(BQ <= 32 && BK <= 32, "segment ranges read one id per lane");

  threadgroup T Qs[BQ * LD];  // Q rows, then the output O rows
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
  const int r0 = q0 + wm * 8;  // this simdgroup's first row
  const int c0 = wn * DW;      // its first head-dim column
  const int my_row = r0 + fr;

  const device T* q_ptr = Q + long(b) * params->q_strides[0] + long(h) * params->q_strides[1];
  const device T* k_ptr = K + long(b) * params->k_strides[0] + long(h_kv) * params->k_strides[1];
  const device T* v_ptr = V + long(b) * params->v_strides[0] + long(h_kv) * params->v_strides[1];
  device T* o_ptr = O + long(b) * params->o_strides[0] + long(h) * params->o_strides[1];
  const long ks = params->k_strides[2];
  const long vs = params->v_strides[2];

  const ScoreCtx<MaskT, kBoolMask> ctx = make_score_ctx<MaskT, kBoolMask>(
      params, mask, mask_params, window, q_lengths, kv_lengths, q_segment_ids, kv_segment_ids,
      b, h, has_mask, do_causal, has_window, has_q_lengths, has_kv_lengths, has_segments);

  // Keys the threadgroup sweeps (uniform) and the keys this simdgroup's rows see.
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

  frag_t Of[TD];
#pragma clang loop unroll(full)
  for (int dd = 0; dd < TD; ++dd) Of[dd] = zero_frag();
  float m = -INFINITY;  // running max of this lane's row (base 2)
  float l = 0.0f;       // this lane's part of the running sum of exp2(s - m)

  if (k_first < k_stop) {
    tile_load<T, BQ, D, LD>(Qs, q_ptr, params->q_strides[2], q0, q_valid, tix);
    tile_load<T, BK, D, LD>(Ks, k_ptr, ks, k_first, align_K ? BK : min(BK, kl - k_first), tix);
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
  TileRegs<T, BK, D> next;  // this thread's share of the next K or V tile
  ScoreTileRegs<MaskT, BQ, BK> next_score;  // ... of the key step's mask and ids
  for (int kb = k_first; kb < k_stop; kb += BK) {
    const int k_valid = align_K ? BK : min(BK, kl - kb);
    // V_j, the mask and the keys' ids, stored after S.
    tile_fetch<T, BK, D>(next, v_ptr, vs, kb, k_valid, tix);
    score_tile_fetch<MaskT, kBoolMask, BQ, BK>(next_score, ctx, q0, kb, tix);

    // S = Q K^T over this simdgroup's columns, for the 8-key fragments its
    // rows can see (uniform across the simdgroup), in a block whose segment
    // ids meet the rows'.
    const bool meets = !has_segments ||
                       ranges_meet(q_ids, segment_range(ctx.kv_seg, kb, k_valid, simd_lid));
    bool live[TK];
    bool any_live = false;
#pragma clang loop unroll(full)
    for (int t = 0; t < TK; ++t) {
      live[t] = meets && kb + t * 8 < sg_keys.y && kb + t * 8 + 8 > sg_keys.x;
      any_live = any_live || live[t];
    }
    frag_t S[TK];
    if (any_live) {
#pragma clang loop unroll(full)
      for (int t = 0; t < TK; ++t) S[t] = zero_frag();
#pragma clang loop unroll(full)
      for (int dd = 0; dd < TD; ++dd) {
        simdgroup_matrix<T, 8, 8> Qf;
        simdgroup_load(Qf, Qs + (wm * 8) * LD + c0 + dd * 8, LD);
#pragma clang loop unroll(full)
        for (int t = 0; t < TK; ++t) {
          if (live[t]) {
            simdgroup_matrix<T, 8, 8> Kf;  // row = head dim, col = key
            simdgroup_load(Kf, Ks + (t * 8) * LD + c0 + dd * 8, LD, ulong2(0, 0), true);
            simdgroup_multiply_accumulate(S[t], Qf, Kf, S[t]);
          }
        }
      }
      if constexpr (WN > 1) {
#pragma clang loop unroll(full)
        for (int t = 0; t < TK; ++t) {
          if (live[t]) simdgroup_store(S[t], Sx + int(simd_gid) * 8 * BK + t * 8, BK);
        }
      }
    }
    tile_put<T, BK, D, LD>(Vs, next, tix);
    score_tile_put<MaskT, kBoolMask, BQ, BK, LDM>(Ms, KvIds, next_score, ctx, tix);
    // V_j, mask and ids stored, K_j read, Sx written.
    threadgroup_barrier(mem_flags::mem_threadgroup);

    const bool more = kb + BK < k_stop;
    if (more) {  // K_j+1, stored after O += P V_j
      tile_fetch<T, BK, D>(next, k_ptr, ks, kb + BK, align_K ? BK : min(BK, kl - kb - BK), tix);
    }
    if (any_live) {
      if constexpr (WN > 1) {
        // Full scores: the partials of the WN simdgroups of this row block,
        // summed in simdgroup order (identical in all of them).
#pragma clang loop unroll(full)
        for (int t = 0; t < TK; ++t) {
          if (live[t]) {
            S[t] = zero_frag();
#pragma clang loop unroll(full)
            for (int w = 0; w < WN; ++w) {
              frag_t part;
              simdgroup_load(part, Sx + (wm * WN + w) * 8 * BK + t * 8, BK);
              S[t].thread_elements()[0] += part.thread_elements()[0];
              S[t].thread_elements()[1] += part.thread_elements()[1];
            }
          }
        }
      }
      // Online softmax; masked scores are -inf.
      float tile_max = -INFINITY;
      const threadgroup MaskT* my_mask = Ms + (wm * 8 + fr) * LDM + fc;
#pragma clang loop unroll(full)
      for (int t = 0; t < TK; ++t) {
#pragma clang loop unroll(full)
        for (int j = 0; j < 2; ++j) {
          const int c = t * 8 + fc + j;  // key kb + c
          const float s = live[t] ? score2_staged(ctx, S[t].thread_elements()[j], my_row, kb + c,
                                                  my_mask + t * 8 + j, KvIds + c, my_id)
                                  : -INFINITY;
          S[t].thread_elements()[j] = s;
          tile_max = max(tile_max, s);
        }
      }
      const float m_new = max(m, row_max4(tile_max));
      const float alpha = m == -INFINITY ? 0.0f : fast::exp2(m - m_new);
      simdgroup_matrix<T, 8, 8> P[TK];
      float part_sum = 0.0f;
#pragma clang loop unroll(full)
      for (int t = 0; t < TK; ++t) {
#pragma clang loop unroll(full)
        for (int j = 0; j < 2; ++j) {
          const float s = S[t].thread_elements()[j];
          const float p = s == -INFINITY ? 0.0f : fast::exp2(s - m_new);
          part_sum += p;
          P[t].thread_elements()[j] = T(p);
        }
      }
      l = l * alpha + part_sum;
      m = m_new;
      // O = alpha * O + P V.
#pragma clang loop unroll(full)
      for (int dd = 0; dd < TD; ++dd) {
        Of[dd].thread_elements()[0] *= alpha;
        Of[dd].thread_elements()[1] *= alpha;
#pragma clang loop unroll(full)
        for (int t = 0; t < TK; ++t) {
          if (live[t]) {
            simdgroup_matrix<T, 8, 8> Vf;  // row = key, col = head dim
            simdgroup_load(Vf, Vs + (t * 8) * LD + c0 + dd * 8, LD);
            simdgroup_multiply_accumulate(Of[dd], P[t], Vf, Of[dd]);
          }
        }
      }
    }
    if (more) tile_put<T, BK, D, LD>(Ks, next, tix);
    threadgroup_barrier(mem_flags::mem_threadgroup);  // K_j+1 stored, V_j and Sx read
  }

  // O = O / l through the Q tile (no longer read), then coalesced row stores.
  // A row that saw no key: l = 0, O = 0, L = -inf. A NaN or +inf score makes
  // l NaN, and that NaN reaches O and L (the backward then spreads it).
  l = row_sum4(l);
  const float inv_l = l > 0.0f ? 1.0f / l : 0.0f;
#pragma clang loop unroll(full)
  for (int dd = 0; dd < TD; ++dd) {
    simdgroup_matrix<T, 8, 8> Ot;
    Ot.thread_elements()[0] = T(Of[dd].thread_elements()[0] * inv_l);
    Ot.thread_elements()[1] = T(Of[dd].thread_elements()[1] * inv_l);
    simdgroup_store(Ot, Qs + (wm * 8) * LD + c0 + dd * 8, LD);
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  tile_store<T, BQ, D, LD>(o_ptr, params->o_strides[2], q0, q_valid, Qs, tix);
  if (wn == 0 && fc == 0 && (align_Q || my_row < ql)) {
    L[(long(b) * params->h + h) * ql + my_row] =
        (l > 0.0f || isnan(l)) ? m * kLn2 + log(l) : -INFINITY;
  }
}

// One instantiation per (dtype, head dim, mask kind), named as
// flash_attn_abi.h lists them. The unmasked problem uses the additive variant
// with has_mask = false.
#define FATRAIN_INSTANTIATE_FWD(name, T, D)                                                   \
  template [[host_name("flash_attn_train_fwd_" #name "_d" #D)]] [[kernel]]                    \
  decltype(flash_attn_train_fwd<T, D, T, false>) flash_attn_train_fwd<T, D, T, false>;        \
  template [[host_name("flash_attn_train_fwd_" #name "_d" #D "_boolmask")]] [[kernel]]        \
  decltype(flash_attn_train_fwd<T, D, bool, true>) flash_attn_train_fwd<T, D, bool, true>;
#define FATRAIN_INSTANTIATE_FWD_ALL_D(name, T) \
  FATRAIN_METAL_FOR_EACH_HEAD_DIM(FATRAIN_INSTANTIATE_FWD, name, T)
FATRAIN_METAL_FOR_EACH_DTYPE(FATRAIN_INSTANTIATE_FWD_ALL_D)
