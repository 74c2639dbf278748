// The per-warpgroup pieces of the Hopper forward kernels (internal): the
// online softmax of one 64 x BK score tile in wgmma accumulator layout, the
// rescale of O, and the final O / logsumexp store (hopper_fwd_ws.cu).
#pragma once

#include "cuda/common.cuh"
#include "cuda/wgmma.cuh"

namespace fatrain::cuda {

// A consumer warpgroup's running state before its first tile: O, S and P
// zeroed (the first wgmma of each overwrites or accumulates onto them), row
// max -inf, row sum 0.
template <int D, int BK>
__device__ __forceinline__ void init_fwd_state(float (&o)[D / 2], float (&s)[BK / 2],
                                               uint32_t (&pv)[BK / 4], float (&m)[2],
                                               float (&l)[2]) {
#pragma unroll
  for (int i = 0; i < D / 2; ++i) o[i] = 0.f;
#pragma unroll
  for (int i = 0; i < BK / 2; ++i) s[i] = 0.f;
#pragma unroll
  for (int i = 0; i < BK / 4; ++i) pv[i] = 0u;
  m[0] = m[1] = -INFINITY;
  l[0] = l[1] = 0.f;
}

// Issues (and commits, without waiting) S = Q Kᵀ for the warpgroup's 64
// query rows: q_desc, the step-0 descriptor of those rows of the SW128 Q tile
// (QROWS rows in all; desc_k_major<QROWS>(sQ, row, 0)), and k_desc, that of
// the BK-key SW128 tile (desc_k_major<BK>(cK, 0, 0)). Each reduction step adds
// its offset to them (desc_advance), so descriptors built once per block
// serve every tile.
template <class E, int D, int BK, int QROWS>
__device__ __forceinline__ void issue_qk(float (&s)[BK / 2], uint64_t q_desc, uint64_t k_desc) {
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk)
    Wgmma<E, BK>::template ss<0, 0>(s, desc_advance(q_desc, k_major_step<QROWS>(kk) / 16),
                                    desc_advance(k_desc, k_major_step<BK>(kk) / 16), kk > 0);
  wgmma_commit();
}

// Issues (and commits, without waiting) O += P V for a BK-key tile: P from
// registers (pv, 16-bit pairs), V the SW128 tile whose step-0 descriptor is
// v_desc (desc_mn_major<BK>(cV, 0, 0)).
template <class E, int D, int BK>
__device__ __forceinline__ void issue_pv(float (&o)[D / 2], const uint32_t (&pv)[BK / 4],
                                         uint64_t v_desc) {
#pragma unroll
  for (int kk = 0; kk < BK / 16; ++kk) {
    const uint32_t a[4] = {pv[4 * kk], pv[4 * kk + 1], pv[4 * kk + 2], pv[4 * kk + 3]};
    Wgmma<E, D>::template rs<1>(o, a, desc_advance(v_desc, mn_major_step(kk) / 16), 1);
  }
  wgmma_commit();
}

// Whether a forward problem needs the softmax's general path (LOADED = true
// where EB = 0): a mask or bias read score by score, or a scale <= 0. The
// other path folds the scale into the exponent, exp2(s * scale - max), which
// needs max(s * scale) = scale * max(s), true only for scale > 0 (a
// non-positive scale is legal but rare, so it may take the slower path).
inline bool fwd_needs_general_softmax(const KParams& p) {
  return p.mask != nullptr || p.bias != nullptr || !(p.scale_log2 > 0.f);
}

