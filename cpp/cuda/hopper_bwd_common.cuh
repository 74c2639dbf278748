// The pieces of the Hopper backward kernels (hopper_bwd_ws.cu; internal):
// the query steps a key block walks, the per-step products and elementwise
// work of a warpgroup that owns 64 keys, and the final dK / dV store. The
// kernels keep dK and dV of their keys in wgmma accumulators.
#pragma once

#include <type_traits>

#include "cuda/common.cuh"
#include "cuda/wgmma.cuh"

namespace fatrain::cuda {

// Query rows per backward step (one wgmma M or N of 64).
constexpr int kBwdBQ = 64;

// The staged-score instances of the D <= 128 Hopper backward (a mask or a
// 16-bit bias, KParams::staged, at head dims 64 and 128): calls
// launch(std::integral_constant<int, D>, std::integral_constant<int, EB>) for
// p's, else returns cudaErrorNotSupported.
template <class Launch>
cudaError_t launch_staged_bwd(const KParams& p, Launch&& launch) {
  using D64 = std::integral_constant<int, 64>;
  using D128 = std::integral_constant<int, 128>;
  using Mask = std::integral_constant<int, 1>;
  using Bias16 = std::integral_constant<int, 2>;
  if (p.staged == 1 && p.D == 64) return launch(D64{}, Mask{});
  if (p.staged == 2 && p.D == 64) return launch(D64{}, Bias16{});
  if (p.staged == 1 && p.D == 128) return launch(D128{}, Mask{});
  if (p.staged == 2 && p.D == 128) return launch(D128{}, Bias16{});
  return cudaErrorNotSupported;
}

// dQ rows [i0, i0 + 64) x columns [col0, col0 + NC) of head h, a 64 x NC
// wgmma accumulator, added to the float32 scratch with float4 atomics
// (sm_90): lanes 2t and 2t + 1 swap a pair of columns, so that the even lane
// holds four consecutive columns of its row lane / 4 and the odd lane four
// of row lane / 4 + 8; half the atomic instructions of float2 ones.
template <int NC>
__device__ __forceinline__ void add_dq_tile_v4(const KParams& p, const float (&dq)[NC / 2], int b,
                                               int h, int i0, int col0, int wq, int lane) {
  const bool odd = lane & 1;
  const int i = i0 + acc_row(wq, lane, odd ? 2 : 0);
  float* dst = p.dq_acc + ((static_cast<int64_t>(b) * p.N + h) * p.T + i) * p.D + col0 +
               acc_col(0, lane & ~1, 0);
  // Every swap first, then every atomic: an atomic holds its source registers
  // until it has read them, and interleaved (the compiler reused one quad of
  // registers) each swap waited for the previous atomic (an H200 profile put
  // 14% of the stall samples there).
  float4 v[NC / 8];
#pragma unroll
  for (int j = 0; j < NC / 8; ++j) {
    // The even lane sends its second row's pair, the odd lane its first's.
    const float send0 = odd ? dq[4 * j] : dq[4 * j + 2];
    const float send1 = odd ? dq[4 * j + 1] : dq[4 * j + 3];
    const float got0 = __shfl_xor_sync(0xffffffffu, send0, 1);
    const float got1 = __shfl_xor_sync(0xffffffffu, send1, 1);
    v[j] = odd ? make_float4(got0, got1, dq[4 * j + 2], dq[4 * j + 3])
               : make_float4(dq[4 * j], dq[4 * j + 1], got0, got1);
  }
  // The empty asm keeps the compiler from moving swaps back between atomics.
#pragma unroll
  for (int j = 0; j < NC / 8; ++j)
    asm volatile("" : "+f"(v[j].x), "+f"(v[j].y), "+f"(v[j].z), "+f"(v[j].w));
  if (i < p.T) {
#pragma unroll
    for (int j = 0; j < NC / 8; ++j) atomicAdd(reinterpret_cast<float4*>(dst + 8 * j), v[j]);
  }
}

// Writes dK (times the softmax scale) and dV for keys [j0, j0 + 64) x columns
// [col0, col0 + NC), 64 x NC wgmma accumulators, to the outputs of head kvh.
template <class E, int NC>
__device__ __forceinline__ void store_dk_dv(const KParams& p, const float (&dk)[NC / 2],
                                            const float (&dv)[NC / 2], int b, int kvh, int j0,
                                            int col0, int wq, int lane) {
  E* dkb = static_cast<E*>(p.dk) + b * p.k_bs + kvh * p.k_hs + col0;
  E* dvb = static_cast<E*>(p.dv) + b * p.k_bs + kvh * p.k_hs + col0;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int j = j0 + acc_row(wq, lane, 2 * r);
    if (j >= p.S) continue;
    E* dkr = dkb + static_cast<int64_t>(j) * p.k_ss;
    E* dvr = dvb + static_cast<int64_t>(j) * p.k_ss;
#pragma unroll
    for (int c = 0; c < NC / 8; ++c) {
      const int col = acc_col(c, lane, 0);
      *reinterpret_cast<uint32_t*>(dkr + col) =
          Cvt<E>::pack(dk[4 * c + 2 * r] * p.scale, dk[4 * c + 2 * r + 1] * p.scale);
      *reinterpret_cast<uint32_t*>(dvr + col) = Cvt<E>::pack(dv[4 * c + 2 * r], dv[4 * c + 2 * r + 1]);
    }
  }
}

