// The forward pass: packing K and V, then one work item per (batch, head,
// group of adjacent query tiles).
//
// Part of the CPU kernels compiled once per ISA: see attention_cpu_impl.h.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "packing.h"
#include "scratch.h"
#include "tile_products.h"
#include "visibility.h"
#include "work_items.h"

namespace fatrain::cpu::FATRAIN_ISA {
namespace {

// ---------------------------------------------------------------------------
// Forward.
// ---------------------------------------------------------------------------
struct FwdState {
  Geo g;
  const ForwardOperands* op;
  float* K;  // [B*KH][Sp][Dr] rows
  float* V;  // [B*KH][Sp][Dr] rows
  // With bf16 pairs (words): K with pairs along D [B*KH][Sp][Dp / 2] and V
  // with pairs along keys [B*KH][Sp / 2][Dr], both in K's space; V's space is
  // the f32 packing scratch. On AMX (kAmx): K [B*KH][Sp][Da / 2] and Vᵀ by key
  // tile [B*KH][Sp / BK][Da][BK / 2], Da = fwd_amx_dim.
  bool words;
  uint32_t* Kw;
  uint32_t* Vw;
  int64_t qtiles;  // query tiles per item (forward_query_tiles)
  int fail;
};

// The head dim as the AMX forward computes it: whole steps of 32 bf16, the
// padding zero in K, Qᵀ and Vᵀ (and Oᵀ's extra rows stay zero).
static inline int64_t fwd_amx_dim(const Geo& g) { return round_up(g.D, 32); }

// Rows of a tile's Qᵀ (Pk) and Oᵀ.
template <class Pk>
static inline int64_t fwd_qt_rows(const Geo& g) {
  constexpr int64_t kP = Lanes<Pk>::kPair;
  return kAmx && kP == 2 ? fwd_amx_dim(g) / 2 : (g.D + kP - 1) / kP;
}
template <class Pk>
static inline int64_t fwd_ot_rows(const Geo& g) {
  return kAmx && Lanes<Pk>::kPair == 2 ? fwd_amx_dim(g) : g.Dp;
}

// Keys per key-major pack item (fwd_pack_keys, fwd_amx_pack_keys; a multiple
// of BK).
constexpr int64_t kFwdPackKeys = 256;
static inline int64_t fwd_pack_key_chunks(const Geo& g) {
  return (g.Sp + kFwdPackKeys - 1) / kFwdPackKeys;
}

// The float32 forward's packs (K's and V's rows) of keys [t0, t0 +
// kFwdPackKeys) of every kv head of one batch (item b * fwd_pack_key_chunks
// + chunk), each key's rows of every head in turn: they are adjacent in the
// usual [B, S, KH, D] layout, so the reads walk k and v in memory order
// rather than striding through them once per head.
static void fwd_pack_keys(FwdState& s, int64_t idx) {
  const PhaseScope phase(kPhasePack);
  const Geo& g = s.g;
  const int64_t b = idx / fwd_pack_key_chunks(g), chunk = idx % fwd_pack_key_chunks(g);
  const int64_t t0 = chunk * kFwdPackKeys, t1 = imin(g.Sp, t0 + kFwdPackKeys);
  for (int64_t t = t0; t < t1; ++t)
    for (int64_t h = 0; h < g.KH; ++h) {
      const int64_t row = ((b * g.KH + h) * g.Sp + t) * g.Dr;
      pack_rows(s.op->k, b, h, t, 1, g.S, g.D, g.Dr, s.K + row);
      pack_rows(s.op->v, b, h, t, 1, g.S, g.D, g.Dr, s.V + row);
    }
}

#if defined(FATRAIN_AMX)
// bf16 elements with NaNs made quiet as bf16_bits does (the bits of every
// other bf16 value are its own).
static inline __attribute__((always_inline)) __m512i amx_quiet_bf16(__m512i x) {
  const __mmask32 nan = _mm512_cmpgt_epu16_mask(_mm512_and_si512(x, _mm512_set1_epi16(0x7fff)),
                                                _mm512_set1_epi16(0x7f80));
  return _mm512_mask_mov_epi16(x, nan, _mm512_or_si512(x, _mm512_set1_epi16(0x40)));
}

// Whether fwd_amx_pack_keys can pack k and v: both bf16, D even, and 16
// rows of v int32-addressable from the first.
static bool fwd_amx_packs_from_bf16(const FwdState& s) {
  const SeqTensor &k = s.op->k, &v = s.op->v;
  return k.dtype == DType::kBF16 && v.dtype == DType::kBF16 && s.g.D % 2 == 0 &&
         v.seq_stride >= 0 && 15 * v.seq_stride + s.g.D <= INT32_MAX;
}

// The AMX forward's packs of a chunk of keys of every kv head of one batch,
// as fwd_pack_keys, straight from the bf16 rows when fwd_amx_packs_from_bf16:
// the packs of pack_amx_rows and pack_amx_transposed (the same bits). K: each
// row's D elements copied, zero up to Da and past S. Vᵀ: the pair word p of
// 16 rows is one masked gather, its low and high halves elements 2p and
// 2p + 1 of each key; 16 keys of every head in turn.
static void fwd_amx_pack_keys(FwdState& s, int64_t idx) {
  const PhaseScope phase(kPhasePack);
  const Geo& g = s.g;
  const SeqTensor &k = s.op->k, &v = s.op->v;
  const int64_t D = g.D, Da = fwd_amx_dim(g), head_words = g.Sp * Da / 2;
  const int64_t b = idx / fwd_pack_key_chunks(g), chunk = idx % fwd_pack_key_chunks(g);
  const int64_t t0 = chunk * kFwdPackKeys, t1 = imin(g.Sp, t0 + kFwdPackKeys);
  const __mmask32 none = 0;
  for (int64_t t = t0; t < t1; ++t)
    for (int64_t h = 0; h < g.KH; ++h) {
      uint32_t* Kw = s.Kw + (b * g.KH + h) * head_words;
      const uint16_t* src =
          t < g.S ? reinterpret_cast<const uint16_t*>(row_ptr(k, b, t, h)) : nullptr;
      for (int64_t d = 0; d < Da; d += 32) {
        const int64_t left = src ? imax(0, imin(32, D - d)) : 0;
        const __mmask32 mask = left == 32 ? ~none : static_cast<__mmask32>((1u << left) - 1u);
        const __m512i x = left > 0 ? amx_quiet_bf16(_mm512_maskz_loadu_epi16(mask, src + d))
                                   : _mm512_setzero_si512();
        _mm512_storeu_si512(Kw + t * Da / 2 + d / 2, x);
      }
    }
  __m512i gather = _mm512_setzero_si512();
  for (int i = 0; i < 16; ++i)
    reinterpret_cast<vi&>(gather)[i] = static_cast<int32_t>(i * v.seq_stride);
  for (int64_t blk = t0 / BK; blk < t1 / BK; ++blk)
    for (int64_t c0 = 0; c0 < BK; c0 += 16)
      for (int64_t h = 0; h < g.KH; ++h) {
        uint16_t* o = reinterpret_cast<uint16_t*>(s.Vw + (b * g.KH + h) * head_words +
                                                  blk * Da * BK / 2);
        const int64_t tc = blk * BK + c0, live = imax(0, imin(16, g.S - tc));
        const __mmask16 mask = static_cast<__mmask16>((1u << live) - 1u);
        const char* base = live > 0 ? row_ptr(v, b, tc, h) : nullptr;
        for (int64_t p = 0; p < D / 2; ++p) {
          __m512i w = _mm512_setzero_si512();
          if (live > 0) w = _mm512_mask_i32gather_epi32(w, mask, gather, base + 4 * p, 2);
          w = amx_quiet_bf16(w);
          const __m512i hi = reinterpret_cast<__m512i>(reinterpret_cast<vu>(w) >> 16);
          // (Merge-masked forms with a full mask: see vexp2.)
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + 2 * p * BK + c0),
                              _mm512_mask_cvtepi32_epi16(_mm256_setzero_si256(), 0xffff, w));
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + (2 * p + 1) * BK + c0),
                              _mm512_mask_cvtepi32_epi16(_mm256_setzero_si256(), 0xffff, hi));
        }
        if (c0 == 0) memset(o + D * BK, 0, static_cast<size_t>((Da - D) * BK) * sizeof(uint16_t));
      }
}
#endif

