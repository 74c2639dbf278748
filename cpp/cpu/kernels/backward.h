// The backward passes: the shared packing (backward_common), the fused
// single pass and the two-pass form, and the choice between them.
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
// Backward (and bias gradient) shared packing.
// ---------------------------------------------------------------------------
struct BwdState {
  Geo g;
  const SeqTensor *q, *k, *v, *o, *d_o;
  const float* lse;
  const BackwardOperands* bop;
  const BiasGradOperands* gop;
  float *Qp, *dOp, *QT, *dOT, *Drow, *Lb;  // per q head
  float *Kp, *Vp, *KT, *VT;              // per kv head
  // Only the forms the chosen passes read are packed (BwdForms); the others
  // stay null.
  // bf16 pairs (words): the products read these instead of the f32 packs,
  // which are not made (bwd_pack converts the rows a chunk at a time).
  // Rows with pairs along D (..w), transposed by tile (..Tw), and pairs along
  // the sequence (..i) for the B operands of dK, dV and dQ.
  bool words;
  uint32_t *Qw, *dOw, *QTw, *dOTw, *Qi, *dOi;  // per q head
  uint32_t *Kw, *Vw, *KTw, *VTw, *Ki;          // per kv head
  // On AMX (kAmx, words, D a multiple of 32): Kᵀ by key tile, keys along the
  // rows, [B*KH][Sp / BK][Dp][BK / 2]: the A operand of the fused pass's
  // dQᵀ += Kᵀ dSᵀ.
  uint32_t* KTa;
  int fail;
};

// The passes whose operand forms (PackView) backward_common packs:
//  - pass 1 (dQ, and the bias gradient): Qa, dOa, KT, VT and Kb;
//  - pass 2 (dK and dV): Ka, Va, QT, dOT, Qb and dOb;
//  - the fused pass: pass 2's, and for dQ Kb, or Kᵀ by key tile on AMX (KTa).
// In f32 the rows Qp, dOp, Kp and Vp are always made: they are the forms
// Qa, Qb, Ka and Kb (and dO's and V's) and the source of the others.
enum class BwdForms { kPass1, kTwoPass, kFused };

// The packed operands as the tile products read them. A: rows [len][lda];
// T: transposed by tile [ntiles][Dk][tile]; B: the B operand of products
// summed over the sequence, [len / kPair][Dr] (the f32 rows themselves).
template <class Pk>
struct PackView {
  const Pk *Qa, *dOa, *QT, *dOT, *Qb, *dOb;  // per q head
  const Pk *Ka, *Va, *KT, *VT, *Kb;          // per kv head
  int64_t lda;  // Dr (f32 rows) or Dp / 2 (bf16 pairs along D)
  int64_t Dk;   // ceil(D / kPair): K of the score products
};

template <class Pk>
static PackView<Pk> pack_view(const BwdState& s);
template <>
inline PackView<float> pack_view<float>(const BwdState& s) {
  return {s.Qp, s.dOp, s.QT, s.dOT, s.Qp, s.dOp, s.Kp, s.Vp, s.KT, s.VT, s.Kp, s.g.Dr, s.g.D};
}
template <>
inline PackView<uint32_t> pack_view<uint32_t>(const BwdState& s) {
  return {s.Qw, s.dOw, s.QTw, s.dOTw, s.Qi, s.dOi, s.Kw, s.Vw, s.KTw, s.VTw, s.Ki,
          s.g.Dp / 2, (s.g.D + 1) / 2};
}

// The product forms of n packed f32 rows [n][Dr] of a head (see BwdState),
// the first of them row `row0` of all the heads' rows (head index x padded
// length + row; even, and a multiple of the tile when n is not all of the
// head): with words, pairs along D (w), transposed pairs (tw) and pairs
// along the sequence (iw); else the f32 copy transposed by tile (t). A null
// form is not made.
static void pack_head_forms(const BwdState& s, const float* rows, int64_t n, int64_t tile,
                            int64_t row0, uint32_t* w, uint32_t* tw, uint32_t* iw, float* t) {
  const Geo& g = s.g;
  if (s.words) {
    if (w) pack_pair_rows(rows, n, g.Dp, g.Dr, w + row0 * g.Dp / 2);
    if (tw) pack_pair_transposed(rows, n, g.D, g.Dr, tile, tw + row0 * ((g.D + 1) / 2));
    if (iw) pack_pair_interleaved(rows, n, g.Dp, g.Dr, iw + row0 / 2 * g.Dr);
  } else if (t) {
    pack_transposed(rows, n, g.D, g.Dr, tile, t + row0 * g.D);
  }
}

