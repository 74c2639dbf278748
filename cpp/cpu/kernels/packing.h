// Packing operands per head into float32 rows, transposed tiles and bf16
// pairs.
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
// Packing.
// ---------------------------------------------------------------------------
// Row-major f32 copy [n][ld] of rows t0 .. t0 + n - 1 of head h of x (L
// rows long), zero padded past D and past L.
static void pack_rows(const SeqTensor& x, int64_t b, int64_t h, int64_t t0, int64_t n, int64_t L,
                      int64_t D, int64_t ld, float* dst) {
  for (int64_t t = t0; t < t0 + n; ++t) {
    float* d = dst + (t - t0) * ld;
    if (t >= L) {
      memset(d, 0, static_cast<size_t>(ld) * 4);
      continue;
    }
    load_row(row_ptr(x, b, t, h), x.dtype, D, d);
    for (int64_t k = D; k < ld; ++k) d[k] = 0.0f;
  }
}
// Transposed copy blocked by tile: dst[blk][d][c] = rows[blk*bt + c][d], a
// W x W block at a time (rows ldr floats apart hold whole vectors, ldr >= D
// rounded up to W, zero past D; bt is a multiple of W).
static void pack_transposed(const float* rows, int64_t Lp, int64_t D, int64_t ldr, int64_t bt,
                            float* dst) {
  vf v[W];
  for (int64_t blk = 0; blk < Lp / bt; ++blk) {
    float* o = dst + blk * D * bt;
    const float* r = rows + blk * bt * ldr;
    for (int64_t c0 = 0; c0 < bt; c0 += W)
      for (int64_t d0 = 0; d0 < D; d0 += W) {
        for (int i = 0; i < W; ++i) v[i] = ld(r + (c0 + i) * ldr + d0);
        transpose_block(v);
        for (int64_t k = 0; k < imin(W, D - d0); ++k) st(o + (d0 + k) * bt + c0, v[k]);
      }
  }
}

// bf16 pair packs (Lanes<uint32_t>), from f32 row packs [Lp][ld] whose values
// are bf16 (so the rounding is exact). Dp and Lp are even; padding stays 0.
// Rows, pairs along D: dst[t][p] = (rows[t][2p], rows[t][2p+1]), Dp/2 words a row.
// (Dp is a multiple of W: whole vectors.)
static void pack_pair_rows(const float* rows, int64_t Lp, int64_t Dp, int64_t ld, uint32_t* dst) {
  for (int64_t t = 0; t < Lp; ++t) bf16_row(rows + t * ld, Dp, dst + t * Dp / 2);
}
// Transposed by tile, pairs along D: dst[blk][p][c] = (rows[blk*bt + c][2p], ..[2p+1]),
// p < Dk = ceil(D / 2); a W x W block of rows transposed at a time (rows hold
// whole vectors, zero past D; bt is a multiple of W).
static void pack_pair_transposed(const float* rows, int64_t Lp, int64_t D, int64_t ldr, int64_t bt,
                                 uint32_t* dst) {
  const int64_t Dk = (D + 1) / 2;
  vf v[W];
  for (int64_t blk = 0; blk < Lp / bt; ++blk) {
    uint32_t* o = dst + blk * Dk * bt;
    const float* r = rows + blk * bt * ldr;
    for (int64_t c0 = 0; c0 < bt; c0 += W)
      for (int64_t d0 = 0; d0 < 2 * Dk; d0 += W) {
        for (int i = 0; i < W; ++i) v[i] = ld(r + (c0 + i) * ldr + d0);
        transpose_block(v);
        for (int64_t k = 0; k < imin(W, 2 * Dk - d0); k += 2) {
          const vu w = vbf16_bits(v[k]) | (vbf16_bits(v[k + 1]) << 16);
          memcpy(o + (d0 + k) / 2 * bt + c0, &w, sizeof(w));
        }
      }
  }
}
// Pairs along the sequence: dst[u][d] = (rows[2u][d], rows[2u+1][d]), d < Dp,
// ldr words a row like the f32 rows: the B operand of the products summed over
// keys or queries (O, dV, dK, dQ).
static void pack_pair_interleaved(const float* rows, int64_t Lp, int64_t Dp, int64_t ldr,
                                  uint32_t* dst) {
  for (int64_t u = 0; u < Lp / 2; ++u) {
    const float* lo = rows + 2 * u * ldr;
    const float* hi = lo + ldr;
    for (int64_t d = 0; d < Dp; d += W) {
      const vu w = vbf16_bits(ld(lo + d)) | (vbf16_bits(ld(hi + d)) << 16);
      memcpy(dst + u * ldr + d, &w, sizeof(w));
    }
  }
}

// The AMX forward's packs (tile_products.h), from f32 row packs [Lp][ld]
// whose values are bf16, Dp <= Da (the head dim padded to whole 32-element
// AMX steps): rows of bf16, Da / 2 pair words a row, zero past Dp...
static void pack_amx_rows(const float* rows, int64_t Lp, int64_t Dp, int64_t ld, int64_t Da,
                          uint32_t* dst) {
  for (int64_t t = 0; t < Lp; ++t) {
    uint32_t* o = dst + t * Da / 2;
    bf16_row(rows + t * ld, Dp, o);
    for (int64_t p = Dp / 2; p < Da / 2; ++p) o[p] = 0;
  }
}
// ... and the transpose blocked by tile, keys along the rows: block blk holds
// bf16 rows[blk*bt + c][d] at element d * bt + c (bt / 2 words a row, Da
// rows; zero for d >= Dp), a W x W block of rows transposed at a time.
static void pack_amx_transposed(const float* rows, int64_t Lp, int64_t Dp, int64_t ldr,
                                int64_t Da, int64_t bt, uint32_t* dst) {
  vf v[W];
  for (int64_t blk = 0; blk < Lp / bt; ++blk) {
    uint16_t* o = reinterpret_cast<uint16_t*>(dst + blk * Da * bt / 2);
    const float* r = rows + blk * bt * ldr;
    for (int64_t c0 = 0; c0 < bt; c0 += W)
      for (int64_t d0 = 0; d0 < Dp; d0 += W) {
        for (int i = 0; i < W; ++i) v[i] = ld(r + (c0 + i) * ldr + d0);
        transpose_block(v);
        for (int64_t k = 0; k < W; ++k) bf16_vector(v[k], o + (d0 + k) * bt + c0);
      }
    memset(o + Dp * bt, 0, static_cast<size_t>((Da - Dp) * bt) * sizeof(uint16_t));
  }
}

}  // namespace
}  // namespace fatrain::cpu::FATRAIN_ISA