// s: this thread's scores of a 64 x BK tile (rows row0 and row0 + 8, keys
// j0 + acc_col(j, lane, e)); m, l: the running row max (base 2) and sum.
// Scales and masks s, replaces it by exp2(s - m_new), updates m and l and
// returns in alpha the factor O must be rescaled by. full: the tile needs no
// bounds, nor (EB = 0) a mask or bias (HeadMask::tile_in_bounds<EB>); one_seg:
// nor its segment ids compared (HeadMask::one_segment). EB > 0:
// the mask (1) or 16-bit bias (2) is read from the step's staged tile
// (stage_score_tile), of which staged_row0 points at row row0, key j0. EB = 0: LOADED, each score
// loads its own mask and bias values; !LOADED, the problem has neither and
// its scale is positive (fwd_needs_general_softmax), so the scale is folded
// into the exponent's FFMA instead of costing its own FMUL per score: at
// D = 64 a tile's softmax takes about as long as its two products.
template <int BK, int EB, bool LOADED>
__device__ __forceinline__ void online_softmax_tile(float (&s)[BK / 2], float (&m)[2],
                                                    float (&l)[2], float (&alpha)[2],
                                                    const HeadMask& hm, float scale_log2,
                                                    bool full, bool one_seg, int row0, int j0,
                                                    int lane,
                                                    const uint8_t* staged_row0 = nullptr) {
  constexpr bool kFoldScale = EB == 0 && !LOADED;
  if constexpr (EB > 0) {
#pragma unroll
    for (int j = 0; j < BK / 8; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int jl = acc_col(j, lane, e);
        s[4 * j + e] = hm.apply_staged<EB>(
            s[4 * j + e] * scale_log2,
            staged_row0 + (e >> 1) * 8 * staged_row_bytes<BK, EB>() + jl * EB);
      }
    }
  } else if constexpr (LOADED) {
    // Scores read one at a time: bounds, mask and bias per score.
#pragma unroll
    for (int j = 0; j < BK / 8; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float x = s[4 * j + e] * scale_log2;
        if (!full) x = hm.apply(row0 + (e >> 1) * 8, j0 + acc_col(j, lane, e), x);
        s[4 * j + e] = x;
      }
    }
  }
  if constexpr (!LOADED) {
    // Bounds by intervals, with one branch per tile around the whole loop.
    // With the test inside the loop, ptxas gave every score its own
    // divergent branch (BSSY/BSYNC) even on full tiles; Nsight Compute put
    // over a third of the D = 64 forward's stall samples there. (Without a
    // mask or bias the scores are not scaled yet: -inf stays -inf.)
    if (!full) {
      const int first = j0 + acc_col(0, lane, 0);  // this thread's first key
      int2 keys[2] = {hm.row_keys(row0), hm.row_keys(row0 + 8)};
#pragma unroll
      for (int r = 0; r < 2; ++r) keys[r] = make_int2(keys[r].x - first, keys[r].y - first);
      hide_outside_intervals<BK>(s, keys, lane, -INFINITY);
      // Segment ids: keys of another segment than the row's. Never with a
      // staged mask or bias (EB > 0): the host stages nothing then.
      if (EB == 0 && !one_seg) {
        const int row_id[2] = {hm.q_segment(row0), hm.q_segment(row0 + 8)};
#pragma unroll
        for (int j = 0; j < BK / 8; ++j) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            if (hm.kv_segment(j0 + acc_col(j, lane, e)) != row_id[e >> 1]) s[4 * j + e] = -INFINITY;
          }
        }
      }
    }
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float mx = -INFINITY;
#pragma unroll
    for (int j = 0; j < BK / 8; ++j) mx = fmaxf(mx, fmaxf(s[4 * j + 2 * r], s[4 * j + 2 * r + 1]));
    mx = quad_max(mx);
    if constexpr (kFoldScale) mx *= scale_log2;  // -inf stays -inf: scale_log2 > 0
    const float m_new = fmaxf(m[r], mx);
    const float m_use = m_new == -INFINITY ? 0.f : m_new;
    alpha[r] = exp2_fast(m[r] - m_use);
    m[r] = m_new;
    float sum = 0.f;
#pragma unroll
    for (int j = 0; j < BK / 8; ++j) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        float& x = s[4 * j + 2 * r + e];
        x = exp2_fast(kFoldScale ? fmaf(x, scale_log2, -m_use) : x - m_use);
      }
      sum += s[4 * j + 2 * r] + s[4 * j + 2 * r + 1];
    }
    l[r] = l[r] * alpha[r] + sum;
  }
}

// O *= alpha per row; P (the exponentiated s) kept as 16-bit pairs, the A
// operand of the next O += P V.
template <class E, int D, int BK>
__device__ __forceinline__ void rescale_o_keep_p(float (&o)[D / 2], const float (&alpha)[2],
                                                 const float (&s)[BK / 2],
                                                 uint32_t (&pv)[BK / 4]) {
#pragma unroll
  for (int j = 0; j < D / 8; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) o[4 * j + e] *= alpha[e >> 1];
  }
#pragma unroll
  for (int i = 0; i < BK / 4; ++i) pv[i] = Cvt<E>::pack(s[2 * i], s[2 * i + 1]);
}

// Writes O / l and the natural-log logsumexp of this thread's rows row0 and
// row0 + 8 of head (b, n); fully masked rows get O = 0 and L = -inf.
template <class E, int D>
__device__ __forceinline__ void store_o_lse(const KParams& p, const float (&o)[D / 2],
                                            const float (&m)[2], const float (&l)[2], int b, int n,
                                            int row0, int lane) {
  const int tg = lane & 3;
  E* ob = static_cast<E*>(p.out) + b * p.q_bs + n * p.q_hs;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const float lt = quad_sum(l[r]);
    const int row = row0 + r * 8;
    if (row >= p.T) continue;
    const RowEnd end = finish_row(m[r], lt);
    E* orow = ob + static_cast<int64_t>(row) * p.q_ss;
#pragma unroll
    for (int j = 0; j < D / 8; ++j) {
      *reinterpret_cast<uint32_t*>(orow + j * 8 + tg * 2) =
          Cvt<E>::pack(o[4 * j + 2 * r] * end.inv_l, o[4 * j + 2 * r + 1] * end.inv_l);
    }
    if (tg == 0) {
      p.lse[(static_cast<int64_t>(b) * p.N + n) * p.T + row] = end.lse;
    }
  }
}

}  // namespace fatrain::cuda