// Drow = rowsum(dO * O) and the base-2 L of rows t0 .. t0 + n - 1 of query
// head qh (batch b, head h), dO's rows packed at dO [n][Dr]; W rows at a
// time: each lane sums one row's products in order of d with explicit FMAs
// (see fmadd), the W x W blocks of dO's and O's rows transposed so that the
// lanes run side by side.
static void pack_drow(const BwdState& s, int64_t b, int64_t h, int64_t qh, int64_t t0, int64_t n,
                      const float* dO) {
  const Geo& g = s.g;
  const int64_t D = g.D, Dp = g.Dp, Dr = g.Dr, te = q_eff(g, b);
  float* drow = s.Drow + qh * g.Tp;
  float* Lb = s.Lb + qh * g.Tp;
  const float* L = s.lse + qh * g.T;
  // Dead rows (L = -inf, or past the query length) get p = 0 through
  // L = +inf; a NaN L (a NaN row of the forward) stays NaN and spreads to the
  // gradients as in jax.nn.
  auto dead = [&](int64_t t) { return t >= te || t >= g.T || L[t] == -kInf; };
  float orows[W * kMaxHeadDim];
  vf a[W], c[W];
  for (int64_t r0 = 0; r0 < n; r0 += W) {
    bool live = false;
    for (int64_t i = 0; i < W; ++i) {
      float* orow = orows + i * Dp;
      if (dead(t0 + r0 + i)) {
        memset(orow, 0, static_cast<size_t>(Dp) * 4);
        continue;
      }
      live = true;
      load_row(row_ptr(*s.o, b, t0 + r0 + i, h), s.o->dtype, D, orow);
      memset(orow + D, 0, static_cast<size_t>(Dp - D) * 4);
    }
    vf acc = vf{};
    for (int64_t d0 = 0; live && d0 < D; d0 += W) {
      for (int64_t i = 0; i < W; ++i) {
        a[i] = ld(dO + (r0 + i) * Dr + d0);
        c[i] = ld(orows + i * Dp + d0);
      }
      transpose_block(a);
      transpose_block(c);
      for (int64_t k = 0; k < imin(W, D - d0); ++k) acc = fmadd(a[k], c[k], acc);
    }
    for (int64_t i = 0; i < W; ++i) {
      const int64_t t = t0 + r0 + i;
      drow[t] = dead(t) ? 0.0f : acc[i];
      Lb[t] = dead(t) ? kInf : L[t] * kLog2e;
    }
  }
}

// Rows a pre-pass item packs at a time on the bf16 pair path, whose f32
// rows only feed the pair forms and Drow: a chunk's rows are still in L2
// when its forms read them (a head's rows are megabytes at long sequences).
// A multiple of BQ, BK and W: chunks hold whole tiles, pairs and vectors.
constexpr int64_t kPackChunkRows = 256;

// One pre-pass item: a query head (Q, dO, their forms, Drow and L) or a kv
// head (K, V and their forms). In f32 the rows are the packs Qp, dOp, Kp and
// Vp, the whole head at once; with words they go through a chunk scratch.
static void bwd_pack(BwdState& s, int64_t idx) {
  const PhaseScope phase(kPhasePack);
  const Geo& g = s.g;
  const int64_t Dr = g.Dr, D = g.D;
  const bool qside = idx < g.B * g.N;
  const int64_t head = qside ? idx : idx - g.B * g.N;  // b * N + n, or b * KH + h
  const int64_t heads = qside ? g.N : g.KH, b = head / heads, h = head % heads;
  const int64_t L = qside ? g.T : g.S, Lp = qside ? g.Tp : g.Sp;
  const int64_t chunk = s.words ? imin(kPackChunkRows, Lp) : Lp;
  float* buf = s.words ? falloc(2 * chunk * Dr) : nullptr;
  if (s.words && !buf) {
    set_fail(&s.fail);
    return;
  }
  for (int64_t t0 = 0; t0 < Lp; t0 += chunk) {
    const int64_t n = imin(chunk, Lp - t0), row0 = head * Lp + t0;
    float* A = s.words ? buf : (qside ? s.Qp : s.Kp) + row0 * Dr;
    float* B = s.words ? buf + chunk * Dr : (qside ? s.dOp : s.Vp) + row0 * Dr;
    pack_rows(qside ? *s.q : *s.k, b, h, t0, n, L, D, Dr, A);
    pack_rows(qside ? *s.d_o : *s.v, b, h, t0, n, L, D, Dr, B);
    if (qside) {
      pack_head_forms(s, A, n, BQ, row0, s.Qw, s.QTw, s.Qi, s.QT);
      pack_head_forms(s, B, n, BQ, row0, s.dOw, s.dOTw, s.dOi, s.dOT);
      pack_drow(s, b, h, head, t0, n, B);
    } else {
      pack_head_forms(s, A, n, BK, row0, s.Kw, s.KTw, s.Ki, s.KT);
      pack_head_forms(s, B, n, BK, row0, s.Vw, s.VTw, nullptr, s.VT);
      if (s.KTa) pack_amx_transposed(A, n, g.Dp, Dr, g.Dp, BK, s.KTa + row0 * g.Dp / 2);
    }
  }
  free(buf);
}