// The bf16 pair forward's packs of kv head idx, through f32 rows in V's
// space: K's pair rows and V's pairs along keys, or on AMX (where
// fwd_amx_pack_keys does not apply) K's rows and Vᵀ by key tile.
static void fwd_pack_words(FwdState& s, int64_t idx) {
  const PhaseScope phase(kPhasePack);
  const Geo& g = s.g;
  const int64_t b = idx / g.KH, h = idx % g.KH, head = idx * g.Sp * g.Dr;
  const int64_t Da = fwd_amx_dim(g), hw = idx * g.Sp * Da / 2;
  float* rows = s.V + head;
  pack_rows(s.op->k, b, h, 0, g.Sp, g.S, g.D, g.Dr, rows);
  if (kAmx)
    pack_amx_rows(rows, g.Sp, g.Dp, g.Dr, Da, s.Kw + hw);
  else
    pack_pair_rows(rows, g.Sp, g.Dp, g.Dr, s.Kw + head / 2);
  pack_rows(s.op->v, b, h, 0, g.Sp, g.S, g.D, g.Dr, rows);
  if (kAmx)
    pack_amx_transposed(rows, g.Sp, g.Dp, g.Dr, Da, BK, s.Vw + hw);
  else
    pack_pair_interleaved(rows, g.Sp, g.Dp, g.Dr, s.Vw + head / 2);
}