// The order of a key block's query steps: tile by tile (descending or
// ascending), at each tile every query head of the group. Blocks of one KV
// head run at the same time and read the same Q and dO tiles only if they
// walk them in step: with causality key block j's queries start at tile j
// (for 128-row tiles), so tiles down from the last one all blocks read the
// same tile until each reaches its own first; L2 then serves one copy (and
// the dQ rows all blocks add to). Head by head instead, every block would
// read its own tiles (docs/cuda.md has the difference).
enum class StepOrder : int { kTilesDown, kTilesUp };

// The query steps one key block walks: the G query heads of its KV head,
// each times the query tiles of BQ rows that can see keys [j0, j0 + BK), in
// `order`. Step `it` is head head(it), rows [row0(it), row0(it) + BQ).
// init() also sets hm up for the group's first head.
template <int BQ = kBwdBQ>
struct QuerySteps {
  int G, kvh, qt_begin, nq, total;
  StepOrder order;
  __device__ __forceinline__ void init(const KParams& p, HeadMask& hm, int b, int kvh_, int j0,
                                       int BK, StepOrder order_) {
    G = p.N / p.K;
    kvh = kvh_;
    order = order_;
    hm.init(p, b, kvh * G, kLog2e);
    hm.query_tiles(p, b, j0, min(j0 + BK, p.S), BQ, &qt_begin, &nq);
    total = G * nq;
  }
  __device__ __forceinline__ int head(int it) const {
    return kvh * G + it % G;
  }
  __device__ __forceinline__ int row0(int it) const {
    const int tile = order == StepOrder::kTilesUp ? it / G : nq - 1 - it / G;
    return (qt_begin + tile) * BQ;
  }
};


// ---- One query step of a warpgroup: elementwise work and products ----
// Accumulators in the wgmma layout: st, dpt are 64 keys x NQ queries of the
// step (queries q_w0 .. q_w0 + NQ - 1, relative to the step's first row; the
// warp's 16 keys are key_w0 .. key_w0 + 15, relative to the key block).

// Reduction steps [KK0, KK1) (16 columns each) of Sᵀ = K Qᵀ (sA = K, sB = Q)
// or dPᵀ = V dOᵀ (V, dO) for keys [key_row0, key_row0 + 64) of a BK-row tile
// x queries [q_row0, q_row0 + NQ) of a BQ-row tile, both K-major; FIRST:
// step KK0 overwrites acc instead of adding to it. Not fenced or committed.
template <class E, int BK, int NQ, int BQ, int KK0, int KK1, bool FIRST,
          DescBuild DB = DescBuild::kHoisted>
__device__ __forceinline__ void issue_score_ksteps(float (&acc)[NQ / 2], uint32_t sA,
                                                   int key_row0, uint32_t sB, int q_row0) {
#pragma unroll
  for (int kk = KK0; kk < KK1; ++kk)
    Wgmma<E, NQ>::template ss<0, 0>(acc, desc_k_major<BK, DB>(sA, key_row0, kk),
                                    desc_k_major<BQ, DB>(sB, q_row0, kk), !FIRST || kk > KK0);
}

// Sᵀ = K Qᵀ and dPᵀ = V dOᵀ for keys [key_row0, key_row0 + 64) of the BK-row
// K and V tiles x queries [q_row0, q_row0 + NQ) of the step's BQ-row Q and dO
// tiles, committed as two groups: Pᵀ is computed while dPᵀ runs.
template <class E, int D, int BK, int NQ = kBwdBQ, int BQ = kBwdBQ>
__device__ __forceinline__ void issue_st_dpt(float (&st)[NQ / 2], float (&dpt)[NQ / 2],
                                             uint32_t sK, uint32_t sV, int key_row0, uint32_t cQ,
                                             uint32_t cdO, int q_row0 = 0) {
  fence_regs(st);
  fence_regs(dpt);
  wgmma_fence();
  issue_score_ksteps<E, BK, NQ, BQ, 0, D / 16, true>(st, sK, key_row0, cQ, q_row0);
  wgmma_commit();
  issue_score_ksteps<E, BK, NQ, BQ, 0, D / 16, true>(dpt, sV, key_row0, cdO, q_row0);
  wgmma_commit();
}