// The backward's AMX products (tile_products.h) compute whole 32 x 32 blocks
// of C and whole 32-element steps of the summed dimension (D, a multiple of
// 32 on this path, and 32 * amx_blocks(n) queries or keys): the computed
// tiles' rows and columns past the real ones are finite (zero padding of the
// packs, or P = 0), and operands summed over past the real keys are zero, so
// that both backward forms add exactly the same terms to dQ.
static inline int64_t amx_blocks(int64_t n) { return (n + 31) / 32; }

// Key tiles per step of the fused pass (bwd_fused).
constexpr int64_t kBwdKeyTiles = 4;

// dS tile in q-major orientation: rows = queries i0.. (ni), cols = keys j0..
// (nc computed, nj real). On return Sb holds dS = P * (dP - Drow); dPb is
// clobbered. brow: scratch of BK floats. The score blocks outside the band
// `skip` are not computed and dS there is undefined: a caller that reads dS
// everywhere passes kWholeTile, pass 1's dQ its query-major tile_band, over
// which it sums.
template <class Pk>
static void ds_tile_q(const BwdState& s, int64_t b, int64_t n, int64_t qt, int64_t kt, int cls,
                      int64_t te, int64_t se, float* Sb, float* dPb, float* brow,
                      const Band& skip) {
  const Geo& g = s.g;
  const PackView<Pk> o = pack_view<Pk>(s);
  int64_t i0 = qt * BQ, ni = imin(BQ, g.T - i0);
  int64_t j0 = kt * BK, nj = imin(BK, g.S - j0), nc = round_up(nj, W);
  int64_t qh = b * g.N + n, kvh = b * g.KH + n / g.G;
  const int64_t Tq = (qh * g.Tp + i0) * o.lda, Tk = kvh * g.Sp * o.Dk + kt * o.Dk * BK;
  if constexpr (kAmx && Lanes<Pk>::kPair == 2) {
    amx_gemm(amx_blocks(ni), amx_blocks(nc), o.Dk / 16, o.Qa + Tq, o.lda, o.KT + Tk, BK, Sb, BK);
    amx_gemm(amx_blocks(ni), amx_blocks(nc), o.Dk / 16, o.dOa + Tq, o.lda, o.VT + Tk, BK, dPb,
             BK);
  } else {
    score_gemm<Pk>(ni, nc, o.Dk, o.Qa + Tq, o.lda, o.KT + Tk, BK, Sb, BK, skip);
    score_gemm<Pk>(ni, nc, o.Dk, o.dOa + Tq, o.lda, o.VT + Tk, BK, dPb, BK, skip);
  }
  const float* Lb = s.Lb + qh * g.Tp;
  const float* drow = s.Drow + qh * g.Tp;
  const TileScores<true> scores(g, b, n, j0, nj, nc, cls, te, se);
  // Plain tiles: the exponentials apply the scale (see TileScores::plain).
  const bool plain = scores.plain() && ni % W == 0;
  const vf vc = bc(plain ? scores.exp2_scale() : 1.0f);
  for (int64_t r = 0; r < ni; ++r) {
    int64_t i = i0 + r;
    float* srow = Sb + r * BK;
    float* dprow = dPb + r * BK;
    if (!plain) scores.prep(srow, i, brow);
    vf vL = bc(Lb[i]), vD = bc(drow[i]);
    for (int64_t c = 0; c < nc; c += W) {
      vf p = vexp2<Pk>(ld(srow + c) * vc - vL);
      st(srow + c, p * (ld(dprow + c) - vD));
    }
  }
}

