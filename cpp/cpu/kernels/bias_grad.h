// The bias gradient: work items that own disjoint slices of dbias.
//
// Part of the CPU kernels compiled once per ISA: see attention_cpu_impl.h.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "backward.h"

namespace fatrain::cpu::FATRAIN_ISA {
namespace {

// Bias gradient item: owns dbias[b', n', t-range, s-range] (see entry point).
struct BiasGradState {
  BwdState* s;
  int64_t db[4];
  int64_t items_t, items_s;  // blocks along T / S (1 when that dim is broadcast)
  float* out;
};

static void bias_grad_item(BiasGradState& bg, int64_t idx) {
  BwdState& s = *bg.s;
  const Geo& g = s.g;
  int64_t ts = idx % bg.items_s;
  int64_t tt = (idx / bg.items_s) % bg.items_t;
  int64_t nn = (idx / (bg.items_s * bg.items_t)) % bg.db[1];
  int64_t bb = idx / (bg.items_s * bg.items_t * bg.db[1]);
  bool tdim = bg.db[2] != 1;  // dbias keeps the T axis
  bool sdim = bg.db[3] != 1;  // dbias keeps the S axis
  // Rows / key tiles this item covers.
  int64_t qt_begin = 0, qt_end = g.ntq, kt_begin = 0, kt_end = g.ntk;
  if (bg.items_t > 1) {
    qt_begin = tt;
    qt_end = tt + 1;
  }
  if (bg.items_s > 1) {
    kt_begin = ts;
    kt_end = ts + 1;
  }
  // Output region: rows [r0, r1) of dbias' T axis, cols [c0, c1) of its S axis.
  int64_t r0 = tdim ? qt_begin * BQ : 0, r1 = tdim ? imin(g.T, qt_end * BQ) : 1;
  int64_t c0 = sdim ? kt_begin * BK : 0, c1 = sdim ? imin(g.S, kt_end * BK) : 1;
  float* out = bg.out + (bb * bg.db[1] + nn) * bg.db[2] * bg.db[3];
  for (int64_t r = r0; r < r1; ++r)
    for (int64_t c = c0; c < c1; ++c) out[r * bg.db[3] + c] = 0.0f;
  float* buf = falloc(2 * BQ * BK + BK);
  if (!buf) {
    set_fail(&s.fail);
    return;
  }
  float* Sb = buf;
  float* dPb = Sb + BQ * BK;
  float* brow = dPb + BQ * BK;
  int64_t visited = 0;
  int64_t b_begin = bg.db[0] == 1 ? 0 : bb, b_end = bg.db[0] == 1 ? g.B : bb + 1;
  int64_t n_begin = bg.db[1] == 1 ? 0 : nn, n_end = bg.db[1] == 1 ? g.N : nn + 1;
  for (int64_t b = b_begin; b < b_end; ++b) {
    int64_t te = q_eff(g, b), se = kv_eff(g, b);
    for (int64_t n = n_begin; n < n_end; ++n) {
      for (int64_t qt = qt_begin; qt < qt_end; ++qt) {
        int64_t i0 = qt * BQ, ni = imin(BQ, g.T - i0);
        for (int64_t kt = kt_begin; kt < kt_end; ++kt) {
          int64_t j0 = kt * BK, nj = imin(BK, g.S - j0), nc = round_up(nj, W);
          int cls = classify(g, b, i0, ni, j0, nj, nc, ni, te, se);
          if (cls == 0) continue;
          ++visited;
          ds_tile_q<float>(s, b, n, qt, kt, cls, te, se, Sb, dPb, brow, kWholeTile);
          for (int64_t r = 0; r < ni; ++r) {
            const float* dsr = Sb + r * BK;
            float* orow = out + (tdim ? (i0 + r) : 0) * bg.db[3];
            if (sdim) {
              for (int64_t c = 0; c < nj; ++c) orow[j0 + c] += dsr[c];
            } else {
              float acc = 0.0f;
              for (int64_t c = 0; c < nj; ++c) acc += dsr[c];
              orow[0] += acc;
            }
          }
        }
      }
    }
  }
  count_tile_visits(kTileVisitsBiasGrad, visited);
  free(buf);
}

}  // namespace
}  // namespace fatrain::cpu::FATRAIN_ISA