// The running state of one query tile: Qᵀ [fwd_qt_rows][BQ] (Pk), Oᵀ
// [fwd_ot_rows][BQ] and, per query, the running max m, the running sum l,
// this key tile's rescale factor and the max its exponentials subtract.
template <class Pk>
struct FwdTile {
  int64_t i0, ni, ncq, nqv, kt_begin, kt_end;
  Pk* QT;
  float *OT, *mrow, *lrow, *alpha, *mexp;
};

// Zeroes tile t's Oᵀ and resets its running max and sum.
template <class Pk>
static void fwd_tile_reset(const Geo& g, FwdTile<Pk>& t) {
  memset(t.OT, 0, static_cast<size_t>(fwd_ot_rows<Pk>(g) * BQ) * 4);
  for (int64_t r = 0; r < BQ; ++r) {
    t.mrow[r] = -kInf;
    t.lrow[r] = 0.0f;
  }
}

#if defined(FATRAIN_BF16_DOT) && FATRAIN_BF16_DOT == 1
// fwd_tile_begin for the bf16 pair path's Qᵀ (vdpbf16ps and AMX) when q is
// bf16, D is even and 16 rows of q are int32-addressable from the first
// (else false, nothing done): the pair words of a bf16 row are its own bits,
// NaNs made quiet as bf16_bits does, so word p of rows r0..r0 + 15 is one
// masked gather (rows past ni and words past D / 2 are zero, as in
// fwd_tile_begin). The gathers keep many rows of q in flight, where a row at
// a time waits for each.
static bool fwd_load_qt_bf16(const FwdState& s, int64_t b, int64_t n, FwdTile<uint32_t>& t) {
  const Geo& g = s.g;
  const SeqTensor& q = s.op->q;
  const int64_t D = g.D, Dq = fwd_qt_rows<uint32_t>(g);
  if (q.dtype != DType::kBF16 || D % 2 != 0 || q.seq_stride < 0 ||
      15 * q.seq_stride + D > INT32_MAX)
    return false;
  __m512i idx = _mm512_setzero_si512();
  for (int k = 0; k < 16; ++k) reinterpret_cast<vi&>(idx)[k] = static_cast<int32_t>(k * q.seq_stride);
  const vu lo_nan = vu{} + 0x7f80u, low = vu{} + 0xffffu;
  for (int64_t r0 = 0; r0 < BQ; r0 += 16) {
    const int64_t live = imax(0, imin(16, t.ni - r0));
    const __mmask16 mask = static_cast<__mmask16>((1u << live) - 1u);
    const char* base = live > 0 ? row_ptr(q, b, t.i0 + r0, n) : nullptr;
    for (int64_t p = 0; p < D / 2; ++p) {
      vu w = vu{};
      if (live > 0)
        w = reinterpret_cast<vu>(
            _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), mask, idx, base + 4 * p, 2));
      const vu lo = w & low, hi = w >> 16;
      w |= ((lo & 0x7fffu) > lo_nan) & 0x40u;
      w |= ((hi & 0x7fffu) > lo_nan) & 0x400000u;
      memcpy(t.QT + p * BQ + r0, &w, sizeof(w));
    }
  }
  if (Dq > D / 2)
    memset(t.QT + D / 2 * BQ, 0, static_cast<size_t>((Dq - D / 2) * BQ) * sizeof(uint32_t));
  fwd_tile_reset<uint32_t>(g, t);
  return true;
}
#endif

// Loads query tile t.i0.. of head n transposed into t.QT and resets its state.
template <class Pk>
static void fwd_tile_begin(const FwdState& s, int64_t b, int64_t n, FwdTile<Pk>& t) {
  const PhaseScope phase(kPhaseLoadQ);
  constexpr int64_t kP = Lanes<Pk>::kPair;
  const Geo& g = s.g;
  const int64_t D = g.D, Dk = (D + kP - 1) / kP, Dq = fwd_qt_rows<Pk>(g);
#if defined(FATRAIN_BF16_DOT) && FATRAIN_BF16_DOT == 1
  if constexpr (kP == 2) {
    if (fwd_load_qt_bf16(s, b, n, t)) return;
  }
#endif
  if constexpr (kP == 1) {
    // W rows of q at a time, transposed a W x W block at a time.
    const int64_t Dp = g.Dp;
    float rows[W * kMaxHeadDim];
    vf v[W];
    for (int64_t r0 = 0; r0 < BQ; r0 += W) {
      for (int64_t i = 0; i < W; ++i) {
        float* dst = rows + i * Dp;
        if (r0 + i < t.ni)
          load_row(row_ptr(s.op->q, b, t.i0 + r0 + i, n), s.op->q.dtype, D, dst);
        else
          for (int64_t d = 0; d < D; ++d) dst[d] = 0.0f;
        for (int64_t d = D; d < Dp; ++d) dst[d] = 0.0f;
      }
      for (int64_t d0 = 0; d0 < D; d0 += W) {
        for (int64_t i = 0; i < W; ++i) v[i] = ld(rows + i * Dp + d0);
        transpose_block(v);
        for (int64_t k = 0; k < imin(W, D - d0); ++k) st(t.QT + (d0 + k) * BQ + r0, v[k]);
      }
    }
  } else {
    float row[kMaxHeadDim + 1];
    for (int64_t r = 0; r < BQ; ++r) {
      if (r < t.ni)
        load_row(row_ptr(s.op->q, b, t.i0 + r, n), s.op->q.dtype, D, row);
      else
        for (int64_t d = 0; d < D; ++d) row[d] = 0.0f;
      row[D] = 0.0f;  // the pair of an odd D's last element
      for (int64_t p = 0; p < Dk; ++p) t.QT[p * BQ + r] = bf16_pair(row[2 * p], row[2 * p + 1]);
    }
  }
  if (Dq > Dk) memset(t.QT + Dk * BQ, 0, static_cast<size_t>((Dq - Dk) * BQ) * sizeof(Pk));
  fwd_tile_reset<Pk>(g, t);
}