template <class Pk>
static void bwd_pass1(BwdState& s, int64_t idx) {
  const PhaseScope phase(kPhaseItems);
  constexpr int64_t kP = Lanes<Pk>::kPair;
  const Geo& g = s.g;
  const BackwardOperands& op = *s.bop;
  const PackView<Pk> o = pack_view<Pk>(s);
  int64_t qt = g.ntq - 1 - idx / (g.B * g.N);
  int64_t bn = idx % (g.B * g.N);
  int64_t b = bn / g.N, n = bn % g.N, kvh = b * g.KH + n / g.G;
  int64_t i0 = qt * BQ, ni = imin(BQ, g.T - i0);
  int64_t Dp = g.Dp, Dr = g.Dr, D = g.D;
  float* buf = falloc(BQ * Dr + 2 * BQ * BK + BK + (kP == 1 ? 0 : BQ * BK / 2));
  if (!buf) {
    set_fail(&s.fail);
    return;
  }
  float* dQ = buf;
  float* Sb = dQ + BQ * Dr;
  float* dPb = Sb + BQ * BK;
  float* brow = dPb + BQ * BK;
  Pk* dSw = reinterpret_cast<Pk*>(brow + BK);  // [BQ][BK / 2] (bf16 pairs only)
  memset(dQ, 0, static_cast<size_t>(BQ * Dr) * 4);
  int64_t te = q_eff(g, b), se = kv_eff(g, b);
  int64_t kt_begin, kt_end, visited = 0;
  key_tile_range(g, b, qt, &kt_begin, &kt_end);
#if defined(FATRAIN_AMX)
  if constexpr (kP == 2) amx_begin();
#endif
  for (int64_t kt = kt_begin; kt < kt_end; ++kt) {
    int64_t j0 = kt * BK, nj = imin(BK, g.S - j0), nc = round_up(nj, W);
    int cls = classify(g, b, i0, ni, j0, nj, nc, ni, te, se);
    if (cls == 0) continue;
    ++visited;
    const Band band = tile_band(g, cls, i0, j0, true);
    ds_tile_q<Pk>(s, b, n, qt, kt, cls, te, se, Sb, dPb, brow, band);
    if constexpr (kAmx && kP == 2) {
      // dS's columns past nj, up to the whole step, are +0 (see amx_blocks).
      amx_a_tile(Sb, ni, BK, nj, dSw);
      amx_acc_gemm(amx_blocks(ni), Dp / 32, amx_blocks(nj), dSw, BK / 2,
                   o.Kb + (kvh * g.Sp + j0) / 2 * Dr, Dr, dQ, Dr);
    } else {
      // dS is zero outside the band (see bwd_fused's dQ, which sums alike).
      acc_gemm<Pk>(ni, Dp, (nj + kP - 1) / kP, a_tile<Pk>(Sb, ni, BK, nj, dSw), BK / kP,
                   o.Kb + (kvh * g.Sp + j0) / kP * Dr, Dr, dQ, Dr, {kTrimSumA, band});
    }
  }
#if defined(FATRAIN_AMX)
  if constexpr (kP == 2) amx_end();
#endif
  count_tile_visits(kTileVisitsBackwardDq, visited);
  for (int64_t r = 0; r < ni; ++r)
    store_row(row_ptr_mut(op.dq, b, i0 + r, n), op.dq.dtype, D, dQ + r * Dr, g.scale);
  free(buf);
}

