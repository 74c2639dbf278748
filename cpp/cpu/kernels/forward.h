// The forward pass: packing K and V, then one work item per (batch, head,
// query tile).
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
  // the f32 packing scratch.
  bool words;
  uint32_t* Kw;
  uint32_t* Vw;
  int fail;
};

static void fwd_pack(FwdState& s, int64_t idx) {
  const Geo& g = s.g;
  int64_t b = idx / g.KH, h = idx % g.KH;
  const int64_t head = idx * g.Sp * g.Dr;
  if (s.words) {
    float* rows = s.V + head;
    pack_rows(s.op->k, b, h, g.S, g.Sp, g.D, g.Dr, rows);
    pack_pair_rows(rows, g.Sp, g.Dp, g.Dr, s.Kw + head / 2);
    pack_rows(s.op->v, b, h, g.S, g.Sp, g.D, g.Dr, rows);
    pack_pair_interleaved(rows, g.Sp, g.Dp, g.Dr, s.Vw + head / 2);
    return;
  }
  pack_rows(s.op->k, b, h, g.S, g.Sp, g.D, g.Dr, s.K + head);
  pack_rows(s.op->v, b, h, g.S, g.Sp, g.D, g.Dr, s.V + head);
}

// One query tile of one head. The tile is computed key-major, Sᵀ = K Qᵀ
// (a key per row, the BQ queries along the vectors), so that every query's
// softmax statistics (running max m, sum l, rescale factor) are vectors of
// queries updated element-wise, with no reduction across vector lanes; the
// output accumulates as Oᵀ += Vᵀ Pᵀ (Vᵀ read in place from V's rows) and is
// transposed once when the item writes O.
template <class Pk>
static void fwd_item(FwdState& s, int64_t idx) {
  constexpr int64_t kP = Lanes<Pk>::kPair;
  constexpr int64_t kQV = BQ / W;  // query vectors per tile row
  const Geo& g = s.g;
  const ForwardOperands& op = *s.op;
  // Items run head by head, so the threads share one head's K and V in cache,
  // and within a head from the last query tile down: under causality the
  // largest items go first and the smallest fill in at the end.
  int64_t bn = idx / g.ntq;
  int64_t qt = g.ntq - 1 - idx % g.ntq;
  int64_t b = bn / g.N, n = bn % g.N, kh = n / g.G;
  int64_t i0 = qt * BQ, ni = imin(BQ, g.T - i0), ncq = round_up(ni, W), nqv = ncq / W;
  int64_t Dp = g.Dp, Dr = g.Dr, D = g.D, Dk = (D + kP - 1) / kP;
  // Qᵀ [Dk][BQ] (Pk), Oᵀ [Dp][BQ], Sᵀ [BK][BQ], m, l, alpha, the max used by
  // the exponentials and a bias row [BQ] each, Pᵀ pairs [BK / 2][BQ] (bf16).
  float* buf = falloc(2 * Dp * BQ + BK * BQ + 5 * BQ + (kP == 1 ? 0 : BK * BQ / 2));
  if (!buf) {
    set_fail(&s.fail);
    return;
  }
  Pk* QT = reinterpret_cast<Pk*>(buf);
  float* OT = buf + Dp * BQ;
  float* St = OT + Dp * BQ;
  float* mrow = St + BK * BQ;
  float* lrow = mrow + BQ;
  float* alpha = lrow + BQ;
  float* mexp = alpha + BQ;
  float* brow = mexp + BQ;
  Pk* Pw = reinterpret_cast<Pk*>(brow + BQ);
  {
    float row[kMaxHeadDim + 1];
    for (int64_t r = 0; r < BQ; ++r) {
      if (r < ni)
        load_row(row_ptr(op.q, b, i0 + r, n), op.q.dtype, D, row);
      else
        for (int64_t d = 0; d < D; ++d) row[d] = 0.0f;
      row[D] = 0.0f;  // the pair of an odd D's last element
      for (int64_t p = 0; p < Dk; ++p) {
        if constexpr (kP == 1)
          QT[p * BQ + r] = row[p];
        else
          QT[p * BQ + r] = bf16_pair(row[2 * p], row[2 * p + 1]);
      }
    }
  }
  memset(OT, 0, static_cast<size_t>(Dp * BQ) * 4);
  for (int64_t r = 0; r < BQ; ++r) {
    mrow[r] = -kInf;
    lrow[r] = 0.0f;
  }
  int64_t te = q_eff(g, b), se = kv_eff(g, b);
  const int64_t head = (b * g.KH + kh) * g.Sp * Dr;
  // A of Sᵀ = K Qᵀ: K's rows (ldk elements a row); A of Oᵀ += Vᵀ Pᵀ: V by
  // columns (f32 rows, or key pairs for bf16), Dr elements a row.
  const int64_t ldk = kP == 1 ? Dr : Dp / 2;
  const Pk* Kh;
  const Pk* Vh;
  if constexpr (kP == 1) {
    Kh = s.K + head;
    Vh = s.V + head;
  } else {
    Kh = s.Kw + head / 2;
    Vh = s.Vw + head / 2;
  }
  int64_t kt_begin, kt_end, visited = 0;
  key_tile_range(g, b, qt, &kt_begin, &kt_end);
  for (int64_t kt = kt_begin; kt < kt_end; ++kt) {
    int64_t j0 = kt * BK, nj = imin(BK, g.S - j0), nc = round_up(nj, W);
    int cls = classify(g, b, i0, ni, j0, nj, nc, ncq, te, se);
    if (cls == 0) continue;
    ++visited;
    score_gemm<Pk>(nj, ncq, Dk, Kh + j0 * ldk, ldk, QT, BQ, St, BQ);
    const TileScores<false> scores(g, b, n, i0, ni, ncq, cls, te, se);
    // Base-2 scores are c s: prep applies c (and masks, bias) a row at a time,
    // or, for plain tiles, the max and the exponentials apply it as they read.
    const bool plain = scores.plain();
    if (!plain)
      for (int64_t r = 0; r < nj; ++r) scores.prep(St + r * BQ, j0 + r, brow);
    const vf vc = bc(plain ? scores.exp2_scale() : 1.0f);
    // New running max per query. A query that has seen no finite score keeps
    // m = -inf and exponentiates against 0 (its p are 0, or NaN from a NaN
    // score); any NaN score makes its query's l, and so its O and L, NaN.
    // The tile's max per query: rows outer, so that the query vectors are
    // independent chains of maxima.
    vf mx[kQV];
    for (int64_t v = 0; v < kQV; ++v) mx[v] = bc(-kInf);
    for (int64_t r = 0; r < nj; ++r)
      for (int64_t v = 0; v < nqv; ++v) mx[v] = vmax(mx[v], ld(St + r * BQ + v * W));
    bool rescale = false;
    for (int64_t v = 0; v < nqv; ++v) {
      const vf mold = ld(mrow + v * W), mnew = vmax(mold, mx[v] * vc);
      const vi dead = mnew == bc(-kInf);
      const vf a = dead ? bc(1.0f) : vexp2(mold - mnew);
      st(mexp + v * W, dead ? bc(0.0f) : mnew);
      st(mrow + v * W, mnew);
      st(alpha + v * W, a);
      for (int k = 0; k < W; ++k) rescale |= a[k] != 1.0f;
    }
    vf sum[kQV];
    for (int64_t v = 0; v < kQV; ++v) sum[v] = vf{};
    for (int64_t r = 0; r < nj; ++r) {
      float* srow = St + r * BQ;
      for (int64_t v = 0; v < nqv; ++v) {
        const vf p = vexp2(ld(srow + v * W) * vc - ld(mexp + v * W));
        sum[v] += p;
        st(srow + v * W, p);
      }
    }
    for (int64_t v = 0; v < nqv; ++v)
      st(lrow + v * W, ld(lrow + v * W) * ld(alpha + v * W) + sum[v]);
    if (rescale) {
      for (int64_t d = 0; d < Dp; ++d)
        for (int64_t v = 0; v < nqv; ++v)
          st(OT + d * BQ + v * W, ld(OT + d * BQ + v * W) * ld(alpha + v * W));
    }
    acc_gemm_at<Pk>(Dp, ncq, (nj + kP - 1) / kP, Vh + j0 / kP * Dr, Dr,
                    row_pair_tile<Pk>(St, nj, BQ, ncq, Pw), BQ, OT, BQ);
  }
  count_tile_visits(kTileVisitsForward, visited);
  float* lse = op.lse + (b * g.N + n) * g.T;
  float orow[kMaxHeadDim];
  for (int64_t r = 0; r < ni; ++r) {
    float l = lrow[r];
    char* dst = row_ptr_mut(op.o, b, i0 + r, n);
    // A query saw a key iff its running max left -inf (then l >= 1), or a
    // score was NaN (then l, O and L are NaN).
    if (mrow[r] != -kInf || l != l) {
      for (int64_t d = 0; d < D; ++d) orow[d] = OT[d * BQ + r];
      store_row(dst, op.o.dtype, D, orow, 1.0f / l);
      lse[i0 + r] = mrow[r] * kLn2 + __builtin_logf(l);
    } else {
      for (int64_t d = 0; d < D; ++d) orow[d] = 0.0f;
      store_row(dst, op.o.dtype, D, orow, 1.0f);
      lse[i0 + r] = -kInf;
    }
  }
  free(buf);
}

}  // namespace
}  // namespace fatrain::cpu::FATRAIN_ISA
