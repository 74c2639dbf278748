// Problem geometry and which scores are visible: lengths, causality,
// windows, segment-id tile ranges, tile classification, and turning raw
// dot products into masked base-2 scores.
//
// Part of the CPU kernels compiled once per ISA: see attention_cpu_impl.h.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "vectors.h"

namespace fatrain::cpu::FATRAIN_ISA {
namespace {

// ---------------------------------------------------------------------------
// Problem geometry and visibility.
// ---------------------------------------------------------------------------
struct Geo {
  // Dp: the head dim padded to whole vectors (the width the products compute);
  // Dr: the row stride of packed f32 rows, sequence-pair rows and row
  // accumulators, Dp plus 16 where Dp floats are a multiple of 512 bytes,
  // so that consecutive rows do not fall into the same L1 sets.
  int64_t B, N, KH, G, T, S, D, Dp, Dr, Tp, Sp, ntq, ntk;
  float scale;
  bool causal;
  int64_t wl, wr;
  const int32_t* qlen;
  const int32_t* kvlen;
  // Segment ids ([B, T] and [B, S]; null when absent) and what
  // make_segment_tiles derives from them: the id range of every query tile
  // ([B * ntq]) and key tile ([B * ntk]), and the tiles of the other side
  // whose ranges meet it, first and last (first > last: none).
  const int32_t* qseg;
  const int32_t* kvseg;
  int32_t *qt_min, *qt_max, *kt_min, *kt_max;
  int32_t *qt_kfirst, *qt_klast, *kt_qfirst, *kt_qlast;
  const void* bias;
  DType bias_dt;
  int64_t bdims[4], bstr[4];
  const uint8_t* mask;
  int64_t mdims[4], mstr[4];
};

static void make_geo(const AttentionProblem& p, Geo& g) {
  g.B = p.batch;
  g.N = p.q_heads;
  g.KH = p.kv_heads;
  g.G = p.q_heads / p.kv_heads;
  g.T = p.q_len;
  g.S = p.kv_len;
  g.D = p.head_dim;
  g.Dp = round_up(g.D, W);
  g.Dr = g.Dp % 128 == 0 ? g.Dp + 16 : g.Dp;
  g.Tp = round_up(g.T, BQ);
  g.Sp = round_up(g.S, BK);
  g.ntq = g.Tp / BQ;
  g.ntk = g.Sp / BK;
  g.scale = p.scale;
  g.causal = p.causal;
  // A window at least T + S wide is unbounded (also avoids overflow in i + wr).
  g.wl = p.window_left >= g.T + g.S ? -1 : p.window_left;
  g.wr = p.window_right >= g.T + g.S ? -1 : p.window_right;
  g.qlen = p.q_lengths;
  g.kvlen = p.kv_lengths;
  g.qseg = p.q_segment_ids;
  g.kvseg = p.kv_segment_ids;
  g.qt_min = g.qt_max = g.kt_min = g.kt_max = nullptr;
  g.qt_kfirst = g.qt_klast = g.kt_qfirst = g.kt_qlast = nullptr;
  g.bias = p.bias.data;
  g.bias_dt = p.bias.dtype;
  g.mask = static_cast<const uint8_t*>(p.mask.data);
  for (int d = 0; d < 4; ++d) {
    g.bdims[d] = p.bias.dims[d];
    g.bstr[d] = p.bias.dims[d] == 1 ? 0 : p.bias.strides[d];
    g.mdims[d] = p.mask.dims[d];
    g.mstr[d] = p.mask.dims[d] == 1 ? 0 : p.mask.strides[d];
  }
}

static inline int64_t q_eff(const Geo& g, int64_t b) {
  if (!g.qlen) return g.T;
  return imax(0, imin(g.T, g.qlen[b]));
}
static inline int64_t kv_eff(const Geo& g, int64_t b) {
  if (!g.kvlen) return g.S;
  return imax(0, imin(g.S, g.kvlen[b]));
}
// Visible keys of query row i (i < te): [row_lo, row_hi] (may be empty).
static inline int64_t row_lo(const Geo& g, int64_t i) { return g.wl >= 0 ? imax(0, i - g.wl) : 0; }
static inline int64_t row_hi(const Geo& g, int64_t i, int64_t se) {
  int64_t h = se - 1;
  if (g.causal) h = imin(h, i);
  if (g.wr >= 0) h = imin(h, i + g.wr);
  return h;
}
// Visible queries of key j (j < se): [col_lo, col_hi].
static inline int64_t col_lo(const Geo& g, int64_t j) {
  int64_t l = 0;
  if (g.causal) l = imax(l, j);
  if (g.wr >= 0) l = imax(l, j - g.wr);
  return l;
}
static inline int64_t col_hi(const Geo& g, int64_t j, int64_t te) {
  int64_t h = te - 1;
  if (g.wl >= 0) h = imin(h, j + g.wl);
  return h;
}

// Ints for make_segment_tiles: 4 per query tile and 4 per key tile.
static inline int64_t segment_tile_ints(const Geo& g) { return 4 * g.B * (g.ntq + g.ntk); }

// The smallest and largest id of each tile of `tile` ids of ids[0, len) (the
// last tile may be shorter): lo[t] and hi[t] for t < ntiles.
static void tile_id_ranges(const int32_t* ids, int64_t len, int64_t tile, int64_t ntiles,
                           int32_t* lo, int32_t* hi) {
  for (int64_t t = 0; t < ntiles; ++t) {
    const int32_t* p = ids + t * tile;
    lo[t] = hi[t] = p[0];
    for (int64_t r = 1; r < imin(tile, len - t * tile); ++r) {
      lo[t] = p[r] < lo[t] ? p[r] : lo[t];
      hi[t] = p[r] > hi[t] ? p[r] : hi[t];
    }
  }
}

// Fills the tile id ranges and the meeting tile ranges of g (see Geo) from
// the segment ids, in `ints` (segment_tile_ints(g) of them). O(B * (T + S)
// + B * ntq * ntk), once per call.
static void make_segment_tiles(Geo& g, int32_t* ints) {
  const int64_t nq = g.B * g.ntq, nk = g.B * g.ntk;
  g.qt_min = ints;
  g.qt_max = g.qt_min + nq;
  g.qt_kfirst = g.qt_max + nq;
  g.qt_klast = g.qt_kfirst + nq;
  g.kt_min = g.qt_klast + nq;
  g.kt_max = g.kt_min + nk;
  g.kt_qfirst = g.kt_max + nk;
  g.kt_qlast = g.kt_qfirst + nk;
  // No meeting tiles until the loop below finds them: first past the end, last -1.
  for (int64_t i = 0; i < nq; ++i) {
    g.qt_kfirst[i] = static_cast<int32_t>(g.ntk);
    g.qt_klast[i] = -1;
  }
  for (int64_t i = 0; i < nk; ++i) {
    g.kt_qfirst[i] = static_cast<int32_t>(g.ntq);
    g.kt_qlast[i] = -1;
  }
  for (int64_t b = 0; b < g.B; ++b) {
    tile_id_ranges(g.qseg + b * g.T, g.T, BQ, g.ntq, g.qt_min + b * g.ntq, g.qt_max + b * g.ntq);
    tile_id_ranges(g.kvseg + b * g.S, g.S, BK, g.ntk, g.kt_min + b * g.ntk, g.kt_max + b * g.ntk);
    for (int64_t qt = 0; qt < g.ntq; ++qt) {
      const int64_t iq = b * g.ntq + qt;
      for (int64_t kt = 0; kt < g.ntk; ++kt) {
        const int64_t ik = b * g.ntk + kt;
        if (g.qt_max[iq] < g.kt_min[ik] || g.kt_max[ik] < g.qt_min[iq]) continue;
        if (g.qt_kfirst[iq] > kt) g.qt_kfirst[iq] = static_cast<int32_t>(kt);
        g.qt_klast[iq] = static_cast<int32_t>(kt);
        if (g.kt_qfirst[ik] > qt) g.kt_qfirst[ik] = static_cast<int32_t>(qt);
        g.kt_qlast[ik] = static_cast<int32_t>(qt);
      }
    }
  }
}

// Key tiles [*begin, *end) that query tile qt of batch b may see through its
// segment ids (all of them without ids); tiles inside are still classified.
static inline void key_tile_range(const Geo& g, int64_t b, int64_t qt, int64_t* begin,
                                  int64_t* end) {
  *begin = 0;
  *end = g.ntk;
  if (g.qseg) {
    *begin = g.qt_kfirst[b * g.ntq + qt];
    *end = imax(*begin, static_cast<int64_t>(g.qt_klast[b * g.ntq + qt]) + 1);
  }
}
// Query tiles [*begin, *end) that key tile kt of batch b may be seen by.
static inline void query_tile_range(const Geo& g, int64_t b, int64_t kt, int64_t* begin,
                                    int64_t* end) {
  *begin = 0;
  *end = g.ntq;
  if (g.qseg) {
    *begin = g.kt_qfirst[b * g.ntk + kt];
    *end = imax(*begin, static_cast<int64_t>(g.kt_qlast[b * g.ntk + kt]) + 1);
  }
}

// 0: no visible element; 1: partial (element masking); 2: every element of
// the ni x nc block is visible (nc = computed width, nj real columns).
// i0 and j0 start tiles (multiples of BQ and BK) of batch b.
static inline int classify(const Geo& g, int64_t b, int64_t i0, int64_t ni, int64_t j0,
                           int64_t nj, int64_t nc_cols, int64_t nc_rows, int64_t te,
                           int64_t se) {
  int64_t ie = imin(i0 + ni, te) - 1;
  if (ie < i0) return 0;
  int64_t je = imin(j0 + nj, se) - 1;
  if (je < j0) return 0;
  if (row_lo(g, i0) > je || row_hi(g, ie, se) < j0) return 0;
  bool uniform = true;  // every query and key of the tile shares one segment id
  if (g.qseg) {
    const int64_t iq = b * g.ntq + i0 / BQ, ik = b * g.ntk + j0 / BK;
    if (g.qt_max[iq] < g.kt_min[ik] || g.kt_max[ik] < g.qt_min[iq]) return 0;
    uniform = g.qt_min[iq] == g.qt_max[iq] && g.kt_min[ik] == g.kt_max[ik] &&
              g.qt_min[iq] == g.kt_min[ik];
  }
  // Conservative emptiness test for windows: every row's range may be empty.
  if (g.mask == nullptr && uniform && ie == i0 + ni - 1 && je == j0 + nj - 1 &&
      nj == nc_cols && ni == nc_rows && row_lo(g, ie) <= j0 && row_hi(g, i0, se) >= je)
    return 2;
  return 1;
}

// Additive bias along a row of keys: out[c] = bias[b, n, i, j0 + c], c < n.
static inline void bias_gather(const Geo& g, int64_t base, int64_t stride, int64_t n, float* out) {
  if (stride == 0) {
    float v = load_elem(g.bias, g.bias_dt, base);
    for (int64_t c = 0; c < n; ++c) out[c] = v;
  } else if (stride == 1) {
    load_row(static_cast<const char*>(g.bias) + base * dtype_size(g.bias_dt), g.bias_dt, n, out);
  } else {
    for (int64_t c = 0; c < n; ++c) out[c] = load_elem(g.bias, g.bias_dt, base + c * stride);
  }
}

// Turns raw dot products s[0..nc) into base-2 scores t = (scale*s + bias)*log2e
// and applies masking: positions outside [lo, hi] (relative), masked-out
// positions, positions whose segment id (seg_cols[c]) differs from the row's
// (seg_row) and positions >= n_real become -inf. brow: bias row or null.
// mask: base pointer of the mask row (element stride mstride) or null;
// seg_cols: null without segment ids.
static inline void prep_row(float* s, int64_t nc, float scale, const float* brow, bool partial,
                            int64_t lo, int64_t hi, const uint8_t* mrow, int64_t mstride,
                            int64_t n_real, const int32_t* seg_cols, int32_t seg_row) {
  if (brow) {
    const vf vs = bc(scale), vl = bc(kLog2e);
    for (int64_t c = 0; c < nc; c += W) st(s + c, (ld(s + c) * vs + ld(brow + c)) * vl);
  } else {
    const vf vc = bc(scale * kLog2e);
    for (int64_t c = 0; c < nc; c += W) st(s + c, ld(s + c) * vc);
  }
  if (partial) {
    if (hi > n_real - 1) hi = n_real - 1;
    if (lo > hi) {
      for (int64_t c = 0; c < nc; c += W) st(s + c, bc(-kInf));
      return;
    }
    if (lo > 0 || hi < nc - 1) {
      // Columns outside [lo, hi] become -inf, a vector at a time.
      vi col;
      for (int k = 0; k < W; ++k) col[k] = k;
      const vi vlo = col * 0 + static_cast<int32_t>(imax(imin(lo, nc), -1));
      const vi vhi = col * 0 + static_cast<int32_t>(imax(imin(hi, nc), -1));
      for (int64_t c = 0; c < nc; c += W, col += W)
        st(s + c, ((col < vlo) | (col > vhi)) ? bc(-kInf) : ld(s + c));
    }
    int64_t a = imax(lo, 0), e = imin(hi, nc - 1);
    if (mrow) {
      for (int64_t c = a; c <= e; ++c)
        if (mrow[c * mstride] == 0) s[c] = -kInf;
    }
    if (seg_cols) {
      for (int64_t c = a; c <= e; ++c)
        if (seg_cols[c] != seg_row) s[c] = -kInf;
    }
  }
}

// Where causality and the window allow visible scores in a tile: element
// (r, c) of a computed score tile (r, c counted from its first row and
// column) can be visible only if lo <= c - r <= hi. The rest of a partial
// tile is masked to -inf by prep (its P and dS are zero), so on diagonal tiles
// the tile products skip the micro-kernel blocks of scores outside the band
// and sum P and dS over the band only (Trim in tile_products.h).
struct Band {
  int64_t lo, hi;
  // The band's columns of rows [r0, r1): [*c0, *c1), empty when c0 >= c1.
  void cols(int64_t r0, int64_t r1, int64_t* c0, int64_t* c1) const {
    *c0 = r0 + lo;
    *c1 = r1 + hi;
  }
  // The band's rows of columns [c0, c1): [*r0, *r1).
  void rows(int64_t c0, int64_t c1, int64_t* r0, int64_t* r1) const {
    *r0 = c0 - hi;
    *r1 = c1 - lo;
  }
  // The band with m more diagonals on each side.
  Band widened(int64_t m) const { return {lo - m, hi + m}; }
  // Whether the band holds every element of any tile (kWholeTile).
  bool whole() const;
};
// Bounds past any tile's diagonals, and the band they make: every element.
constexpr int64_t kBandAll = int64_t{1} << 40;
constexpr Band kWholeTile{-kBandAll, kBandAll};
inline bool Band::whole() const { return lo <= -kBandAll && hi >= kBandAll; }

// The band of the tile of queries from i0 and keys from j0 (cls: classify's
// verdict), query-major (rows queries, columns keys) or key-major: key j can
// be visible to query i only if dlo <= j - i <= dhi (causality and the
// window; lengths, masks and segment ids only mask more). Every element of
// tiles that are not partial.
static inline Band tile_band(const Geo& g, int cls, int64_t i0, int64_t j0, bool query_major) {
  if (cls != 1) return kWholeTile;
  const int64_t dlo = g.wl >= 0 ? -g.wl : -kBandAll;
  int64_t dhi = g.wr >= 0 ? g.wr : kBandAll;
  if (g.causal) dhi = imin(dhi, 0);
  // c - r is (j - j0) - (i - i0) query-major, (i - i0) - (j - j0) key-major.
  return query_major ? Band{dlo - (j0 - i0), dhi - (j0 - i0)}
                     : Band{(j0 - i0) - dhi, (j0 - i0) - dlo};
}

// One tile's scores, prepared a row at a time for the softmax (prep_row):
// the bias, the visible interval, the mask and the segment ids of each row.
// Query-major tiles (the forward and dQ) have a query per row and keys from
// col0 along it; key-major tiles (dK and dV) have a key per row and queries
// from col0: the same scores, read along the other axis.
template <bool kQueryMajor>
struct TileScores {
  static constexpr int kRowAxis = kQueryMajor ? 2 : 3, kColAxis = kQueryMajor ? 3 : 2;
  const Geo& g;
  int64_t b, col0, ncols, nc, te, se, bbase, mbase;
  bool partial;               // classify()'s verdict 1: some scores are masked
  const int32_t* seg_cols;    // the columns' segment ids, null without ids