// One (key tile, query tile) pair of the dK/dV sums, shared by pass 2 and the
// fused pass: S^T and dP^T (rows: the nj keys from j0; columns: query tile qt
// of head n), turned in place into P^T and dS^T, then dV += P^T.dO and
// dK += dS^T.Q. cls: classify()'s verdict for the pair, not 0.
template <class Pk>
static void dkdv_tile(const BwdState& s, const PackView<Pk>& o, int64_t b, int64_t n, int64_t qt,
                      int cls, int64_t j0, int64_t nj, const Pk* Kh, const Pk* Vh, int64_t te,
                      int64_t se, float* St, float* dPt, float* brow, Pk* Pw, Pk* dSw, float* dK,
                      float* dV) {
  constexpr int64_t kP = Lanes<Pk>::kPair;
  const Geo& g = s.g;
  const int64_t Dp = g.Dp, Dr = g.Dr, qh = b * g.N + n;
  const int64_t i0 = qt * BQ, ni = imin(BQ, g.T - i0), ncq = round_up(ni, W);
  const float* Lb = s.Lb + qh * g.Tp;
  const float* drow = s.Drow + qh * g.Tp;
  const TileScores<false> scores(g, b, n, i0, ni, ncq, cls, te, se);
  // On partial tiles, the score products skip blocks outside the band and
  // dV and dK sum Pᵀ and dSᵀ over the band only (zero outside it).
  const Band band = tile_band(g, cls, i0, j0, false);
  if constexpr (kAmx && kP == 2) {
    amx_gemm(amx_blocks(nj), amx_blocks(ncq), o.Dk / 16, Kh, o.lda,
             o.QT + qh * g.Tp * o.Dk + qt * o.Dk * BQ, BQ, St, BQ);
    amx_gemm(amx_blocks(nj), amx_blocks(ncq), o.Dk / 16, Vh, o.lda,
             o.dOT + qh * g.Tp * o.Dk + qt * o.Dk * BQ, BQ, dPt, BQ);
  } else {
    // The blocks of Sᵀ and dPᵀ outside the band widened by kMR are not
    // computed: dK and dV read Pᵀ and dSᵀ in the band only (pairs of queries
    // at most one past it), and the fused pass's dQ reads dSᵀ by columns in
    // the query-major band's blocks of kMR queries (pairs of keys), which
    // reach at most kMR past the band.
    const Band skip = band.widened(kMR);
    score_gemm<Pk>(nj, ncq, o.Dk, Kh, o.lda, o.QT + qh * g.Tp * o.Dk + qt * o.Dk * BQ, BQ, St,
                   BQ, skip);
    score_gemm<Pk>(nj, ncq, o.Dk, Vh, o.lda, o.dOT + qh * g.Tp * o.Dk + qt * o.Dk * BQ, BQ, dPt,
                   BQ, skip);
  }
  // Plain tiles: the exponentials apply the scale (see TileScores::plain).
  const bool plain = scores.plain() && nj % W == 0;
  const vf vc = bc(plain ? scores.exp2_scale() : 1.0f);
  // With bf16 pairs on FMAs, Pᵀ and dSᵀ are written straight as the words
  // a_tile would make of them (Pw, dSw: BQ / 2 a row, an odd ni's padding
  // column 0); dSᵀ stays in f32 too, for the fused pass's dQ.
  constexpr bool kWords = kP == 2 && !kAmx;
  for (int64_t r = 0; r < nj; ++r) {
    float* srow = St + r * BQ;
    float* dprow = dPt + r * BQ;
    if (!plain) scores.prep(srow, j0 + r, brow);
    for (int64_t c = 0; c < ncq; c += W) {
      const vf p = vexp2<Pk>(ld(srow + c) * vc - ld(Lb + i0 + c));
      const vf ds = p * (ld(dprow + c) - ld(drow + i0 + c));
      if constexpr (kWords) {
        operand_bf16_vector(p, reinterpret_cast<uint16_t*>(Pw + r * BQ / 2) + c);
        operand_bf16_vector(ds, reinterpret_cast<uint16_t*>(dSw + r * BQ / 2) + c);
      } else {
        st(srow + c, p);
      }
      st(dprow + c, ds);
    }
    if (kWords && ni % 2) {
      reinterpret_cast<uint16_t*>(Pw + r * BQ / 2)[ni] = 0;
      reinterpret_cast<uint16_t*>(dSw + r * BQ / 2)[ni] = 0;
    }
  }
  if constexpr (kAmx && kP == 2) {
    // Pᵀ and dSᵀ over whole 32-query steps: St's and dPt's columns past ncq
    // hold the padded queries' raw (zero) products, and dO's and Q's rows
    // there are zero.
    const int64_t nq = 32 * amx_blocks(ni);
    amx_acc_gemm(amx_blocks(nj), Dp / 32, amx_blocks(ni), amx_a_tile(St, nj, BQ, nq, Pw), BQ / 2,
                 o.dOb + (qh * g.Tp + i0) / 2 * Dr, Dr, dV, Dr);
    amx_acc_gemm(amx_blocks(nj), Dp / 32, amx_blocks(ni), amx_a_tile(dPt, nj, BQ, nq, dSw),
                 BQ / 2, o.Qb + (qh * g.Tp + i0) / 2 * Dr, Dr, dK, Dr);
  } else {
    const Pk* Pa = kWords ? Pw : a_tile<Pk>(St, nj, BQ, ni, Pw);
    const Pk* dSa = kWords ? dSw : a_tile<Pk>(dPt, nj, BQ, ni, dSw);
    acc_gemm<Pk>(nj, Dp, (ni + kP - 1) / kP, Pa, BQ / kP,
                 o.dOb + (qh * g.Tp + i0) / kP * Dr, Dr, dV, Dr, {kTrimSumA, band});
    acc_gemm<Pk>(nj, Dp, (ni + kP - 1) / kP, dSa, BQ / kP,
                 o.Qb + (qh * g.Tp + i0) / kP * Dr, Dr, dK, Dr, {kTrimSumA, band});
  }
}