// The step's L or D at the NQ / 4 query columns of a thread's accumulator
// rows, copied from shared memory into registers ahead of their use, so that
// the loads wait behind a wgmma instead of in front of the FFMAs that use
// them; indexed by query like the shared array. The index arithmetic folds
// to a constant once the callers' loops are unrolled, as in
// hide_outside_intervals.
template <int NQ>
struct ThreadRowStats {
  float v[NQ / 4];
  int first;  // the thread's first query column, acc_col(0, lane, 0) + q_w0
  __device__ __forceinline__ void load(const float* shared, int q_w0, int lane) {
    first = q_w0 + acc_col(0, lane, 0);
#pragma unroll
    for (int j = 0; j < NQ / 8; ++j) {
      v[2 * j] = shared[first + 8 * j];
      v[2 * j + 1] = shared[first + 8 * j + 1];
    }
  }
  __device__ __forceinline__ float operator[](int q) const {
    const int k = q - first;
    return v[(k >> 3) * 2 + (k & 1)];
  }
};

// Pᵀ = exp2(scale_log2 Sᵀ (+ bias, masked) - L), in place, for query rows
// [i0, i0 + kBwdBQ) and keys j0 + key_w0 ... cL: the step's L (base 2), in
// shared memory or a ThreadRowStats.
// EB > 0: the mask or bias is staged at `staged`, rows of SCORE_ROW bytes per
// query, the block's keys along them; EB = 0: no mask or bias. full: the
// warp's tile needs no bounds (HeadMask::tile_in_bounds<EB>); one_seg: nor
// its segment ids compared (HeadMask::one_segment).
template <int EB, int SCORE_ROW, int NQ = kBwdBQ, class Stats = const float*>
__device__ __forceinline__ void compute_pt(float (&st)[NQ / 2], const HeadMask& hm,
                                           float scale_log2, const Stats& cL, int i0, int j0,
                                           int key_w0, int q_w0, int lane, bool full,
                                           bool one_seg, const uint8_t* staged) {
#pragma unroll
  for (int j = 0; j < NQ / 8; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int ql = q_w0 + acc_col(j, lane, e);
      if constexpr (EB == 0) {
        // The scale folds into the exponent's FFMA.
        st[4 * j + e] = exp2_fast(fmaf(st[4 * j + e], scale_log2, -cL[ql]));
      } else {
        const int kl = key_w0 + (lane >> 2) + (e >> 1) * 8;
        const float x = hm.apply_staged<EB>(st[4 * j + e] * scale_log2,
                                            staged + ql * SCORE_ROW + kl * EB);
        st[4 * j + e] = exp2_fast(x - cL[ql]);
      }
    }
  }
  // Bounds after the exponent, as P = 0, by intervals (HeadMask::key_queries)
  // with one branch per tile around the whole loop, not one per score (the
  // forward's online_softmax_tile says why). Zeroing P rather than setting S
  // to -inf first keeps a negative scale correct.
  if (!full) {
    const int first = i0 + q_w0 + acc_col(0, lane, 0);  // this thread's first query
    int2 queries[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      queries[r] = hm.key_queries(j0 + key_w0 + (lane >> 2) + r * 8);
      queries[r] = make_int2(queries[r].x - first, queries[r].y - first);
    }
    hide_outside_intervals<NQ>(st, queries, lane, 0.f);
    // Segment ids: queries of another segment than the key's. Never with a
    // staged mask or bias (EB > 0): the host stages nothing then.
    if (EB == 0 && !one_seg) {
      const int key_id[2] = {hm.kv_segment(j0 + key_w0 + (lane >> 2)),
                             hm.kv_segment(j0 + key_w0 + (lane >> 2) + 8)};
#pragma unroll
      for (int j = 0; j < NQ / 8; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          if (hm.q_segment(i0 + q_w0 + acc_col(j, lane, e)) != key_id[e >> 1]) st[4 * j + e] = 0.f;
        }
      }
    }
  }
}

