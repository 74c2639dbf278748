// FlashAttention-2 training forward: O and the natural-log logsumexp L.
//
// Grid (ceil(qL / 32), H_q, B), threadgroup (32, 4, 1): each of the 4
// simdgroups owns 8 query rows (BQ = 32 = 4 x 8) and sweeps the keys in tiles
// of BK = 16 with an online softmax in base 2. Q K^T and P V are 8x8
// simdgroup_matrix multiply-accumulates in float32. GQA: query head h reads
// kv head h / gqa_factor. No threadgroup memory and no threadgroup barrier:
// simdgroups are independent, so causal / window / length limits let each
// one skip the key tiles it cannot see.
//
// Buffers: Q0 K1 V2 O3 params4 mask_params5 mask6 L8 window9 q_lengths10
// kv_lengths11. Function constants: 200 align_Q (qL % 32 == 0), 201 align_K
// (kL % 16 == 0), 300 has_mask, 301 do_causal, 302 has_window,
// 303 has_q_lengths, 304 has_kv_lengths.

#include "flash_attn_common.h"

template <typename T, int D, typename MaskT, bool kBoolMask>
[[kernel]] void flash_attn_train_fwd(
    const device T* Q [[buffer(0)]],
    const device T* K [[buffer(1)]],
    const device T* V [[buffer(2)]],
    device T* O [[buffer(3)]],
    constant AttnParams* params [[buffer(4)]],
    constant AttnMaskParams* mask_params [[buffer(5), function_constant(has_mask)]],
    const device MaskT* mask [[buffer(6), function_constant(has_mask)]],
    device float* L [[buffer(8)]],
    constant WindowParams* window [[buffer(9), function_constant(has_window)]],
    const device int* q_lengths [[buffer(10), function_constant(has_q_lengths)]],
    const device int* kv_lengths [[buffer(11), function_constant(has_kv_lengths)]],
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

  const device T* q_ptr = Q + long(b) * params->q_strides[0] + long(h) * params->q_strides[1];
  const device T* k_ptr = K + long(b) * params->k_strides[0] + long(h_kv) * params->k_strides[1];
  const device T* v_ptr = V + long(b) * params->v_strides[0] + long(h_kv) * params->v_strides[1];
  device T* o_ptr = O + long(b) * params->o_strides[0] + long(h) * params->o_strides[1];
  const long qs = params->q_strides[2];
  const long ks = params->k_strides[2];
  const long vs = params->v_strides[2];
  const long os = params->o_strides[2];

  const ScoreCtx<MaskT, kBoolMask> ctx = make_score_ctx<MaskT, kBoolMask>(
      params, mask, mask_params, window, q_lengths, kv_lengths, b, h, has_mask, do_causal,
      has_window, has_q_lengths, has_kv_lengths);

  // This simdgroup's Q rows (A operands: row = query, col = head dim).
  frag_t Qf[TD];
  frag_t Of[TD];
  for (int dd = 0; dd < TD; ++dd) {
    for (int j = 0; j < 2; ++j) {
      const int col = dd * 8 + fc + j;
      Qf[dd].thread_elements()[j] = row_in ? float(q_ptr[long(my_row) * qs + col]) : 0.0f;
    }
    Of[dd] = zero_frag();
  }

  // Key tiles this simdgroup can see (uniform across its lanes).
  int k_begin = 0;
  int k_end = ctx.k_limit;
  if (do_causal) k_end = min(k_end, row0 + 7 + ctx.ql_off + 1);
  if (has_window && ctx.window_right >= 0) k_end = min(k_end, row0 + 7 + ctx.window_right + 1);
  if (has_window && ctx.window_left >= 0) k_begin = max(0, row0 - ctx.window_left);
  k_begin = (k_begin / BK) * BK;
  if (row0 >= ctx.q_limit) k_end = 0;

  float m = -INFINITY;  // running max of this lane's row (base 2)
  float l = 0.0f;       // running sum of exp2(s - m)
  for (int kb = k_begin; kb < k_end; kb += BK) {
    // S = Q K^T for BK keys: TK fragments of 8 keys.
    frag_t S[TK];
    for (int t = 0; t < TK; ++t) {
      S[t] = zero_frag();
      for (int dd = 0; dd < TD; ++dd) {
        frag_t Kt;  // row = head dim, col = key
        for (int j = 0; j < 2; ++j) {
          const int key = kb + t * 8 + fc + j;
          Kt.thread_elements()[j] =
              (align_K || key < kl) ? float(k_ptr[long(key) * ks + dd * 8 + fr]) : 0.0f;
        }
        simdgroup_multiply_accumulate(S[t], Qf[dd], Kt, S[t]);
      }
    }
    // Scores, masks and the online softmax (each row lives on 4 lanes that
    // differ in lane bits 0 and 3).
    float tile_max = -INFINITY;
    for (int t = 0; t < TK; ++t) {
      for (int j = 0; j < 2; ++j) {
        const float s = score2(ctx, S[t].thread_elements()[j], my_row, kb + t * 8 + fc + j);
        S[t].thread_elements()[j] = s;
        tile_max = max(tile_max, s);
      }
    }
    tile_max = max(tile_max, simd_shuffle_xor(tile_max, ushort(1)));
    tile_max = max(tile_max, simd_shuffle_xor(tile_max, ushort(8)));
    const float m_new = max(m, tile_max);
    const float m_safe = m_new == -INFINITY ? 0.0f : m_new;
    const float alpha = exp2(m - m_safe);
    float row_sum = 0.0f;
    for (int t = 0; t < TK; ++t) {
      for (int j = 0; j < 2; ++j) {
        const float p = exp2(S[t].thread_elements()[j] - m_safe);
        S[t].thread_elements()[j] = p;
        row_sum += p;
      }
    }
    row_sum += simd_shuffle_xor(row_sum, ushort(1));
    row_sum += simd_shuffle_xor(row_sum, ushort(8));
    l = l * alpha + row_sum;
    m = m_new;
    // O = alpha * O + P V.
    for (int dd = 0; dd < TD; ++dd) {
      Of[dd].thread_elements()[0] *= alpha;
      Of[dd].thread_elements()[1] *= alpha;
      for (int t = 0; t < TK; ++t) {
        frag_t Vf;  // row = key, col = head dim
        const int key = kb + t * 8 + fr;
        for (int j = 0; j < 2; ++j) {
          Vf.thread_elements()[j] =
              (align_K || key < kl) ? float(v_ptr[long(key) * vs + dd * 8 + fc + j]) : 0.0f;
        }
        simdgroup_multiply_accumulate(Of[dd], S[t], Vf, Of[dd]);
      }
    }
  }

  // A row that saw no key: O = 0, L = -inf.
  const float inv_l = l > 0.0f ? 1.0f / l : 0.0f;
  if (row_in) {
    for (int dd = 0; dd < TD; ++dd) {
      for (int j = 0; j < 2; ++j) {
        o_ptr[long(my_row) * os + dd * 8 + fc + j] = T(Of[dd].thread_elements()[j] * inv_l);
      }
    }
    if (fc == 0) {
      L[(long(b) * params->h + h) * ql + my_row] = l > 0.0f ? m * kLn2 + log(l) : -INFINITY;
    }
  }
}