template <class Pk>
static void bwd_pass2(BwdState& s, int64_t idx) {
  const PhaseScope phase(kPhaseItems);
  constexpr int64_t kP = Lanes<Pk>::kPair;
  const Geo& g = s.g;
  const BackwardOperands& op = *s.bop;
  const PackView<Pk> o = pack_view<Pk>(s);
  int64_t kt = idx / (g.B * g.KH);
  int64_t bk = idx % (g.B * g.KH);
  int64_t b = bk / g.KH, kh = bk % g.KH;
  int64_t j0 = kt * BK, nj = imin(BK, g.S - j0);
  int64_t Dr = g.Dr, D = g.D;
  float* buf = falloc(2 * BK * Dr + 2 * BK * BQ + BQ + (kP == 1 ? 0 : BK * BQ));
  if (!buf) {
    set_fail(&s.fail);
    return;
  }
  float* dK = buf;
  float* dV = dK + BK * Dr;
  float* St = dV + BK * Dr;
  float* dPt = St + BK * BQ;
  float* brow = dPt + BK * BQ;
  Pk* Pw = reinterpret_cast<Pk*>(brow + BQ);  // [BK][BQ / 2] each (bf16 pairs only)
  Pk* dSw = Pw + BK * BQ / 2;
  memset(dK, 0, static_cast<size_t>(2 * BK * Dr) * 4);
  int64_t te = q_eff(g, b), se = kv_eff(g, b);
  const Pk* Kh = o.Ka + (bk * g.Sp + j0) * o.lda;
  const Pk* Vh = o.Va + (bk * g.Sp + j0) * o.lda;
  int64_t qt_begin, qt_end, visited = 0;
  query_tile_range(g, b, kt, &qt_begin, &qt_end);
#if defined(FATRAIN_AMX)
  if constexpr (kP == 2) amx_begin();
#endif
  for (int64_t gi = 0; gi < g.G; ++gi) {
    int64_t n = kh * g.G + gi;
    for (int64_t qt = qt_begin; qt < qt_end; ++qt) {
      int64_t i0 = qt * BQ, ni = imin(BQ, g.T - i0), ncq = round_up(ni, W);
      int64_t nc = round_up(nj, W);
      int cls = classify(g, b, i0, ni, j0, nj, nc, ncq, te, se);
      if (cls == 0) continue;
      ++visited;
      dkdv_tile<Pk>(s, o, b, n, qt, cls, j0, nj, Kh, Vh, te, se, St, dPt, brow, Pw, dSw, dK, dV);
    }
  }
#if defined(FATRAIN_AMX)
  if constexpr (kP == 2) amx_end();
#endif
  count_tile_visits(kTileVisitsBackwardDkDv, visited);
  for (int64_t r = 0; r < nj; ++r) {
    store_row(row_ptr_mut(op.dk, b, j0 + r, kh), op.dk.dtype, D, dK + r * Dr, g.scale);
    store_row(row_ptr_mut(op.dv, b, j0 + r, kh), op.dv.dtype, D, dV + r * Dr, 1.0f);
  }
  free(buf);
}