  TileScores(const Geo& g_, int64_t b_, int64_t n, int64_t col0_, int64_t ncols_, int64_t nc_,
             int cls, int64_t te_, int64_t se_)
      : g(g_), b(b_), col0(col0_), ncols(ncols_), nc(nc_), te(te_), se(se_),
        bbase((b_ % g_.bdims[0]) * g_.bstr[0] + (n % g_.bdims[1]) * g_.bstr[1]),
        mbase((b_ % g_.mdims[0]) * g_.mstr[0] + (n % g_.mdims[1]) * g_.mstr[1]),
        partial(cls == 1),
        seg_cols(g_.qseg == nullptr ? nullptr
                 : kQueryMajor      ? g_.kvseg + b_ * g_.S + col0_
                                    : g_.qseg + b_ * g_.T + col0_) {}

  // Whether the tile's scores need no work a row at a time: all visible, no
  // bias, a positive scale, and whole vectors of columns, so the softmax can
  // scale the raw dot products itself (by exp2_scale(), the factor prep
  // applies) as it reads them. The backward's two forms see a tile pair with
  // rows and columns swapped; they also ask for whole vectors of rows, so
  // that both take the same path and round alike.
  bool plain() const {
    return !partial && ncols == nc && g.bias == nullptr && g.scale > 0.0f;
  }
  float exp2_scale() const { return g.scale * kLog2e; }