// flash_attn_train.rs's names for bf16 (additive bf16 mask or bool mask); f16 and f32 and
// D = 128 follow the same scheme. The unmasked problem uses the additive
// variant with has_mask = false.
template [[host_name("flash_attn_train_fwd_bf16_d64")]] [[kernel]] decltype(flash_attn_train_fwd<bfloat, 64, bfloat, false>) flash_attn_train_fwd<bfloat, 64, bfloat, false>;
template [[host_name("flash_attn_train_fwd_bf16_d64_boolmask")]] [[kernel]] decltype(flash_attn_train_fwd<bfloat, 64, bool, true>) flash_attn_train_fwd<bfloat, 64, bool, true>;
template [[host_name("flash_attn_train_fwd_bf16_d128")]] [[kernel]] decltype(flash_attn_train_fwd<bfloat, 128, bfloat, false>) flash_attn_train_fwd<bfloat, 128, bfloat, false>;
template [[host_name("flash_attn_train_fwd_bf16_d128_boolmask")]] [[kernel]] decltype(flash_attn_train_fwd<bfloat, 128, bool, true>) flash_attn_train_fwd<bfloat, 128, bool, true>;
template [[host_name("flash_attn_train_fwd_bf16_d256")]] [[kernel]] decltype(flash_attn_train_fwd<bfloat, 256, bfloat, false>) flash_attn_train_fwd<bfloat, 256, bfloat, false>;
template [[host_name("flash_attn_train_fwd_bf16_d256_boolmask")]] [[kernel]] decltype(flash_attn_train_fwd<bfloat, 256, bool, true>) flash_attn_train_fwd<bfloat, 256, bool, true>;
template [[host_name("flash_attn_train_fwd_f16_d64")]] [[kernel]] decltype(flash_attn_train_fwd<half, 64, half, false>) flash_attn_train_fwd<half, 64, half, false>;
template [[host_name("flash_attn_train_fwd_f16_d64_boolmask")]] [[kernel]] decltype(flash_attn_train_fwd<half, 64, bool, true>) flash_attn_train_fwd<half, 64, bool, true>;
template [[host_name("flash_attn_train_fwd_f16_d128")]] [[kernel]] decltype(flash_attn_train_fwd<half, 128, half, false>) flash_attn_train_fwd<half, 128, half, false>;
template [[host_name("flash_attn_train_fwd_f16_d128_boolmask")]] [[kernel]] decltype(flash_attn_train_fwd<half, 128, bool, true>) flash_attn_train_fwd<half, 128, bool, true>;
template [[host_name("flash_attn_train_fwd_f16_d256")]] [[kernel]] decltype(flash_attn_train_fwd<half, 256, half, false>) flash_attn_train_fwd<half, 256, half, false>;
template [[host_name("flash_attn_train_fwd_f16_d256_boolmask")]] [[kernel]] decltype(flash_attn_train_fwd<half, 256, bool, true>) flash_attn_train_fwd<half, 256, bool, true>;
template [[host_name("flash_attn_train_fwd_f32_d64")]] [[kernel]] decltype(flash_attn_train_fwd<float, 64, float, false>) flash_attn_train_fwd<float, 64, float, false>;
template [[host_name("flash_attn_train_fwd_f32_d64_boolmask")]] [[kernel]] decltype(flash_attn_train_fwd<float, 64, bool, true>) flash_attn_train_fwd<float, 64, bool, true>;
template [[host_name("flash_attn_train_fwd_f32_d128")]] [[kernel]] decltype(flash_attn_train_fwd<float, 128, float, false>) flash_attn_train_fwd<float, 128, float, false>;
template [[host_name("flash_attn_train_fwd_f32_d128_boolmask")]] [[kernel]] decltype(flash_attn_train_fwd<float, 128, bool, true>) flash_attn_train_fwd<float, 128, bool, true>;
template [[host_name("flash_attn_train_fwd_f32_d256")]] [[kernel]] decltype(flash_attn_train_fwd<float, 256, float, false>) flash_attn_train_fwd<float, 256, float, false>;
template [[host_name("flash_attn_train_fwd_f32_d256_boolmask")]] [[kernel]] decltype(flash_attn_train_fwd<float, 256, bool, true>) flash_attn_train_fwd<float, 256, bool, true>;