// The online softmax's running max: folds the scaled tile max mx (one vector
// per query vector, nqv of them) into t.mrow, and stores the exponent offsets
// t.mexp (0 for a query with no visible key yet) and the rescale factors
// t.alpha. True when some factor is not 1, i.e. Oᵀ must be rescaled.
template <class Pk>
static inline bool update_running_max(FwdTile<Pk>& t, const vf* mx, int64_t nqv) {
  bool rescale = false;
  for (int64_t v = 0; v < nqv; ++v) {
    const vf mold = ld(t.mrow + v * W), mnew = vmax(mold, mx[v]);
    const vi dead = mnew == bc(-kInf);
    const vf a = dead ? bc(1.0f) : vexp2(mold - mnew);
    st(t.mexp + v * W, dead ? bc(0.0f) : mnew);
    st(t.mrow + v * W, mnew);
    st(t.alpha + v * W, a);
    for (int k = 0; k < W; ++k) rescale |= a[k] != 1.0f;
  }
  return rescale;
}

// After the exponentials of a step: the running sums l = l * alpha + the
// step's sums, and Oᵀ's Dp rows rescaled by alpha where some factor is not 1.
template <class Pk>
static inline void rescale_running_sums(FwdTile<Pk>& t, const vf* sum, int64_t nqv, int64_t Dp,
                                        bool rescale) {
  for (int64_t v = 0; v < nqv; ++v)
    st(t.lrow + v * W, ld(t.lrow + v * W) * ld(t.alpha + v * W) + sum[v]);
  if (rescale) {
    for (int64_t d = 0; d < Dp; ++d)
      for (int64_t v = 0; v < nqv; ++v)
        st(t.OT + d * BQ + v * W, ld(t.OT + d * BQ + v * W) * ld(t.alpha + v * W));
  }
}