// dV += Pᵀ dO over the step's BQ queries (A = Pᵀ from registers, B = dO
// MN-major), committed.
template <class E, int D, int BQ = kBwdBQ>
__device__ __forceinline__ void issue_dv(float (&dv)[D / 2], const float (&st)[BQ / 2],
                                         uint32_t cdO) {
  fence_regs(dv);
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < BQ / 16; ++kk) {
    uint32_t a[4];
    acc_to_a<E>(st, kk, a);
    Wgmma<E, D>::template rs<1>(dv, a, desc_mn_major<BQ>(cdO, 0, kk), 1);
  }
  wgmma_commit();
}

// Pᵀ packed to 16-bit pairs, pt[m] = (st[2 m], st[2 m + 1]): the order
// acc_to_a reads an accumulator in, so pt[4 kk .. 4 kk + 3] is the A operand
// of reduction step kk. With 128-query steps, keeping Pᵀ packed instead of in
// floats is what lets Sᵀ, dPᵀ, dK and dV of 64 keys fit the registers without
// ptxas serialising the wgmmas (C7512).
template <class E, int NQ>
__device__ __forceinline__ void pack_pairs(const float (&st)[NQ / 2], uint32_t (&pt)[NQ / 4]) {
#pragma unroll
  for (int m = 0; m < NQ / 4; ++m) pt[m] = Cvt<E>::pack(st[2 * m], st[2 * m + 1]);
}

// dV += Pᵀ dO over the step's BQ queries, A = the packed Pᵀ, committed.
template <class E, int D, int BQ, DescBuild DB = DescBuild::kHoisted>
__device__ __forceinline__ void issue_dv_packed(float (&dv)[D / 2], const uint32_t (&pt)[BQ / 4],
                                                uint32_t cdO) {
  fence_regs(dv);
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < BQ / 16; ++kk) {
    const uint32_t a[4] = {pt[4 * kk], pt[4 * kk + 1], pt[4 * kk + 2], pt[4 * kk + 3]};
    Wgmma<E, D>::template rs<1>(dv, a, desc_mn_major<BQ, DB>(cdO, 0, kk), 1);
  }
  wgmma_commit();
}

// dSᵀ = Pᵀ (dPᵀ - D) as compute_dst, with Pᵀ read back from its packed
// 16-bit form (the values dV used); cDs as in compute_dst.
template <class E, int NQ, class Stats = const float*>
__device__ __forceinline__ void compute_dst_packed(float (&dpt)[NQ / 2],
                                                   const uint32_t (&pt)[NQ / 4],
                                                   const Stats& cDs, int q_w0, int lane) {
#pragma unroll
  for (int j = 0; j < NQ / 8; ++j) {
#pragma unroll
    for (int e = 0; e < 4; e += 2) {
      const float2 pv = Cvt<E>::unpack(pt[2 * j + (e >> 1)]);
      dpt[4 * j + e] = pv.x * (dpt[4 * j + e] - cDs[q_w0 + acc_col(j, lane, e)]);
      dpt[4 * j + e + 1] = pv.y * (dpt[4 * j + e + 1] - cDs[q_w0 + acc_col(j, lane, e + 1)]);
    }
  }
}

// dSᵀ = Pᵀ (dPᵀ - D), in place of dPᵀ (cDs: the step's D = rowsum(dO O), in
// shared memory or a ThreadRowStats).
template <int NQ = kBwdBQ, class Stats = const float*>
__device__ __forceinline__ void compute_dst(float (&dpt)[NQ / 2], const float (&st)[NQ / 2],
                                            const Stats& cDs, int q_w0, int lane) {
#pragma unroll
  for (int j = 0; j < NQ / 8; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e)
      dpt[4 * j + e] = st[4 * j + e] * (dpt[4 * j + e] - cDs[q_w0 + acc_col(j, lane, e)]);
  }
}

// The warp's 16 keys of Pᵀ or dSᵀ, 16-bit, into a [BK keys][NQ or more
// queries] SW128 tile at `tile`, for a later wgmma that reads it through the
// async proxy (the caller fences).
template <class E, int BK, int NQ = kBwdBQ>
__device__ __forceinline__ void store_key_major(uint8_t* tile, const float (&x)[NQ / 2],
                                                int key_w0, int q_w0, int lane) {
#pragma unroll
  for (int j = 0; j < NQ / 8; ++j) {
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      const int kl = key_w0 + (lane >> 2) + hf * 8;
      *reinterpret_cast<uint32_t*>(tile + sw128_offset<BK>(kl, q_w0 + acc_col(j, lane, 0))) =
          Cvt<E>::pack(x[4 * j + 2 * hf], x[4 * j + 2 * hf + 1]);
    }
  }
}