// One (batch, kv head) slice in a single pass: for each key tile and each
// query tile of the slice's query heads, S, P, dP and dS are computed once and
// feed all three gradients, five tile products in all (the two-pass form
// recomputes S and dP for dQ: seven). dQ of the slice's G query heads stays in
// an f32 accumulator of G x T x D floats until the end. Each slice owns its
// dQ, dK and dV rows, so no atomics; the sums run in the two-pass order (key
// tiles ascending for dQ; query heads, then query tiles, for dK and dV).
template <class Pk>
static void bwd_fused(BwdState& s, int64_t idx) {
  const PhaseScope phase(kPhaseItems);
  constexpr int64_t kP = Lanes<Pk>::kPair;
  const Geo& g = s.g;
  const BackwardOperands& op = *s.bop;
  const PackView<Pk> o = pack_view<Pk>(s);
  int64_t b = idx / g.KH, kh = idx % g.KH;
  int64_t Dp = g.Dp, Dr = g.Dr, D = g.D;
  // The key tiles go kBwdKeyTiles at a time, each query tile visiting them
  // all in turn, so that the query side's packs (Q, dO and their transposes
  // or pairs, dQ: megabytes per head, beyond L2) stream once per group
  // instead of once per key tile. Each sum keeps its order (dQ: key tiles
  // ascending; dK, dV: query heads, then query tiles), so the results are
  // bitwise those of one key tile at a time.
  constexpr int64_t kKG = kBwdKeyTiles;
  float* buf = falloc(g.G * g.Tp * Dr + kKG * 2 * BK * Dr + 2 * BK * BQ + BQ +
                      (kP == 1 ? 0 : 3 * BK * BQ / 2));
  if (!buf) {
    set_fail(&s.fail);
    return;
  }
  float* dQ = buf;
  float* dKV = dQ + g.G * g.Tp * Dr;  // per key tile of the group: dK [BK][Dr], dV [BK][Dr]
  float* St = dKV + kKG * 2 * BK * Dr;
  float* dPt = St + BK * BQ;
  float* brow = dPt + BK * BQ;
  // Pᵀ and dSᵀ with pairs along queries, dSᵀ with pairs along keys (bf16 only).
  Pk* Pw = reinterpret_cast<Pk*>(brow + BQ);
  Pk* dSw = Pw + BK * BQ / 2;
  Pk* dSq = dSw + BK * BQ / 2;
  memset(dQ, 0, static_cast<size_t>(g.G * g.Tp * Dr) * 4);
  int64_t te = q_eff(g, b), se = kv_eff(g, b), visited = 0;
  // On AMX, dQ is kept transposed, dQᵀ [G][ntq][Dp][BQ] in dQ's space, and
  // accumulates dQᵀ += Kᵀ dSᵀ: the same terms in the same order as pass 1's
  // dQ += dS K (see amx_blocks), with no transpose of dSᵀ per tile.
  constexpr bool kAmxDq = kAmx && kP == 2;
#if defined(FATRAIN_AMX)
  if constexpr (kP == 2) amx_begin();
#endif
  for (int64_t k0 = 0; k0 < g.ntk; k0 += kKG) {
    const int64_t k1 = imin(g.ntk, k0 + kKG);
    memset(dKV, 0, static_cast<size_t>((k1 - k0) * 2 * BK * Dr) * 4);
    int64_t qt_begin[kKG] = {}, qt_end[kKG] = {}, qt_lo = g.ntq, qt_hi = 0;
    for (int64_t kt = k0; kt < k1; ++kt) {
      query_tile_range(g, b, kt, &qt_begin[kt - k0], &qt_end[kt - k0]);
      qt_lo = imin(qt_lo, qt_begin[kt - k0]);
      qt_hi = imax(qt_hi, qt_end[kt - k0]);
    }
    for (int64_t gi = 0; gi < g.G; ++gi) {
      int64_t n = kh * g.G + gi;
      for (int64_t qt = qt_lo; qt < qt_hi; ++qt) {
        int64_t i0 = qt * BQ, ni = imin(BQ, g.T - i0), ncq = round_up(ni, W);
        for (int64_t kt = k0; kt < k1; ++kt) {
          if (qt < qt_begin[kt - k0] || qt >= qt_end[kt - k0]) continue;
          int64_t j0 = kt * BK, nj = imin(BK, g.S - j0), nc = round_up(nj, W);
          int cls = classify(g, b, i0, ni, j0, nj, nc, ncq, te, se);
          if (cls == 0) continue;
          ++visited;
          const Pk* Kh = o.Ka + (idx * g.Sp + j0) * o.lda;
          const Pk* Vh = o.Va + (idx * g.Sp + j0) * o.lda;
          float* dK = dKV + (kt - k0) * 2 * BK * Dr;
          dkdv_tile<Pk>(s, o, b, n, qt, cls, j0, nj, Kh, Vh, te, se, St, dPt, brow, Pw, dSw, dK,
                        dK + BK * Dr);
          if constexpr (kAmxDq) {
            // dSᵀ's key pairs over whole 32-key steps.
            amx_acc_gemm(Dp / 32, amx_blocks(ni), amx_blocks(nj),
                         s.KTa + (idx * g.Sp + j0) * Dp / 2, BK / 2,
                         amx_row_pair_tile(dPt, nj, BQ, 32 * amx_blocks(ni), dSq), BQ,
                         dQ + (gi * g.Tp + i0) * Dp, BQ);
          } else {
            // dQ[i0.., :] += dS . K, dS read by columns out of dSᵀ in dPt,
            // summed over the query-major band as pass 1 sums it.
            acc_gemm_at<Pk>(ni, Dp, (nj + kP - 1) / kP, row_pair_tile<Pk>(dPt, nj, BQ, ncq, dSq),
                            BQ, o.Kb + (idx * g.Sp + j0) / kP * Dr, Dr,
                            dQ + (gi * g.Tp + i0) * Dr, Dr,
                            {kTrimSumA, tile_band(g, cls, i0, j0, true)});
          }
        }
      }
    }
    for (int64_t kt = k0; kt < k1; ++kt) {
      const int64_t j0 = kt * BK, nj = imin(BK, g.S - j0);
      const float* dK = dKV + (kt - k0) * 2 * BK * Dr;
      const float* dV = dK + BK * Dr;
      for (int64_t r = 0; r < nj; ++r) {
        store_row(row_ptr_mut(op.dk, b, j0 + r, kh), op.dk.dtype, D, dK + r * Dr, g.scale);
        store_row(row_ptr_mut(op.dv, b, j0 + r, kh), op.dv.dtype, D, dV + r * Dr, 1.0f);
      }
    }
  }
#if defined(FATRAIN_AMX)
  if constexpr (kP == 2) amx_end();
#endif
  // Each tile pair served both the dQ and the dK/dV sums of the two-pass form.
  count_tile_visits(kTileVisitsBackwardDq, visited);
  count_tile_visits(kTileVisitsBackwardDkDv, visited);
  for (int64_t gi = 0; gi < g.G; ++gi) {
    int64_t n = kh * g.G + gi;
    for (int64_t t = 0; t < g.T; ++t) {
      const float* src = dQ + (gi * g.Tp + t) * Dr;
#if defined(FATRAIN_AMX)
      if constexpr (kAmxDq) {
        // dQ is bf16 like q on this path.
        amx_store_bf16_column(dQ + (gi * g.Tp + t / BQ * BQ) * Dp + t % BQ, BQ, D, g.scale,
                              reinterpret_cast<uint16_t*>(row_ptr_mut(op.dq, b, t, n)));
        continue;
      }
#endif
      store_row(row_ptr_mut(op.dq, b, t, n), op.dq.dtype, D, src, g.scale);
    }
  }
  free(buf);
}