// One key tile (rows j0.. of the head's K and V, kt) of one query tile,
// computed key-major, Sᵀ = K Qᵀ (a key per row, the BQ queries along the
// vectors), so that every query's softmax statistics are vectors of queries
// updated element-wise, with no reduction across vector lanes; the output
// accumulates as Oᵀ += Vᵀ Pᵀ (Vᵀ read in place from V's rows). St: [BK][BQ]
// scratch, brow: [BQ], Pw: [BK / 2][BQ] (bf16 pairs only). Returns false when
// the pair has no visible element.
template <class Pk>
static bool fwd_tile_step(const FwdState& s, int64_t b, int64_t n, int64_t kt, const Pk* Kh,
                          const Pk* Vh, int64_t te, int64_t se, FwdTile<Pk>& t, float* St,
                          float* brow, Pk* Pw) {
  constexpr int64_t kP = Lanes<Pk>::kPair;
  constexpr int64_t kQV = BQ / W;  // query vectors per tile row
  const Geo& g = s.g;
  const int64_t Dp = g.Dp, Dr = g.Dr, Dk = (g.D + kP - 1) / kP;
  const int64_t ldk = kP == 1 ? Dr : Dp / 2;
  const int64_t ncq = t.ncq, nqv = t.nqv;
  int64_t j0 = kt * BK, nj = imin(BK, g.S - j0), nc = round_up(nj, W);
  int cls = classify(g, b, t.i0, t.ni, j0, nj, nc, ncq, te, se);
  if (cls == 0) return false;
  const TileScores<false> scores(g, b, n, t.i0, t.ni, ncq, cls, te, se);
  // On partial tiles, the blocks of Sᵀ outside the band are not computed
  // (prep masks them) and Oᵀ sums Pᵀ over the band's keys only (P is zero
  // outside it).
  const Band band = tile_band(g, cls, t.i0, j0, false);
  score_gemm<Pk>(nj, ncq, Dk, Kh + j0 * ldk, ldk, t.QT, BQ, St, BQ, band);
  // Base-2 scores are c s: prep applies c (and masks, bias) a row at a time,
  // or, for plain tiles, the max and the exponentials apply it as they read.
  const bool plain = scores.plain();
  if (!plain)
    for (int64_t r = 0; r < nj; ++r) scores.prep(St + r * BQ, j0 + r, brow);
  const vf vc = bc(plain ? scores.exp2_scale() : 1.0f);
  // New running max per query. A query that has seen no finite score keeps
  // m = -inf and exponentiates against 0 (its p are 0, or NaN from a NaN
  // score); any NaN score makes its query's l, and so its O and L, NaN.
  // Both passes run a query vector at a time down the key rows, so that its
  // max and its sum stay in registers (arrays of them indexed by a runtime
  // count in an inner loop live in memory, a load and a store per vector and
  // row); the tile's max uses two chains (even and odd rows), the sum adds
  // in row order.
  vf mx[kQV];
  for (int64_t v = 0; v < nqv; ++v) {
    const float* col = St + v * W;
    vf m0 = bc(-kInf), m1 = m0;
    int64_t r = 0;
    for (; r + 1 < nj; r += 2) {
      m0 = vmax(m0, ld(col + r * BQ));
      m1 = vmax(m1, ld(col + (r + 1) * BQ));
    }
    if (r < nj) m0 = vmax(m0, ld(col + r * BQ));
    mx[v] = vmax(m0, m1) * vc;
  }
  const bool rescale = update_running_max(t, mx, nqv);
  // The exponentials overwrite Sᵀ as Pᵀ (f32), or with bf16 pairs are
  // written straight as Pᵀ's key pairs (row_pair_tile's layout: pair row u
  // holds keys 2u and 2u + 1, an odd last key paired with 0).
  vf sum[kQV];
  for (int64_t v = 0; v < nqv; ++v) {
    float* col = St + v * W;
    const vf mexp = ld(t.mexp + v * W);
    vf acc = vf{};
    if constexpr (kP == 1) {
      for (int64_t r = 0; r < nj; ++r) {
        const vf p = vexp2<Pk>(ld(col + r * BQ) * vc - mexp);
        acc += p;
        st(col + r * BQ, p);
      }
    } else {
      for (int64_t r = 0; r < nj; r += 2) {
        const vf lo = vexp2<Pk>(ld(col + r * BQ) * vc - mexp);
        acc += lo;
        vf hi = vf{};
        if (r + 1 < nj) {
          hi = vexp2<Pk>(ld(col + (r + 1) * BQ) * vc - mexp);
          acc += hi;
        }
        const vu w = operand_pair_words(lo, hi);
        memcpy(Pw + r / 2 * BQ + v * W, &w, sizeof(w));
      }
    }
    sum[v] = acc;
  }
  rescale_running_sums(t, sum, nqv, Dp, rescale);
  const Pk* Pt;
  if constexpr (kP == 1)
    Pt = St;
  else
    Pt = Pw;
  acc_gemm_at<Pk>(Dp, ncq, (nj + kP - 1) / kP, Vh + j0 / kP * Dr, Dr, Pt, BQ, t.OT, BQ,
                  {kTrimSumB, band});
  return true;
}

#if defined(FATRAIN_AMX)
// The AMX forward takes the key tiles kFwdAmxKeyTiles at a time (groups
// aligned to multiples of it, so a query tile's groups do not depend on the
// work items): one softmax update and one Oᵀ += Vᵀ Pᵀ per group, each C block
// of Oᵀ loaded and stored once per group instead of once per key tile.
// Sixteen tiles (1,024 keys; Sᵀ and Pᵀ scratch of 256 and 128 KiB, in L2)
// ran the forward 1-6% faster than four on an Emerald Rapids Xeon: the
// rescales of Oᵀ and its loads and stores outweigh Sᵀ leaving L1.
constexpr int64_t kFwdAmxKeyTiles = 16;