// The warp's 16 keys of dSᵀ (NQ queries), 16-bit, into a [NQ queries][keys]
// SW128 tile at shared address `tile`, keys along the rows: the
// K-major B operand of dQᵀ = Kᵀ dSᵀ (issue_dq_transposed). stmatrix
// transposes 8 x 8 blocks on the way, so each lane stores 16 contiguous bytes
// (8 keys of one query) per block; lane 8 m + r addresses row r of block m,
// blocks (query group j, keys + 0), (j, + 8), (j + 1, + 0), (j + 1, + 8).
template <class E, int NQ>
__device__ __forceinline__ void store_query_major(uint32_t tile, const float (&x)[NQ / 2],
                                                  int key_w0, int lane) {
  static_assert(NQ % 16 == 0, "two query groups of 8 per store");
  const int m = lane >> 3, r = lane & 7;
#pragma unroll
  for (int j = 0; j < NQ / 8; j += 2) {
    const uint32_t addr = tile + sw128_offset<NQ>(8 * (j + (m >> 1)) + r, key_w0 + 8 * (m & 1));
    stmatrix_x4_trans(addr, Cvt<E>::pack(x[4 * j], x[4 * j + 1]),
                      Cvt<E>::pack(x[4 * j + 2], x[4 * j + 3]),
                      Cvt<E>::pack(x[4 * j + 4], x[4 * j + 5]),
                      Cvt<E>::pack(x[4 * j + 6], x[4 * j + 7]));
  }
}

// dK += dSᵀ Q over the step's BQ queries (A = dSᵀ from registers, B = Q
// MN-major), committed.
template <class E, int D, int BQ = kBwdBQ, DescBuild DB = DescBuild::kHoisted>
__device__ __forceinline__ void issue_dk(float (&dk)[D / 2], const float (&dpt)[BQ / 2],
                                         uint32_t cQ) {
  fence_regs(dk);
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < BQ / 16; ++kk) {
    uint32_t a[4];
    acc_to_a<E>(dpt, kk, a);
    Wgmma<E, D>::template rs<1>(dk, a, desc_mn_major<BQ, DB>(cQ, 0, kk), 1);
  }
  wgmma_commit();
}

// One commit group of K_STEPS 64 x N x 16 products into d, overwritten (d
// is zeroed and the first step does not accumulate), with A and B read from
// shared memory through the descriptors desc_a(kk) and desc_b(kk).
template <class E, int N, int K_STEPS, int TRANS_A, int TRANS_B, class DescA, class DescB>
__device__ __forceinline__ void issue_ss_overwrite(float (&d)[N / 2], DescA desc_a,
                                                   DescB desc_b) {
#pragma unroll
  for (int i = 0; i < N / 2; ++i) d[i] = 0.f;
  fence_regs(d);
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < K_STEPS; ++kk)
    Wgmma<E, N>::template ss<TRANS_A, TRANS_B>(d, desc_a(kk), desc_b(kk), kk > 0);
  wgmma_commit();
}

// dQ = dS K for 64 of the step's queries, [q0, q0 + 64), x columns [col0,
// col0 + NC), over all BK keys of the block: A = the [BK keys][queries] dSᵀ
// tile read MN-major, B = K read MN-major; one commit group, dq overwritten.
template <class E, int NC, int BK, DescBuild DB = DescBuild::kHoisted>
__device__ __forceinline__ void issue_dq(float (&dq)[NC / 2], uint32_t cdS, uint32_t sK,
                                         int col0, int q0 = 0) {
  issue_ss_overwrite<E, NC, BK / 16, 1, 1>(
      dq, [&](int kk) { return desc_mn_major<BK, DB>(cdS, q0, kk); },
      [&](int kk) { return desc_mn_major<BK, DB>(sK, col0, kk); });
}

// dQᵀ = Kᵀ dSᵀ for head columns [col0, col0 + 64) x the step's NQ queries,
// over all BK keys of the block: A = K read MN-major (head columns along M),
// B = the [NQ queries][BK keys] dS tile (store_query_major) read K-major. For
// steps of NQ != 64 queries, which a wgmma cannot take as M. One commit
// group, dqt overwritten.
template <class E, int NQ, int BK>
__device__ __forceinline__ void issue_dq_transposed(float (&dqt)[NQ / 2], uint32_t cdS,
                                                    uint32_t sK, int col0) {
  issue_ss_overwrite<E, NQ, BK / 16, 1, 0>(
      dqt, [&](int kk) { return desc_mn_major<BK>(sK, col0, kk); },
      [&](int kk) { return desc_k_major<NQ>(cdS, 0, kk); });
}

}  // namespace fatrain::cuda
