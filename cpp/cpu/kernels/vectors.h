// Vector types and the ISA's register blocking, the bf16 operand format
// (Lanes), exp2, and element conversions between dtypes and float32 rows.
//
// Part of the CPU kernels compiled once per ISA: see attention_cpu_impl.h.
#pragma once

#ifndef FATRAIN_ISA
#error "define FATRAIN_ISA before including attention_cpu_impl.h"
#endif

#include <climits>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "../attention_cpu.h"

#if defined(__x86_64__)
#include <immintrin.h>
#if defined(__F16C__)
#define FATRAIN_HAVE_F16C 1
#endif
#elif defined(__ARM_NEON)
#include <arm_neon.h>
#endif

namespace fatrain::cpu::FATRAIN_ISA {
namespace {

// ---------------------------------------------------------------------------
// Vector width and register blocking per ISA.
// ---------------------------------------------------------------------------
#if defined(__AVX512F__)
constexpr int W = 16;  // floats per vector
#ifdef FATRAIN_MR
constexpr int kMR = FATRAIN_MR;
constexpr int kNR = FATRAIN_NR;
#else
// 6 rows x 4 vectors: 24 zmm accumulators, the 4 vectors of B and the
// broadcast of A take 29 of the 32 registers, and each pass over B's rows
// serves 6 rows of A (10 loads per 24 FMAs, against 8 per 16 for 4 x 4;
// docs/cpu.md, "Standalone test", gives the measured difference).
constexpr int kMR = 6;  // micro-kernel rows
constexpr int kNR = 4;  // micro-kernel vectors per row
#endif
#elif defined(__AVX2__)
constexpr int W = 8;
#ifdef FATRAIN_MR
constexpr int kMR = FATRAIN_MR;
constexpr int kNR = FATRAIN_NR;
#else
constexpr int kMR = 3;
constexpr int kNR = 4;  // 12 ymm accumulators; 64-wide tiles split into two 4-vector blocks
#endif
#elif defined(__aarch64__)
constexpr int W = 4;
constexpr int kMR = 6;
constexpr int kNR = 4;  // 24 of 32 NEON registers
#else
constexpr int W = 4;
constexpr int kMR = 4;
constexpr int kNR = 2;  // SSE2: 8 of 16 xmm registers
#endif

// Tile sizes: multiples of W (<= 16) so GEMM widths are whole vectors.
constexpr int64_t BQ = kTileQ;
constexpr int64_t BK = kTileK;

typedef float vf __attribute__((vector_size(W * 4), may_alias));
typedef int32_t vi __attribute__((vector_size(W * 4), may_alias));
typedef uint32_t vu __attribute__((vector_size(W * 4), may_alias));
typedef float vfu __attribute__((vector_size(W * 4), may_alias, aligned(4)));

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;
constexpr float kInf = __builtin_inff();

static inline __attribute__((always_inline)) vf ld(const float* p) {
  return *reinterpret_cast<const vfu*>(p);
}
static inline __attribute__((always_inline)) void st(float* p, vf v) {
  *reinterpret_cast<vfu*>(p) = v;
}
static inline __attribute__((always_inline)) vf bc(float x) {
#if defined(__AVX512F__)
  return _mm512_set1_ps(x);
#elif defined(__AVX__)
  return _mm256_set1_ps(x);
#elif defined(__SSE2__)
  return _mm_set1_ps(x);
#elif defined(__ARM_NEON)
  return vdupq_n_f32(x);
#else
  vf v = {};
  return v + x;
#endif
}
static inline __attribute__((always_inline)) vf vmax(vf a, vf b) {
  return a > b ? a : b;
}
static inline __attribute__((always_inline)) vf vmin(vf a, vf b) {
  return a < b ? a : b;
}
// x * c + m with one rounding where the ISA has FMAs, two on SSE2. Written
// as an instruction rather than left to -ffp-contract: where two products
// meet one add (a b + c d), the compiler chooses which product to fuse, and
// may choose differently in two instantiations of the same code (GCC 13 did
// in the score micro-kernels that the backward's two forms run, whose results
// must agree bit for bit).
static inline __attribute__((always_inline)) vf fmadd(vf x, vf c, vf m) {
#if defined(__AVX512F__)
  return reinterpret_cast<vf>(_mm512_fmadd_ps(reinterpret_cast<__m512>(x),
                                              reinterpret_cast<__m512>(c),
                                              reinterpret_cast<__m512>(m)));
#elif defined(__AVX2__) && defined(__FMA__)
  return reinterpret_cast<vf>(_mm256_fmadd_ps(reinterpret_cast<__m256>(x),
                                              reinterpret_cast<__m256>(c),
                                              reinterpret_cast<__m256>(m)));
#elif defined(__ARM_NEON) && defined(__aarch64__)
  return reinterpret_cast<vf>(vfmaq_f32(reinterpret_cast<float32x4_t>(m),
                                        reinterpret_cast<float32x4_t>(x),
                                        reinterpret_cast<float32x4_t>(c)));
#else
  return x * c + m;
#endif
}
// Transposes in place the W x W block whose rows are r[0..W): log2(W)
// stages, each swapping the off-diagonal b x b blocks of every 2b x 2b block
// (b = W / 2, ..., 1), one two-source shuffle per row and stage (vpermt2ps on
// AVX-512).
static inline __attribute__((always_inline)) void transpose_block(vf* r) {
#pragma GCC unroll 8
  for (int b = W / 2; b >= 1; b /= 2) {
    // Within each 2b-wide block: row i keeps its left half and takes row
    // i + b's left half (lo); row i + b takes row i's right half and keeps
    // its own right half (hi).
    vi lo, hi;
#pragma GCC unroll 16
    for (int k = 0; k < W; ++k) {
      lo[k] = (k & b) ? W + k - b : k;
      hi[k] = (k & b) ? W + k : k + b;
    }
#pragma GCC unroll 16
    for (int i = 0; i < W; ++i) {
      if (i & b) continue;
      const vf a = r[i], c = r[i + b];
#if defined(__clang__)
      // Clang (Apple's, on macOS) has no __builtin_shuffle with a vector of
      // indices: the same selection an element at a time.
      vf x, y;
      for (int k = 0; k < W; ++k) {
        x[k] = lo[k] < W ? a[lo[k]] : c[lo[k] - W];
        y[k] = hi[k] < W ? a[hi[k]] : c[hi[k] - W];
      }
      r[i] = x;
      r[i + b] = y;
#else
      r[i] = __builtin_shuffle(a, c, lo);
      r[i + b] = __builtin_shuffle(a, c, hi);
#endif
    }
  }
}

static inline int64_t imin(int64_t a, int64_t b) { return a < b ? a : b; }
static inline int64_t imax(int64_t a, int64_t b) { return a > b ? a : b; }
static inline int64_t round_up(int64_t a, int64_t m) { return (a + m - 1) / m * m; }

static inline uint32_t f2u(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  return u;
}
static inline float u2f(uint32_t u) {
  float f;
  memcpy(&f, &u, 4);
  return f;
}

// ---------------------------------------------------------------------------
// Operand formats of the tile products.
// ---------------------------------------------------------------------------
// Packed operands are float32 (one float per element, products are f32 FMAs)
// or, for bfloat16 problems where the TU has a bf16 dot product, bf16 pairs:
// one 32-bit word holds elements k (low half) and k + 1 (high half) of the
// summed dimension, and one instruction adds both products of a pair of words
// to an f32 lane (avx512_bf16's vdpbf16ps): twice the f32 FMA rate where it
// issues at the FMA's rate (AMD; see bf16_dot_pays in attention_cpu.cc). The tile
// products take their operands as Pk = float or Pk = uint32_t (Lanes below);
// P and dS, computed in f32, are rounded to bf16 pairs before their products
// (a_tile), as GPU kernels and jax.nn's bf16 path round them.
//
// FATRAIN_BF16_DOT: 1 = the native instruction (avx512 TU, used only where
// the CPU reports avx512_bf16); 2 = an emulation with the same data flow for
// machines without it (the avx2_bf16_emulated TU, a test instrument that is
// chosen only through JAX_FATRAIN_CPU_ISA); unset = no bf16 path.
#if defined(FATRAIN_BF16_DOT)
constexpr bool kHasBf16Dot = true;
#else
constexpr bool kHasBf16Dot = false;
#endif

// FATRAIN_AMX (the avx512_amx TU, which also has FATRAIN_BF16_DOT = 1): the
// bf16 pair path's products run on AMX tiles instead (tile_products.h: the
// pair words are AMX's operand layout); its backward only where the head dim
// is a multiple of 32 (attention_cpu.cc).
#if defined(FATRAIN_AMX)
constexpr bool kAmx = true;
#else
constexpr bool kAmx = false;
#endif

template <class Pk>
struct Lanes;

template <>
struct Lanes<float> {
  using V = vf;
  static constexpr int64_t kPair = 1;  // elements per Pk
  static inline __attribute__((always_inline)) V load(const float* p) { return ld(p); }
  static inline __attribute__((always_inline)) V bcast(float x) { return bc(x); }
  // One FMA (explicit: see fmadd), so that a chunk's first product, a plain
  // multiply, is never the one fused into the next step's add.
  static inline __attribute__((always_inline)) vf madd(vf c, V a, V b) { return fmadd(a, b, c); }
};

template <>
struct Lanes<uint32_t> {
  using V = vi;
  static constexpr int64_t kPair = 2;
  static inline __attribute__((always_inline)) V load(const uint32_t* p) {
    V v;
    memcpy(&v, p, sizeof(v));
    return v;
  }
  static inline __attribute__((always_inline)) V bcast(uint32_t x) {
    V v = {};
    return v + static_cast<int32_t>(x);
  }
  // c + a.hi * b.hi + a.lo * b.lo per lane, in that order (Intel's order for
  // vdpbf16ps; the products of two bf16 are exact in f32). The emulation
  // keeps subnormals, which the instruction flushes to zero.
  static inline __attribute__((always_inline)) vf madd(vf c, V a, V b) {
#if defined(FATRAIN_BF16_DOT) && FATRAIN_BF16_DOT == 1
    return reinterpret_cast<vf>(_mm512_dpbf16_ps(reinterpret_cast<__m512>(c),
                                                 reinterpret_cast<__m512bh>(a),
                                                 reinterpret_cast<__m512bh>(b)));
#else
    const V hi = bcast(0xffff0000u);
    vf a_hi, a_lo, b_hi, b_lo;
    V t;
    t = a & hi; memcpy(&a_hi, &t, sizeof(t));
    t = a << 16; memcpy(&a_lo, &t, sizeof(t));
    t = b & hi; memcpy(&b_hi, &t, sizeof(t));
    t = b << 16; memcpy(&b_lo, &t, sizeof(t));
    c = fmadd(a_hi, b_hi, c);
    return fmadd(a_lo, b_lo, c);
#endif
  }
};

// Round-to-nearest-even bf16 bits of f (NaN stays a quiet NaN).
static inline uint32_t bf16_bits(float f) {
  uint32_t u = f2u(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (u >> 16) | 0x40u;
  return (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
}
// The word of elements (lo, hi).
static inline uint32_t bf16_pair(float lo, float hi) { return bf16_bits(lo) | (bf16_bits(hi) << 16); }
// bf16_bits of every lane.
static inline __attribute__((always_inline)) vu vbf16_bits(vf f) {
  vu u;
  memcpy(&u, &f, sizeof(u));
  const vu nan = (u & 0x7fffffffu) > 0x7f800000u;
  const vu rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  return (nan & ((u >> 16) | 0x40u)) | (~nan & rounded);
}

// bf16_row: the bf16 bits of x[0, n), n a multiple of W, written in element
// order to out (any alignment); bf16_vector: those of one vector. Element k
// goes to the low half of word k / 2 when k is even and to its high half when
// k is odd, so these are also the words of consecutive element pairs,
// bf16_pair(x[2p], x[2p + 1]).
static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__,
              "bf16 pair words hold their first element in the low half");
typedef uint16_t vh __attribute__((vector_size(W * 2), may_alias, aligned(2)));
static inline __attribute__((always_inline)) void bf16_vector(vf x, void* out) {
  const vh h = __builtin_convertvector(vbf16_bits(x), vh);
  memcpy(out, &h, sizeof(h));
}
static inline void bf16_row(const float* x, int64_t n, void* out) {
  char* o = static_cast<char*>(out);
  for (int64_t c = 0; c < n; c += W) bf16_vector(ld(x + c), o + 2 * c);
}

// The rounding of the bf16 operands the kernels compute (P and dS) before
// their pair products. With the native instruction (FATRAIN_BF16_DOT == 1:
// vdpbf16ps, and TDPBF16PS on AMX) one vcvtne2ps2bf16 / vcvtneps2bf16 per
// vector: bf16_bits' bits except that f32 subnormals become zero. Those
// products treat subnormal bf16 operands as zero anyway, so the two differ
// only where an f32 subnormal would round up to bf16's smallest normal
// (2^-126), a term below any f32 sum it joins. The emulation (and the
// outputs, store_row) round with bf16_bits.
// operand_pair_words: the words (lo[c], hi[c]) of two f32 vectors.
static inline __attribute__((always_inline)) vu operand_pair_words(vf lo, vf hi) {
#if defined(FATRAIN_BF16_DOT) && FATRAIN_BF16_DOT == 1
  const __m512i both = reinterpret_cast<__m512i>(
      _mm512_cvtne2ps_pbh(reinterpret_cast<__m512>(hi), reinterpret_cast<__m512>(lo)));
  // 16-bit element 2c takes lo[c] (element c), 2c + 1 takes hi[c] (16 + c).
  const __m512i idx = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9,
                                       24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1,
                                       16, 0);
  return reinterpret_cast<vu>(_mm512_permutexvar_epi16(idx, both));
#else
  return vbf16_bits(lo) | (vbf16_bits(hi) << 16);
#endif
}
// operand_bf16_vector: the W elements of x, in element order at out (any
// alignment); operand_bf16_row: x[0, n), n a multiple of W, as bf16_row lays
// it out.
static inline __attribute__((always_inline)) void operand_bf16_vector(vf x, void* out) {
#if defined(FATRAIN_BF16_DOT) && FATRAIN_BF16_DOT == 1
  const __m256bh h = _mm512_cvtneps_pbh(reinterpret_cast<__m512>(x));
  memcpy(out, &h, sizeof(h));
#else
  bf16_vector(x, out);
#endif
}
static inline void operand_bf16_row(const float* x, int64_t n, void* out) {
  char* o = static_cast<char*>(out);
  for (int64_t c = 0; c < n; c += W) operand_bf16_vector(ld(x + c), o + 2 * c);
}

// 2^x for x <= ~127. Round-to-nearest range reduction (magic constant), then
// a degree-7 Taylor polynomial of 2^f on [-0.5, 0.5] (truncation error
// ~5e-9, overall ~1 ulp-ish). x = -inf gives exactly 0, and so does any
// x < -126.5 (x < -149 with AVX-512, whose results in between are subnormal).
// NaN gives NaN: a NaN score (NaN or Inf in q, k or bias) must reach the
// outputs as it does in jax.nn, not vanish as a zero probability. The clamps
// are written so that a NaN compares false and passes through.
constexpr float kC1 = 0.6931471805599453f;
constexpr float kC2 = 0.2402265069591007f;
constexpr float kC3 = 0.05550410866482158f;
constexpr float kC4 = 0.009618129107628477f;
constexpr float kC5 = 0.0013333558146428443f;
constexpr float kC6 = 0.00015403530393381606f;
constexpr float kC7 = 1.525273380405984e-05f;
constexpr float kRound = 12582912.0f;  // 1.5 * 2^23

// 2^f for f in [-0.5, 0.5]: the polynomial of vexp2.
static inline __attribute__((always_inline)) vf exp2_poly(vf f) {
  vf p = bc(kC7);
  p = p * f + kC6;
  p = p * f + kC5;
  p = p * f + kC4;
  p = p * f + kC3;
  p = p * f + kC2;
  p = p * f + kC1;
  p = p * f + 1.0f;
  return p;
}

// 2^f for f in [-0.5, 0.5] where the probabilities feed bf16 products (P and
// dS rounded to bf16 pairs, Pk = uint32_t): a degree-5 polynomial with
// constant term 1, fitted minimax in relative error on [-0.5, 0.5] (Lawson's
// reweighted least squares on 200001 points, numpy, float64): max relative
// error 9.2e-8, 1.9e-7 evaluated in float32 by Horner, against bf16's
// rounding of 3.9e-3 (degree 4 reads 2.9e-6, degree 3 1.0e-4).
constexpr float kB1 = 0.6931470036506653f;
constexpr float kB2 = 0.24022242426872253f;
constexpr float kB3 = 0.05550733581185341f;
constexpr float kB4 = 0.009671509265899658f;
constexpr float kB5 = 0.0013264714507386088f;

// The polynomial of 2^f for probabilities that go into products of Pk: the
// degree-5 one above for bf16 pairs, exp2_poly (float32-exact) otherwise.
// Every exponential of P for one Pk (forward, both backward forms) goes
// through here, so the backward's forms stay bitwise identical.
template <class Pk>
static inline __attribute__((always_inline)) vf exp2_poly_p(vf f) {
  if constexpr (Lanes<Pk>::kPair == 2) {
    vf p = bc(kB5);
    p = p * f + kB4;
    p = p * f + kB3;
    p = p * f + kB2;
    p = p * f + kB1;
    p = p * f + 1.0f;
    return p;
  } else {
    return exp2_poly(f);
  }
}

// vexp2<Pk>: 2^x with exp2_poly_p<Pk>; vexp2 (Pk = float): exp2_poly, for
// the probabilities of float32 products and for the running-max factors.
template <class Pk = float>
static inline __attribute__((always_inline)) vf vexp2(vf x) {
#if defined(__AVX512F__)
  // AVX-512 (with DQ): vreduceps gives f = x - round(x), and x - f is round(x)
  // exactly; vscalefps applies 2^r, underflowing to +0 below -149 and keeping
  // NaN. vreduceps maps -inf to f = 0, so r = -inf and the result is +0 with
  // no clamp. Two issue slots per vector fewer than a clamp and vrndscaleps
  // (two uops on Intel), with the same f, r and results for every x <= 127.
  // (The merge-masked forms with a full mask are the same instructions; the
  // unmasked intrinsics trip GCC 12's uninitialized-value warning.)
  const vf f = _mm512_mask_reduce_ps(x, 0xffff, x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const vf r = x - f;
  const vf p = exp2_poly_p<Pk>(f);
  return _mm512_mask_scalef_ps(p, 0xffff, p, r);
#else
  const vf lo = bc(-127.0f), hi = bc(127.0f);
#if defined(__AVX__)
  // vmaxps and vminps return their second operand where either is NaN, so a
  // NaN x passes the clamp (one instruction each, where a compare and a
  // blend take two).
  const vf xc = _mm256_min_ps(hi, _mm256_max_ps(lo, x));
#else
  vf xc = x < lo ? lo : x;
  xc = xc > hi ? hi : xc;
#endif
  vf r = (xc + kRound) - kRound;
  vf f = xc - r;
  const vf p = exp2_poly_p<Pk>(f);
  // A NaN r converts to int only with undefined behaviour, from which clang
  // infers that x is never NaN (and then clamps NaN to -127): convert 0
  // instead; p carries the NaN.
  vi n = __builtin_convertvector(r == r ? r : vf{}, vi);
  vi bits = (n + 127) << 23;  // n = -127 -> +0.0
  vf s;
  memcpy(&s, &bits, sizeof(s));
  return p * s;
#endif
}

static inline float hsum(vf v) {
  float s = v[0];
  for (int k = 1; k < W; ++k) s += v[k];
  return s;
}

// ---------------------------------------------------------------------------
// Element conversions (round-to-nearest-even when narrowing).
// ---------------------------------------------------------------------------
static inline float bf16_to_f32(uint16_t h) { return u2f(static_cast<uint32_t>(h) << 16); }
static inline uint16_t f32_to_bf16(float f) {
  uint32_t u = f2u(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}
static inline float f16_to_f32(uint16_t h) {
  uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
  if (e == 0x1f) return u2f(sign | 0x7f800000u | (m << 13));
  if (e == 0) return u2f(sign | f2u(static_cast<float>(m) * 5.9604644775390625e-8f));
  return u2f(sign | ((e + 112u) << 23) | (m << 13));
}
static inline uint16_t f32_to_f16(float f) {
  uint32_t x = f2u(f);
  uint32_t sign = (x >> 16) & 0x8000u;
  uint32_t ax = x & 0x7fffffffu;
  if (ax >= 0x7f800000u) return static_cast<uint16_t>(sign | 0x7c00u | (ax > 0x7f800000u ? 0x200u : 0u));
  if (ax >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);
  if (ax < 0x38800000u) {
    // Subnormal half: in [0.5, 1) a float's ulp is 2^-24, the half's subnormal
    // step, so the float addition does the round-to-nearest-even.
    float t = u2f(ax) + 0.5f;
    return static_cast<uint16_t>(sign | (f2u(t) - 0x3f000000u));
  }
  uint32_t odd = (ax >> 13) & 1u;
  ax += 0xc8000fffu + odd;
  return static_cast<uint16_t>(sign | (ax >> 13));
}

// Converts n elements of dtype dt at src into floats.
static inline void load_row(const void* src, DType dt, int64_t n, float* dst) {
  if (dt == DType::kF32) {
    memcpy(dst, src, static_cast<size_t>(n) * 4);
  } else if (dt == DType::kBF16) {
    const uint16_t* s = static_cast<const uint16_t*>(src);
    for (int64_t k = 0; k < n; ++k) dst[k] = u2f(static_cast<uint32_t>(s[k]) << 16);
  } else {
    const uint16_t* s = static_cast<const uint16_t*>(src);
    int64_t k = 0;
#if defined(FATRAIN_HAVE_F16C)
    for (; k + 8 <= n; k += 8) {
      __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + k));
      _mm256_storeu_ps(dst + k, _mm256_cvtph_ps(h));
    }
#endif
    for (; k < n; ++k) dst[k] = f16_to_f32(s[k]);
  }
}

// Writes n floats (times mul) as dtype dt.
static inline void store_row(void* dst, DType dt, int64_t n, const float* src, float mul) {
  if (dt == DType::kF32) {
    float* d = static_cast<float*>(dst);
    for (int64_t k = 0; k < n; ++k) d[k] = src[k] * mul;
  } else if (dt == DType::kBF16) {
    uint16_t* d = static_cast<uint16_t*>(dst);
    for (int64_t k = 0; k < n; ++k) {
      uint32_t u = f2u(src[k] * mul);
      uint32_t r = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
      if ((u & 0x7fffffffu) > 0x7f800000u) r = (u >> 16) | 0x40u;
      d[k] = static_cast<uint16_t>(r);
    }
  } else {
    uint16_t* d = static_cast<uint16_t*>(dst);
    int64_t k = 0;
#if defined(FATRAIN_HAVE_F16C)
    __m256 m8 = _mm256_set1_ps(mul);
    for (; k + 8 <= n; k += 8) {
      __m256 x = _mm256_mul_ps(_mm256_loadu_ps(src + k), m8);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(d + k),
                       _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    }
#endif
    for (; k < n; ++k) d[k] = f32_to_f16(src[k] * mul);
  }
}

static inline float load_elem(const void* p, DType dt, int64_t idx) {
  if (dt == DType::kF32) return static_cast<const float*>(p)[idx];
  if (dt == DType::kBF16) return bf16_to_f32(static_cast<const uint16_t*>(p)[idx]);
  return f16_to_f32(static_cast<const uint16_t*>(p)[idx]);
}

static inline int64_t dtype_size(DType dt) { return dt == DType::kF32 ? 4 : 2; }

static inline const char* row_ptr(const SeqTensor& x, int64_t b, int64_t t, int64_t h) {
  return static_cast<const char*>(x.data) +
         (b * x.batch_stride + t * x.seq_stride + h * x.head_stride) * dtype_size(x.dtype);
}
static inline char* row_ptr_mut(const SeqTensor& x, int64_t b, int64_t t, int64_t h) {
  return static_cast<char*>(x.data) +
         (b * x.batch_stride + t * x.seq_stride + h * x.head_stride) * dtype_size(x.dtype);
}

}  // namespace
}  // namespace fatrain::cpu::FATRAIN_ISA