// Key tiles [ka, kb) of one group of query tile t, the group's steps as in
// fwd_tile_step: Sᵀ = K Qᵀ per visible key tile into St (kFwdAmxKeyTiles x
// [BK][BQ]), its max per query, then one running-max update for the group,
// the exponentials written straight as Pᵀ's key pairs into Pw
// (kFwdAmxKeyTiles x [BK / 2][BQ]) and Oᵀ += Vᵀ Pᵀ over all the group's
// 32-key steps. Whole 32 x 32 blocks (St's rows past a tile's keys are K's
// zero padding, its columns past ncq Qᵀ's; Pᵀ's pair rows past a tile's keys
// and words past ncq are +0). kNqv = t.nqv, a constant so that the maxima and
// sums of the query vectors stay in registers. Returns the key tiles visited.
template <int64_t kNqv>
static int64_t fwd_amx_group_n(const FwdState& s, int64_t b, int64_t n, int64_t ka, int64_t kb,
                               const uint32_t* Kh, const uint32_t* Vh, int64_t te, int64_t se,
                               FwdTile<uint32_t>& t, float* St, float* brow, uint32_t* Pw) {
  const Geo& g = s.g;
  const int64_t Da = fwd_amx_dim(g), Dp = g.Dp, ncq = t.ncq;
  const int64_t nqb = (ncq + 31) / 32;
  int64_t kts[kFwdAmxKeyTiles], njs[kFwdAmxKeyTiles], m = 0;
  float vcs[kFwdAmxKeyTiles];
  vf mx[kNqv];
  for (int64_t v = 0; v < kNqv; ++v) mx[v] = bc(-kInf);
  for (int64_t kt = ka; kt < kb; ++kt) {
    const int64_t j0 = kt * BK, nj = imin(BK, g.S - j0), nc = round_up(nj, W);
    const int cls = classify(g, b, t.i0, t.ni, j0, nj, nc, ncq, te, se);
    if (cls == 0) continue;
    float* S = St + m * BK * BQ;
    amx_gemm((nj + 31) / 32, nqb, Da / 32, Kh + j0 * Da / 2, Da / 2, t.QT, BQ, S, BQ);
    const TileScores<false> scores(g, b, n, t.i0, t.ni, ncq, cls, te, se);
    // Base-2 scores are c s: prep applies c (and masks, bias) a row at a
    // time, or, for plain tiles, the max and the exponentials apply it.
    const bool plain = scores.plain();
    if (!plain)
      for (int64_t r = 0; r < nj; ++r) scores.prep(S + r * BQ, j0 + r, brow);
    const float c = plain ? scores.exp2_scale() : 1.0f;
    vf tmx[kNqv];
    for (int64_t v = 0; v < kNqv; ++v) tmx[v] = bc(-kInf);
    for (int64_t r = 0; r < nj; ++r)
      for (int64_t v = 0; v < kNqv; ++v) tmx[v] = vmax(tmx[v], ld(S + r * BQ + v * W));
    for (int64_t v = 0; v < kNqv; ++v) mx[v] = vmax(mx[v], tmx[v] * c);
    kts[m] = kt;
    njs[m] = nj;
    vcs[m] = c;
    ++m;
  }
  if (m == 0) return 0;
  const bool rescale = update_running_max(t, mx, kNqv);
  // The exponentials, summed per query in key order and stored as Pᵀ's key
  // pairs: pair row u of a tile holds keys 2u (low halves) and 2u + 1.
  vf sum[kNqv];
  for (int64_t v = 0; v < kNqv; ++v) sum[v] = vf{};
  const vu zero = {};
  const uint32_t* as[kFwdAmxKeyTiles * BK / 32];
  const uint32_t* bs[kFwdAmxKeyTiles * BK / 32];
  vf mexp[kNqv];
  for (int64_t v = 0; v < kNqv; ++v) mexp[v] = ld(t.mexp + v * W);
  int64_t steps = 0;
  for (int64_t i = 0; i < m; ++i) {
    const float* S = St + i * BK * BQ;
    uint32_t* P = Pw + i * BK / 2 * BQ;
    const int64_t nj = njs[i], nkb = (nj + 31) / 32;
    const vf vc = bc(vcs[i]);
    for (int64_t u = 0; u < (nj + 1) / 2; ++u) {
      const float* lo = S + 2 * u * BQ;
      const bool has_hi = 2 * u + 1 < nj;
      uint32_t* w = P + u * BQ;
      for (int64_t v = 0; v < kNqv; ++v) {
        const vf plo = vexp2<uint32_t>(ld(lo + v * W) * vc - mexp[v]);
        sum[v] += plo;
        vf phi = {};
        if (has_hi) {
          phi = vexp2<uint32_t>(ld(lo + BQ + v * W) * vc - mexp[v]);
          sum[v] += phi;
        }
        const vu pw = operand_pair_words(plo, phi);
        memcpy(w + v * W, &pw, sizeof(pw));
      }
      for (int64_t v = kNqv; v < 2 * nqb; ++v) memcpy(w + v * W, &zero, sizeof(zero));
    }
    for (int64_t u = (nj + 1) / 2; u < 16 * nkb; ++u)
      memset(P + u * BQ, 0, static_cast<size_t>(32 * nqb) * sizeof(uint32_t));
    for (int64_t k = 0; k < nkb; ++k, ++steps) {
      as[steps] = Vh + kts[i] * Da * BK / 2 + 16 * k;
      bs[steps] = P + 16 * k * BQ;
    }
  }
  rescale_running_sums(t, sum, kNqv, Dp, rescale);
  amx_acc_steps(Da / 32, nqb, steps, as, BK / 2, bs, BQ, t.OT, BQ);
  return m;
}

static int64_t fwd_amx_group(const FwdState& s, int64_t b, int64_t n, int64_t ka, int64_t kb,
                             const uint32_t* Kh, const uint32_t* Vh, int64_t te, int64_t se,
                             FwdTile<uint32_t>& t, float* St, float* brow, uint32_t* Pw) {
  static_assert(BQ / W == 4, "the AMX forward takes 1 to 4 query vectors per tile");
  switch (t.nqv) {
    case 1: return fwd_amx_group_n<1>(s, b, n, ka, kb, Kh, Vh, te, se, t, St, brow, Pw);
    case 2: return fwd_amx_group_n<2>(s, b, n, ka, kb, Kh, Vh, te, se, t, St, brow, Pw);
    case 3: return fwd_amx_group_n<3>(s, b, n, ka, kb, Kh, Vh, te, se, t, St, brow, Pw);
    default: return fwd_amx_group_n<4>(s, b, n, ka, kb, Kh, Vh, te, se, t, St, brow, Pw);
  }
}
#endif

