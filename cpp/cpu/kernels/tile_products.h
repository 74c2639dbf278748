// The tile products: one register-blocked micro-kernel (mk) for every
// C (+)= A . B of the passes, and the bf16 pair forms of computed tiles.
//
// Part of the CPU kernels compiled once per ISA: see attention_cpu_impl.h.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "phase_scope.h"
#include "vectors.h"
#include "visibility.h"

namespace fatrain::cpu::FATRAIN_ISA {
namespace {

// ---------------------------------------------------------------------------
// GEMM, two kinds, B row-major, N a multiple of W:
//  - score products (S = Q.K^T, dP = dO.V^T): C = A.B over K = head dim. The
//    products are summed in chunks of kScoreSumChunk in fresh registers, each
//    chunk then added to C: two-level summation halves the rounding error of
//    one long sequential f32 sum (with same-sign terms a 64-term sum loses
//    ~3e-6 relative that way, twice jax.nn's error), and score errors are
//    what the exponent amplifies.
//  - accumulating products (O += P.V, dV += P^T.dO, ...): C += A.B, summed
//    sequentially into C, which already splits long sums tile by tile.
// Both orders are fixed, so results stay bitwise deterministic.
// ---------------------------------------------------------------------------
constexpr int64_t kScoreSumChunk = 16;

// How mk sums: kSequential, C += A.B summed in order into C (accumulating
// products); kChunks, C = A.B in chunks of kScoreSumChunk (score products);
// kMoreChunks, C += A.B in such chunks (a score product's later K blocks).
enum Sum { kSequential, kChunks, kMoreChunks };

// One step k of mk: c += A[:, k] B[k, :] over an M x N block of vectors;
// with kStart (float32 only), c = A[:, k] B[k, :].
template <int M, int N, bool kStart, class Pk>
static inline __attribute__((always_inline)) void mk_step(int64_t k, const Pk* __restrict A,
                                                          int64_t sa, int64_t sk,
                                                          const Pk* __restrict B, int64_t ldb,
                                                          vf (&c)[M][N]) {
  using L = Lanes<Pk>;
  typename L::V b[N];
#pragma GCC unroll 8
  for (int j = 0; j < N; ++j) b[j] = L::load(B + k * ldb + j * W);
#pragma GCC unroll 8
  for (int i = 0; i < M; ++i) {
    const typename L::V a = L::bcast(A[i * sa + k * sk]);
#pragma GCC unroll 8
    for (int j = 0; j < N; ++j) {
      if constexpr (kStart)
        c[i][j] = a * b[j];
      else
        c[i][j] = L::madd(c[i][j], a, b[j]);
    }
  }
}

// K counts Pk elements (pairs for bf16), the strides too. Element (i, k) of
// A is A[i * sa + k * sk]: sk = 1 for A stored by rows (the usual case),
// sa = 1 for A stored by columns (A is the transpose of a row-major tile, read
// in place instead of being transposed first).
template <int M, int N, Sum kSum, class Pk>
static void mk(int64_t K, const Pk* __restrict A, int64_t sa, int64_t sk, const Pk* __restrict B,
               int64_t ldb, float* __restrict C, int64_t ldc) {
  constexpr bool kScores = kSum != kSequential;
  const int64_t chunk = kScores ? kScoreSumChunk : (K > 0 ? K : 1);
  if (K <= 0) {
    if (kSum != kChunks) return;
    for (int i = 0; i < M; ++i)
      for (int j = 0; j < N; ++j) st(C + i * ldc + j * W, vf{});
    return;
  }
  for (int64_t k0 = 0; k0 < K; k0 += chunk) {
    const int64_t k1 = imin(K, k0 + chunk);
    const bool add = kSum != kChunks || k0 > 0;
    vf c[M][N];
    int64_t k = k0;
    if constexpr (kScores && Lanes<Pk>::kPair == 1) {
      // A float32 score chunk's first products start its sums (a product is
      // what 0 + a b rounds to), so that no instructions go to zeroing them.
      mk_step<M, N, true>(k++, A, sa, sk, B, ldb, c);
    } else {
#pragma GCC unroll 8
      for (int i = 0; i < M; ++i) {
#pragma GCC unroll 8
        for (int j = 0; j < N; ++j) c[i][j] = (add && !kScores) ? ld(C + i * ldc + j * W) : vf{};
      }
    }
    for (; k < k1; ++k) mk_step<M, N, false>(k, A, sa, sk, B, ldb, c);
#pragma GCC unroll 8
    for (int i = 0; i < M; ++i) {
#pragma GCC unroll 8
      for (int j = 0; j < N; ++j) {
        float* p = C + i * ldc + j * W;
        st(p, (add && kScores) ? ld(p) + c[i][j] : c[i][j]);
      }
    }
    // The next chunk reads C back from memory: without this barrier GCC keeps
    // some of the chunk sums in registers across chunks and, with the M x N
    // accumulators and N vectors of B live, spills B to the stack in the
    // k loop (AVX-512's 6 x 4 score kernel: two reloads per step).
    if constexpr (kScores) __asm__ volatile("" ::: "memory");
  }
}

// What a band (visibility.h) trims in a product of a partial tile, a vector
// of C's columns (W floats) at a time; with kNoTrim, every vector of C sums
// over all of K.
//  - kTrimC: C is a score tile; the vectors of a micro-kernel block with no
//    element in the band are not computed (prep masks whatever they hold).
//  - kTrimSumA: A is a score tile (P or dS) with C's rows; each block of C's
//    rows sums over the band's columns of its rows only.
//  - kTrimSumB: B is a score tile (Pᵀ) with C's columns; each vector of C's
//    columns sums over the band's rows of its columns only.
// The terms left out are products with a P or dS outside the band, exact
// zeros; the rest keep their order (the sums run in order into C, and only
// their ends are cut).
enum TrimKind { kNoTrim, kTrimC, kTrimSumA, kTrimSumB };
struct Trim {
  TrimKind kind = kNoTrim;
  Band band = kWholeTile;
  // Whether nothing is trimmed (full tiles): gemm then takes the plain loops.
  bool none() const { return kind == kNoTrim || band.whole(); }
};

// Under t: the part [*k0, *k1) of the sum over K Pk elements (kP floats
// each: a Pk pair is summed if either of its floats is in the band) of C's
// rows [i0, i1) and columns [c0, c1) (floats); empty (*k0 >= *k1) where they
// are not computed.
template <int64_t kP>
static inline void trim_part(const Trim& t, int64_t i0, int64_t i1, int64_t c0, int64_t c1,
                             int64_t K, int64_t* k0, int64_t* k1) {
  *k0 = 0;
  *k1 = K;
  int64_t a = 0, e = 0;
  switch (t.kind) {
    case kNoTrim:
      return;
    case kTrimC:
      t.band.cols(i0, i1, &a, &e);
      if (a >= c1 || e <= c0) *k1 = 0;
      return;
    case kTrimSumA:
      t.band.cols(i0, i1, &a, &e);
      break;
    case kTrimSumB:
      t.band.rows(c0, c1, &a, &e);
      break;
  }
  *k0 = imax(a, 0) / kP;
  *k1 = imin(K, (imax(e, 0) + kP - 1) / kP);
}

template <int R, int N, Sum kSum, class Pk>
static inline void mk_rows_rem(int64_t r, int64_t K, const Pk* A, int64_t sa, int64_t sk,
                               const Pk* B, int64_t ldb, float* C, int64_t ldc) {
  if constexpr (R > 0) {
    if (r == R)
      mk<R, N, kSum, Pk>(K, A, sa, sk, B, ldb, C, ldc);
    else
      mk_rows_rem<R - 1, N, kSum, Pk>(r, K, A, sa, sk, B, ldb, C, ldc);
  }
}
// mk of r rows (1..kMR) and n vectors (1..N), both known at run time.
template <int N, Sum kSum, class Pk>
static inline void mk_any(int64_t n, int64_t r, int64_t K, const Pk* A, int64_t sa, int64_t sk,
                          const Pk* B, int64_t ldb, float* C, int64_t ldc) {
  if constexpr (N > 0) {
    if (n == N)
      mk_rows_rem<kMR, N, kSum, Pk>(r, K, A, sa, sk, B, ldb, C, ldc);
    else
      mk_any<N - 1, kSum, Pk>(n, r, K, A, sa, sk, B, ldb, C, ldc);
  }
}

// The block of r rows and N vectors of C at C (its columns from j0 floats
// in the tile, its rows from i0) under trim t. Each vector's part of K
// (trim_part) is cut at the ends of every other vector's part, and each
// piece runs as one micro-kernel call over the vectors that sum it, in
// order of K, so every vector sums its part in order: on a causal diagonal
// tile the N vectors of Oᵀ += Vᵀ Pᵀ sum over 1/N, 2/N, ... of the keys. A
// score product's parts are all of K or none (kTrimC), one piece.
template <int N, Sum kSum, class Pk>
static void mk_trimmed(int64_t r, int64_t K, const Pk* A, int64_t sa, int64_t sk, const Pk* B,
                       int64_t ldb, float* C, int64_t ldc, const Trim& t, int64_t i0,
                       int64_t j0) {
  int64_t ka[N], ke[N], cuts[2 * N];
  int nc = 0;
  for (int v = 0; v < N; ++v) {
    trim_part<Lanes<Pk>::kPair>(t, i0, i0 + r, j0 + v * W, j0 + (v + 1) * W, K, &ka[v], &ke[v]);
    if (ka[v] < ke[v]) {
      cuts[nc++] = ka[v];
      cuts[nc++] = ke[v];
    }
  }
  for (int x = 1; x < nc; ++x)
    for (int y = x; y > 0 && cuts[y - 1] > cuts[y]; --y) {
      const int64_t c = cuts[y];
      cuts[y] = cuts[y - 1];
      cuts[y - 1] = c;
    }
  for (int x = 0; x + 1 < nc; ++x) {
    const int64_t k0 = cuts[x], k1 = cuts[x + 1];
    if (k0 == k1) continue;
    for (int v = 0; v < N;) {
      if (ka[v] > k0 || ke[v] < k1) {
        ++v;
        continue;
      }
      int e = v + 1;
      while (e < N && ka[e] <= k0 && ke[e] >= k1) ++e;
      mk_any<N, kSum, Pk>(e - v, r, k1 - k0, A + k0 * sk, sa, sk, B + k0 * ldb + v * W, ldb,
                          C + v * W, ldc);
      v = e;
    }
  }
}

// The N vectors of C from column j0 (floats), kMR rows at a time; with
// kTrim, each block under trim t.
template <int N, Sum kSum, bool kTrim, class Pk>
static void gemm_cols(int64_t M, int64_t K, const Pk* A, int64_t sa, int64_t sk, const Pk* B,
                      int64_t ldb, float* C, int64_t ldc, const Trim& t, int64_t j0) {
  for (int64_t i = 0; i < M; i += kMR) {
    const int64_t r = imin(kMR, M - i);
    const Pk* a = A + i * sa;
    if constexpr (kTrim)
      mk_trimmed<N, kSum, Pk>(r, K, a, sa, sk, B, ldb, C + i * ldc, ldc, t, i, j0);
    else if (r == kMR)
      mk<kMR, N, kSum, Pk>(K, a, sa, sk, B, ldb, C + i * ldc, ldc);
    else
      mk_rows_rem<kMR - 1, N, kSum, Pk>(r, K, a, sa, sk, B, ldb, C + i * ldc, ldc);
  }
}

template <int R, Sum kSum, bool kTrim, class Pk>
static inline void gemm_cols_rem(int64_t r, int64_t M, int64_t K, const Pk* A, int64_t sa,
                                 int64_t sk, const Pk* B, int64_t ldb, float* C, int64_t ldc,
                                 const Trim& t, int64_t j0) {
  if constexpr (R > 0) {
    if (r == R)
      gemm_cols<R, kSum, kTrim, Pk>(M, K, A, sa, sk, B, ldb, C, ldc, t, j0);
    else
      gemm_cols_rem<R - 1, kSum, kTrim, Pk>(r, M, K, A, sa, sk, B, ldb, C, ldc, t, j0);
  }
}

template <Sum kSum, bool kTrim, class Pk>
static void gemm_trim(int64_t M, int64_t N, int64_t K, const Pk* A, int64_t sa, int64_t sk,
                      const Pk* B, int64_t ldb, float* C, int64_t ldc, const Trim& t) {
  int64_t nv = N / W, j = 0;
  for (; j + kNR <= nv; j += kNR)
    gemm_cols<kNR, kSum, kTrim, Pk>(M, K, A, sa, sk, B + j * W, ldb, C + j * W, ldc, t, j * W);
  if (j < nv)
    gemm_cols_rem<kNR - 1, kSum, kTrim, Pk>(nv - j, M, K, A, sa, sk, B + j * W, ldb, C + j * W,
                                            ldc, t, j * W);
}
// C (+)= A . B (see mk) under trim t; the plain loops where t trims nothing.
template <Sum kSum, class Pk>
static void gemm(int64_t M, int64_t N, int64_t K, const Pk* A, int64_t sa, int64_t sk,
                 const Pk* B, int64_t ldb, float* C, int64_t ldc, const Trim& t) {
  if (M <= 0 || N <= 0) return;
  if (t.none())
    gemm_trim<kSum, false, Pk>(M, N, K, A, sa, sk, B, ldb, C, ldc, t);
  else
    gemm_trim<kSum, true, Pk>(M, N, K, A, sa, sk, B, ldb, C, ldc, t);
}

// C[M x N] = A[M x K] . B[K x N], K the head dim (see above), A by rows.
// K past kScoreKBlock Pk elements is summed a K block at a time over all of
// C, so that the block of B every micro-kernel call reads (K block x N, 16 KB
// for N = 64) and C fit the L1 cache together; the chunks and their order
// stay the same (the block is a multiple of the chunk). C's blocks outside
// the band `skip` are not computed (kTrimC; by default none is skipped).
constexpr int64_t kScoreKBlock = 64;
static_assert(kScoreKBlock % kScoreSumChunk == 0, "K blocks must end on chunk boundaries");
template <class Pk>
static inline void score_gemm(int64_t M, int64_t N, int64_t K, const Pk* A, int64_t lda,
                              const Pk* B, int64_t ldb, float* C, int64_t ldc,
                              const Band& skip = kWholeTile) {
  constexpr int64_t kb = kScoreKBlock;
  const PhaseScope phase(kPhaseScoreProducts);
  const Trim t{kTrimC, skip};
  gemm<kChunks, Pk>(M, N, imin(K, kb), A, lda, 1, B, ldb, C, ldc, t);
  for (int64_t k0 = kb; k0 < K; k0 += kb)
    gemm<kMoreChunks, Pk>(M, N, imin(K - k0, kb), A + k0, lda, 1, B + k0 * ldb, ldb, C, ldc, t);
}

// C[M x N] += A[M x K] . B[K x N], A by rows, under trim t.
template <class Pk>
static inline void acc_gemm(int64_t M, int64_t N, int64_t K, const Pk* A, int64_t lda,
                            const Pk* B, int64_t ldb, float* C, int64_t ldc,
                            const Trim& t = {}) {
  const PhaseScope phase(kPhaseAccProducts);
  gemm<kSequential, Pk>(M, N, K, A, lda, 1, B, ldb, C, ldc, t);
}

// C[M x N] += A[M x K] . B[K x N], A by columns: element (i, k) at At[k * ldat + i],
// under trim t.
template <class Pk>
static inline void acc_gemm_at(int64_t M, int64_t N, int64_t K, const Pk* At, int64_t ldat,
                               const Pk* B, int64_t ldb, float* C, int64_t ldc,
                               const Trim& t = {}) {
  const PhaseScope phase(kPhaseAccProducts);
  gemm<kSequential, Pk>(M, N, K, At, 1, ldat, B, ldb, C, ldc, t);
}

// A computed f32 tile (rows x ld, n real columns) as the A operand of a
// product over its columns: itself for f32; for bf16, words of column pairs
// rounded by operand_bf16_row (ld / 2 per row), a column n paired with 0.
template <class Pk>
static inline const Pk* a_tile(const float* t, int64_t rows, int64_t ld, int64_t n, Pk* words);
template <>
inline const float* a_tile<float>(const float* t, int64_t, int64_t, int64_t, float*) {
  return t;
}
// The rows are converted whole vectors at a time, up to round_up(n, W)
// columns (computed, so defined; ld >= that): the words past column n are
// never read, and for an odd n the high half of the last word read is
// cleared.
template <>
inline const uint32_t* a_tile<uint32_t>(const float* t, int64_t rows, int64_t ld, int64_t n,
                                        uint32_t* words) {
  const int64_t ldw = ld / 2, nv = round_up(n, W);
  const uint16_t zero = 0;
  for (int64_t r = 0; r < rows; ++r) {
    char* w = reinterpret_cast<char*>(words + r * ldw);
    operand_bf16_row(t + r * ld, nv, w);
    if (n % 2) memcpy(w + 2 * n, &zero, sizeof(zero));
  }
  return words;
}

// A computed f32 tile (rows x ld, n computed columns) as an operand summed
// over its rows (the B operand Pᵀ of Oᵀ += Vᵀ Pᵀ, the A operand dSᵀ of
// dQ += dS K read by columns): itself for f32; for bf16, the
// operand_pair_words of row pairs, words[u * ld + c] = (t[2u][c],
// t[2u + 1][c]), an odd last row paired with 0.
template <class Pk>
static inline const Pk* row_pair_tile(const float* t, int64_t rows, int64_t ld, int64_t n,
                                      Pk* words);
template <>
inline const float* row_pair_tile<float>(const float* t, int64_t, int64_t, int64_t, float*) {
  return t;
}
template <>
inline const uint32_t* row_pair_tile<uint32_t>(const float* t, int64_t rows, int64_t ldt,
                                               int64_t n, uint32_t* words) {
  const vf zero = {};
  for (int64_t u = 0; u < (rows + 1) / 2; ++u) {
    const float* lo = t + 2 * u * ldt;
    const float* hi = lo + ldt;
    const bool has_hi = 2 * u + 1 < rows;
    for (int64_t c = 0; c < n; c += W) {
      const vu w = operand_pair_words(ld(lo + c), has_hi ? ld(hi + c) : zero);
      memcpy(words + u * ldt + c, &w, sizeof(w));
    }
  }
  return words;
}

#if defined(FATRAIN_AMX)
// ---------------------------------------------------------------------------
// AMX tile products (the bf16 passes of the avx512_amx kernels).
// TDPBF16PS adds to a C tile [16 rows][16 f32] the products of an A tile
// [16 rows][32 bf16] and a B tile [16 pair rows][16 pair words]:
// C[m][n] += sum over k of A[m][2k] B[k][n].lo + A[m][2k + 1] B[k][n].hi.
// So A is a row-major tile with the summed dimension contiguous, and B is the
// bf16 pair words of Lanes<uint32_t> (pairs along the summed dimension, the
// other one along the row). Every tile here is 16 rows of 64 bytes: tiles 0-3
// hold a 2 x 2 block of C (32 x 32 f32), 4 and 5 two A tiles (32 rows), 6 and
// 7 two B tiles (32 columns). The summed dimension advances 32 bf16 (16 pair
// rows of B) a step, in a fixed order, so results are deterministic.
// ---------------------------------------------------------------------------
struct alignas(64) AmxTileConfig {
  uint8_t palette;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// Loads the tile configuration on this thread: at the start of a work item,
// with amx_end at its end, so that no thread keeps AMX state between items.
static inline void amx_begin() {
  AmxTileConfig c;
  memset(&c, 0, sizeof(c));
  c.palette = 1;
  for (int t = 0; t < 8; ++t) {
    c.colsb[t] = 64;
    c.rows[t] = 16;
  }
  // ldtilecfg reads all 64 bytes of c, and the asm says so. GCC's
  // _tile_loadconfig gives its asm a pointer-sized memory operand, from which
  // the compiler may conclude that colsb and rows are never read and drop
  // their stores: GCC 12 does where amx_begin is inlined next to other tile
  // products, and the first tile instruction then faults (SIGILL) on the
  // unconfigured tiles.
  __asm__ volatile("ldtilecfg %0" : : "m"(c));
}
static inline void amx_end() { _tile_release(); }

// The 2 x 2 C tiles' products over nk steps of 32 bf16: A rows at a (lda
// bytes apart, the next step 64 bytes on), B pair rows at b (ldb bytes apart,
// the next step 16 pair rows down).
static inline __attribute__((always_inline)) void amx_block(int64_t nk, const char* a,
                                                             int64_t lda, const char* b,
                                                             int64_t ldb) {
  for (int64_t k = 0; k < nk; ++k) {
    _tile_loadd(4, a + k * 64, lda);
    _tile_loadd(5, a + k * 64 + 16 * lda, lda);
    _tile_loadd(6, b + k * 16 * ldb, ldb);
    _tile_loadd(7, b + k * 16 * ldb + 64, ldb);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
}
static inline __attribute__((always_inline)) void amx_store(float* c, int64_t ldc) {
  _tile_stored(0, c, ldc * 4);
  _tile_stored(1, c + 16, ldc * 4);
  _tile_stored(2, c + 16 * ldc, ldc * 4);
  _tile_stored(3, c + 16 * ldc + 16, ldc * 4);
}

// C[32 mb][32 nb] (ldc floats a row) = A . B, or += with kAccumulate, over
// nk steps of 32 bf16: A rows of bf16 pair words (lda words a row), B pair
// rows (ldb words a row).
template <bool kAccumulate>
static void amx_product(int64_t mb, int64_t nb, int64_t nk, const uint32_t* A, int64_t lda,
                        const uint32_t* B, int64_t ldb, float* C, int64_t ldc) {
  for (int64_t i = 0; i < mb; ++i)
    for (int64_t j = 0; j < nb; ++j) {
      float* c = C + 32 * i * ldc + 32 * j;
      if constexpr (kAccumulate) {
        _tile_loadd(0, c, ldc * 4);
        _tile_loadd(1, c + 16, ldc * 4);
        _tile_loadd(2, c + 16 * ldc, ldc * 4);
        _tile_loadd(3, c + 16 * ldc + 16, ldc * 4);
      } else {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
      }
      amx_block(nk, reinterpret_cast<const char*>(A + 32 * i * lda), lda * 4,
                reinterpret_cast<const char*>(B + 32 * j), ldb * 4);
      amx_store(c, ldc);
    }
}
// The score products (e.g. Sᵀ = K Qᵀ: A K's rows, B Qᵀ's pairs along D).
static inline void amx_gemm(int64_t mb, int64_t nb, int64_t nk, const uint32_t* A, int64_t lda,
                            const uint32_t* B, int64_t ldb, float* C, int64_t ldc) {
  const PhaseScope phase(kPhaseScoreProducts);
  amx_product<false>(mb, nb, nk, A, lda, B, ldb, C, ldc);
}
// The products summed over keys or queries (e.g. Oᵀ += Vᵀ Pᵀ: A Vᵀ's rows
// with keys along them, B Pᵀ's pairs along keys).
static inline void amx_acc_gemm(int64_t mb, int64_t nb, int64_t nk, const uint32_t* A,
                                int64_t lda, const uint32_t* B, int64_t ldb, float* C,
                                int64_t ldc) {
  const PhaseScope phase(kPhaseAccProducts);
  amx_product<true>(mb, nb, nk, A, lda, B, ldb, C, ldc);
}

// C[32 mb][32 nb] (ldc floats a row) += the products of nk steps of 32 bf16
// whose operands lie anywhere: step k's A rows at a[k] (lda words a row) and
// B pair rows at b[k] (ldb words a row). The steps run kAmxAccChunk at a
// time over every C block, each block loaded and stored once per chunk: a
// chunk's operands (2 KB a step for each A row block and B column block) stay
// in L1 while every block of C reads them, where a whole chain per block
// (the forward's Oᵀ over 1,024 keys: 64 to 128 KB of each) streams them from
// L2 once per block. Each C element still sums its steps in order, the f32
// partial sums stored and reloaded exactly, so the results are those of one
// chain. Eight steps ran the forward's Oᵀ += Vᵀ Pᵀ 15-18% faster than one
// chain per block on a Sapphire Rapids-class Xeon (`build_and_test.sh tiles`).
constexpr int64_t kAmxAccChunk = 8;
static void amx_acc_steps(int64_t mb, int64_t nb, int64_t nk, const uint32_t* const* a,
                          int64_t lda, const uint32_t* const* b, int64_t ldb, float* C,
                          int64_t ldc) {
  const PhaseScope phase(kPhaseAccProducts);
  for (int64_t k0 = 0; k0 < nk; k0 += kAmxAccChunk) {
    const int64_t k1 = imin(nk, k0 + kAmxAccChunk);
    for (int64_t i = 0; i < mb; ++i)
      for (int64_t j = 0; j < nb; ++j) {
        float* c = C + 32 * i * ldc + 32 * j;
        _tile_loadd(0, c, ldc * 4);
        _tile_loadd(1, c + 16, ldc * 4);
        _tile_loadd(2, c + 16 * ldc, ldc * 4);
        _tile_loadd(3, c + 16 * ldc + 16, ldc * 4);
        for (int64_t k = k0; k < k1; ++k) {
          const uint32_t* ak = a[k] + 32 * i * lda;
          const uint32_t* bk = b[k] + 32 * j;
          _tile_loadd(4, ak, lda * 4);
          _tile_loadd(5, ak + 16 * lda, lda * 4);
          _tile_loadd(6, bk, ldb * 4);
          _tile_loadd(7, bk + 16, ldb * 4);
          _tile_dpbf16ps(0, 4, 6);
          _tile_dpbf16ps(1, 4, 7);
          _tile_dpbf16ps(2, 5, 6);
          _tile_dpbf16ps(3, 5, 7);
        }
        amx_store(c, ldc);
      }
  }
}

// Row r of a tile held transposed (its element d at col[d * ldt], d < D
// rounded up to 16 readable) times mul, written as D bf16 at dst with
// store_row's rounding: 16 elements a gather. The AMX kernels' outputs O
// (from Oᵀ) and dQ (from dQᵀ), bf16 like q on their path.
static inline void amx_store_bf16_column(const float* col, int64_t ldt, int64_t D, float mul,
                                         uint16_t* dst) {
  __m512i idx = _mm512_setzero_si512();
  for (int k = 0; k < 16; ++k) reinterpret_cast<vi&>(idx)[k] = static_cast<int32_t>(k * ldt);
  const vf vmul = bc(mul);
  for (int64_t d = 0; d < D; d += 16) {
    // (Merge-masked forms with a full mask: see vexp2.)
    const vf o = reinterpret_cast<vf>(_mm512_mask_i32gather_ps(_mm512_setzero_ps(), 0xffff, idx,
                                                               col + d * ldt, 4)) *
                 vmul;
    const __m256i h = _mm512_mask_cvtepi32_epi16(_mm256_setzero_si256(), 0xffff,
                                                 reinterpret_cast<__m512i>(vbf16_bits(o)));
    const __mmask16 mask = static_cast<__mmask16>(D - d >= 16 ? 0xffffu : (1u << (D - d)) - 1u);
    _mm256_mask_storeu_epi16(dst + d, mask, h);
  }
}

// The AMX products' P and dS operands, rounded by vcvtne2ps2bf16 as
// operand_pair_words rounds them (one rounding for every AMX operand computed
// in the kernels, so the backward's two forms round dS alike).
// a_tile as an AMX A operand: row r's columns [0, n) as pair words (ld / 2
// words a row), the columns past n up to the whole 32-column step +0.
static inline const uint32_t* amx_a_tile(const float* t, int64_t rows, int64_t ld, int64_t n,
                                         uint32_t* words) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < n; c += 32) {
      const int64_t left = n - c;
      const __mmask16 mlo = static_cast<__mmask16>(left >= 16 ? 0xffffu : (1u << left) - 1u);
      const __mmask16 mhi =
          static_cast<__mmask16>(left >= 32 ? 0xffffu : left <= 16 ? 0u : (1u << (left - 16)) - 1u);
      const __m512 lo = _mm512_maskz_loadu_ps(mlo, t + r * ld + c);
      const __m512 hi = _mm512_maskz_loadu_ps(mhi, t + r * ld + c + 16);
      const __m512bh w = _mm512_cvtne2ps_pbh(hi, lo);
      memcpy(words + r * ld / 2 + c / 2, &w, sizeof(w));
    }
  return words;
}
// row_pair_tile as an AMX B operand summed over whole 32-row steps: the pair
// rows past the tile's, up to the step's end, are +0, so they add nothing.
static inline const uint32_t* amx_row_pair_tile(const float* t, int64_t rows, int64_t ldt,
                                                int64_t n, uint32_t* words) {
  for (int64_t u = 0; u < (rows + 1) / 2; ++u) {
    const float* lo = t + 2 * u * ldt;
    const bool has_hi = 2 * u + 1 < rows;
    for (int64_t c = 0; c < n; c += W) {
      const vu w = operand_pair_words(ld(lo + c), has_hi ? ld(lo + ldt + c) : vf{});
      memcpy(words + u * ldt + c, &w, sizeof(w));
    }
  }
  for (int64_t u = (rows + 1) / 2; u < 16 * ((rows + 31) / 32); ++u)
    memset(words + u * ldt, 0, static_cast<size_t>(n) * sizeof(uint32_t));
  return words;
}
#endif  // FATRAIN_AMX

}  // namespace
}  // namespace fatrain::cpu::FATRAIN_ISA