  // Row `row` (a query, or a key) of raw dot products in srow [nc] becomes
  // base-2 scores with -inf where masked; brow [nc] is scratch for its bias.
  void prep(float* srow, int64_t row, float* brow) const {
    const float* bp = nullptr;
    if (g.bias) {
      bias_gather(g, bbase + row * g.bstr[kRowAxis] + col0 * g.bstr[kColAxis], g.bstr[kColAxis],
                  ncols, brow);
      for (int64_t c = ncols; c < nc; ++c) brow[c] = 0.0f;
      bp = brow;
    }
    int64_t lo = 1, hi = 0;  // empty: the row is past its sequence's length
    if (kQueryMajor ? row < te : row < se) {
      lo = (kQueryMajor ? row_lo(g, row) : col_lo(g, row)) - col0;
      hi = (kQueryMajor ? row_hi(g, row, se) : col_hi(g, row, te)) - col0;
    }
    const int32_t seg_row =
        seg_cols == nullptr ? 0 : kQueryMajor ? g.qseg[b * g.T + row] : g.kvseg[b * g.S + row];
    prep_row(srow, nc, g.scale, bp, partial, lo, hi,
             g.mask ? g.mask + mbase + row * g.mstr[kRowAxis] + col0 * g.mstr[kColAxis] : nullptr,
             g.mstr[kColAxis], ncols, seg_cols, seg_row);
  }
};

}  // namespace
}  // namespace fatrain::cpu::FATRAIN_ISA