#if defined(FATRAIN_AMX)
// fwd_tile_end for AMX's bf16 O (the words path has q's dtype, bf16), the
// rows gathered down Oᵀ's columns (amx_store_bf16_column).
static void fwd_amx_store_o(const FwdState& s, int64_t b, int64_t n, const FwdTile<uint32_t>& t) {
  const Geo& g = s.g;
  const ForwardOperands& op = *s.op;
  const int64_t D = g.D;
  float* lse = op.lse + (b * g.N + n) * g.T;
  for (int64_t r = 0; r < t.ni; ++r) {
    const float l = t.lrow[r];
    uint16_t* dst = reinterpret_cast<uint16_t*>(row_ptr_mut(op.o, b, t.i0 + r, n));
    // As in fwd_tile_end: a query saw a key iff its max left -inf or l is NaN.
    if (t.mrow[r] != -kInf || l != l) {
      amx_store_bf16_column(t.OT + r, BQ, D, 1.0f / l, dst);
      lse[t.i0 + r] = t.mrow[r] * kLn2 + __builtin_logf(l);
    } else {
      memset(dst, 0, static_cast<size_t>(D) * sizeof(uint16_t));
      lse[t.i0 + r] = -kInf;
    }
  }
}
#endif

// Writes query tile t's rows of O (Oᵀ transposed back, divided by l) and L.
template <class Pk>
static void fwd_tile_end(const FwdState& s, int64_t b, int64_t n, const FwdTile<Pk>& t) {
  const PhaseScope phase(kPhaseStoreO);
  const Geo& g = s.g;
  const ForwardOperands& op = *s.op;
  const int64_t D = g.D;
  float* lse = op.lse + (b * g.N + n) * g.T;
#if defined(FATRAIN_AMX)
  if constexpr (Lanes<Pk>::kPair == 2) {
    fwd_amx_store_o(s, b, n, t);
    return;
  }
#endif
  // W rows of O at a time, Oᵀ's Dp rows (whole vectors) transposed a W x W
  // block at a time.
  const int64_t Dp = g.Dp;
  float rows[W * kMaxHeadDim];
  vf v[W];
  for (int64_t r0 = 0; r0 < t.ni; r0 += W) {
    for (int64_t d0 = 0; d0 < D; d0 += W) {
      for (int64_t k = 0; k < W; ++k) v[k] = ld(t.OT + (d0 + k) * BQ + r0);
      transpose_block(v);
      for (int64_t i = 0; i < W; ++i) st(rows + i * Dp + d0, v[i]);
    }
    for (int64_t r = r0; r < imin(t.ni, r0 + W); ++r) {
      float l = t.lrow[r];
      float* orow = rows + (r - r0) * Dp;
      char* dst = row_ptr_mut(op.o, b, t.i0 + r, n);
      // A query saw a key iff its running max left -inf (then l >= 1), or a
      // score was NaN (then l, O and L are NaN).
      if (t.mrow[r] != -kInf || l != l) {
        store_row(dst, op.o.dtype, D, orow, 1.0f / l);
        lse[t.i0 + r] = t.mrow[r] * kLn2 + __builtin_logf(l);
      } else {
        for (int64_t d = 0; d < D; ++d) orow[d] = 0.0f;
        store_row(dst, op.o.dtype, D, orow, 1.0f);
        lse[t.i0 + r] = -kInf;
      }
    }
  }
}

// Query tiles per forward item: up to kFwdQueryTiles adjacent tiles of one
// head share each read of a K and V tile (a head's K and V are megabytes at
// long sequences, beyond a core's L2), as long as the items still number at
// least four per thread. Each tile's arithmetic is the same whatever the
// grouping, so results do not depend on it.
constexpr int64_t kFwdQueryTiles = 4;
static int64_t forward_query_tiles(const Geo& g, int64_t threads) {
  const int64_t groups = g.B * g.N * ((g.ntq + kFwdQueryTiles - 1) / kFwdQueryTiles);
  return groups >= 4 * imax(1, threads) ? kFwdQueryTiles : 1;
}
static int64_t forward_items(const Geo& g, int64_t qtiles) {
  return g.B * g.N * ((g.ntq + qtiles - 1) / qtiles);
}