// The fused single pass (five products per tile pair, one work item per
// (batch, kv head)) or the two passes (seven, with q tiles and kv tiles as
// items): the fused pass when its coarse items still keep the threads about
// as busy, i.e. rounds x 5 <= items x 7 / threads.
static bool use_fused_backward(const Geo& g, int64_t threads) {
  int64_t items = g.B * g.KH;
  int64_t t = imax(1, threads);
  int64_t rounds = (items + t - 1) / t;
  return rounds * 5 * t <= items * 7;
}

// Packs the operands the passes `forms` read (words: the bf16 pair packs
// instead of the f32 transposed ones, see BwdState).
static const char* backward_common(BwdState& s, const ParallelFor& parallel, BwdForms forms,
                                   bool words, void** handle) {
  const Geo& g = s.g;
  const bool pass1 = forms != BwdForms::kFused, pass2 = forms != BwdForms::kPass1;
  // The fused pass's dQ: Kᵀ by key tile on AMX, else Kb like pass 1.
  const bool amx_dq = forms == BwdForms::kFused && kAmx && words;
  const bool kb = pass1 || (forms == BwdForms::kFused && !amx_dq);
  const int64_t qsz = g.B * g.N * g.Tp * g.Dr, qtsz = g.B * g.N * g.Tp * g.D;
  const int64_t ksz = g.B * g.KH * g.Sp * g.Dr, ktsz = g.B * g.KH * g.Sp * g.D;
  const int64_t rsz = g.B * g.N * g.Tp;
  const int64_t segsz = g.qseg ? segment_tile_ints(g) : 0;
  // Word packs: rows and sequence pairs hold at most half an f32 row pack each,
  // transposed ones ceil(D / 2) words per row.
  const int64_t qwsz = qsz / 2, qtwsz = g.B * g.N * g.Tp * ((g.D + 1) / 2);
  const int64_t kwsz = ksz / 2, ktwsz = g.B * g.KH * g.Sp * ((g.D + 1) / 2);
  s.words = words;
  int32_t* segment_tiles = nullptr;
  // Carves the scratch into the packs (a measuring Carver only sizes it).
  auto carve = [&](Carver& c) {
    auto f = [&c](bool made, int64_t n) { return made ? c.take(n) : nullptr; };
    auto w = [&c](bool made, int64_t n) {
      return made ? reinterpret_cast<uint32_t*>(c.take(n)) : nullptr;
    };
    segment_tiles = reinterpret_cast<int32_t*>(f(g.qseg != nullptr, segsz));
    s.Qp = f(!words, qsz);
    s.dOp = f(!words, qsz);
    s.Drow = c.take(rsz);
    s.Lb = c.take(rsz);
    s.Kp = f(!words, ksz);
    s.Vp = f(!words, ksz);
    s.Qw = w(words && pass1, qwsz);
    s.dOw = w(words && pass1, qwsz);
    s.Qi = w(words && pass2, qwsz);
    s.dOi = w(words && pass2, qwsz);
    s.QTw = w(words && pass2, qtwsz);
    s.dOTw = w(words && pass2, qtwsz);
    s.Kw = w(words && pass2, kwsz);
    s.Vw = w(words && pass2, kwsz);
    s.Ki = w(words && kb, kwsz);
    s.KTw = w(words && pass1, ktwsz);
    s.VTw = w(words && pass1, ktwsz);
    s.KTa = w(amx_dq, kwsz);
    s.QT = f(!words && pass2, qtsz);
    s.dOT = f(!words && pass2, qtsz);
    s.KT = f(!words && pass1, ktsz);
    s.VT = f(!words && pass1, ktsz);
  };
  Carver size{nullptr, 0};
  carve(size);
  float* base = scratch_take(size.used, handle);
  if (!base) return kOom;
  Carver c{base, 0};
  carve(c);
  if (segment_tiles) make_segment_tiles(s.g, segment_tiles);
  s.fail = 0;
  run_items<BwdState, bwd_pack>(parallel, g.B * g.N + g.B * g.KH, s);
  return s.fail ? kOom : nullptr;
}

}  // namespace
}  // namespace fatrain::cpu::FATRAIN_ISA