// One item: s.qtiles adjacent query tiles of one head, walked together over
// the key tiles (each tile in its own key range).
template <class Pk>
static void fwd_item(FwdState& s, int64_t idx) {
  const PhaseScope phase(kPhaseItems);
  constexpr int64_t kP = Lanes<Pk>::kPair;
  const Geo& g = s.g;
  const int64_t ngroups = (g.ntq + s.qtiles - 1) / s.qtiles;
  // Items run head by head, so the threads share one head's K and V in cache,
  // and within a head from the last query tiles down: under causality the
  // largest items go first and the smallest fill in at the end.
  int64_t bn = idx / ngroups;
  int64_t grp = ngroups - 1 - idx % ngroups;
  int64_t b = bn / g.N, n = bn % g.N, kh = n / g.G;
  const int64_t qt0 = grp * s.qtiles, nt = imin(s.qtiles, g.ntq - qt0);
  const int64_t Dq = fwd_qt_rows<Pk>(g), Do = fwd_ot_rows<Pk>(g);
  // Per tile: Qᵀ, Oᵀ and four [BQ] rows; shared: Sᵀ [BK][BQ], a bias row
  // [BQ] and Pᵀ pairs [BK / 2][BQ] (bf16), on AMX Sᵀ and Pᵀ for a group of
  // key tiles.
  const int64_t per_tile = round_up(Dq * BQ, 16) + Do * BQ + 4 * BQ;
#if defined(FATRAIN_AMX)
  const int64_t kgroup = kP == 2 ? kFwdAmxKeyTiles : 1;
#else
  const int64_t kgroup = 1;
#endif
  float* buf = falloc(nt * per_tile + kgroup * BK * BQ + BQ + (kP == 1 ? 0 : kgroup * BK * BQ / 2));
  if (!buf) {
    set_fail(&s.fail);
    return;
  }
  FwdTile<Pk> tiles[kFwdQueryTiles];
  int64_t te = q_eff(g, b), se = kv_eff(g, b), kt_lo = g.ntk, kt_hi = 0;
  for (int64_t u = 0; u < nt; ++u) {
    FwdTile<Pk>& t = tiles[u];
    float* base = buf + u * per_tile;
    t.QT = reinterpret_cast<Pk*>(base);
    t.OT = base + round_up(Dq * BQ, 16);
    t.mrow = t.OT + Do * BQ;
    t.lrow = t.mrow + BQ;
    t.alpha = t.lrow + BQ;
    t.mexp = t.alpha + BQ;
    const int64_t qt = qt0 + u;
    t.i0 = qt * BQ;
    t.ni = imin(BQ, g.T - t.i0);
    t.ncq = round_up(t.ni, W);
    t.nqv = t.ncq / W;
    key_tile_range(g, b, qt, &t.kt_begin, &t.kt_end);
    kt_lo = imin(kt_lo, t.kt_begin);
    kt_hi = imax(kt_hi, t.kt_end);
    fwd_tile_begin<Pk>(s, b, n, t);
  }
  float* St = buf + nt * per_tile;
  float* brow = St + kgroup * BK * BQ;
  Pk* Pw = reinterpret_cast<Pk*>(brow + BQ);
  const int64_t head = (b * g.KH + kh) * g.Sp * g.Dr;
  // A of Sᵀ = K Qᵀ: K's rows; A of Oᵀ += Vᵀ Pᵀ: V by columns (f32 rows, or
  // key pairs for bf16).
  const Pk* Kh;
  const Pk* Vh;
  if constexpr (kP == 1) {
    Kh = s.K + head;
    Vh = s.V + head;
  } else if constexpr (kAmx) {
    Kh = s.Kw + (b * g.KH + kh) * g.Sp * fwd_amx_dim(g) / 2;
    Vh = s.Vw + (b * g.KH + kh) * g.Sp * fwd_amx_dim(g) / 2;
  } else {
    Kh = s.Kw + head / 2;
    Vh = s.Vw + head / 2;
  }
#if defined(FATRAIN_AMX)
  if constexpr (kP == 2) amx_begin();
#endif
  int64_t visited = 0;
#if defined(FATRAIN_AMX)
  if constexpr (kP == 2) {
    for (int64_t k0 = kt_lo / kgroup * kgroup; k0 < kt_hi; k0 += kgroup)
      for (int64_t u = 0; u < nt; ++u) {
        FwdTile<Pk>& t = tiles[u];
        const int64_t ka = imax(k0, t.kt_begin), kb = imin(k0 + kgroup, t.kt_end);
        if (ka < kb) visited += fwd_amx_group(s, b, n, ka, kb, Kh, Vh, te, se, t, St, brow, Pw);
      }
  } else
#endif
  {
    for (int64_t kt = kt_lo; kt < kt_hi; ++kt)
      for (int64_t u = 0; u < nt; ++u)
        if (kt >= tiles[u].kt_begin && kt < tiles[u].kt_end)
          visited += fwd_tile_step<Pk>(s, b, n, kt, Kh, Vh, te, se, tiles[u], St, brow, Pw);
  }
#if defined(FATRAIN_AMX)
  if constexpr (kP == 2) amx_end();
#endif
  count_tile_visits(kTileVisitsForward, visited);
  for (int64_t u = 0; u < nt; ++u) fwd_tile_end<Pk>(s, b, n, tiles[u]);
  free(buf);
}

}  // namespace
}  // namespace fatrain::cpu::FATRAIN_ISA
