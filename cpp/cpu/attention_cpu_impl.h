// FlashAttention-2 training kernels for the CPU: the one implementation that
// is compiled once per instruction set.
//
// Each ISA translation unit (attention_cpu_isa_{baseline,avx2,avx512}.cc)
// defines FATRAIN_ISA and includes this header once, so everything below lands
// in the distinct namespace fatrain::cpu::<isa>. All helpers live in an
// anonymous namespace (internal linkage), and the code uses no standard
// library templates or inline library functions: nothing compiled with wide
// vector instructions can be merged (COMDAT) into another ISA's code. Only the
// entry points at the bottom have external linkage.
//
// Structure (see docs/design.md and docs/cpu.md):
//  * Pre-pass: operands are packed per head into float32 scratch (row-major
//    copies [len_pad, Dp] and transposed copies blocked by tile
//    [ntiles][D][tile]), converting bf16/f16 once. Padding is zero. bf16
//    problems on CPUs with a bf16 dot product are packed as bf16 pairs
//    instead (see Lanes).
//  * Every tile GEMM is C[M x N] (+)= A[M x K] . B[K x N] with B row-major:
//    one register-blocked micro-kernel (kMR rows x kNR vectors of W floats)
//    written with GCC vector extensions, so the same source becomes AVX-512,
//    AVX2+FMA, SSE2 or NEON code depending on the TU's flags.
//  * Forward: items (b, n, q_tile), online softmax in base 2.
//  * Backward: Drow / base-2 L pre-pass, then pass 1 (dQ, q tiles outer) and
//    pass 2 (dK/dV, kv tiles outer, GQA group and q tiles looped inside in a
//    fixed order). No atomics on data: bitwise deterministic.
//  * Bias gradient: items own disjoint slices of dbias and loop over the
//    contributing (b, n) in a fixed order.
//  * Segment ids (packed sequences): the id range [min, max] of every query
//    and key tile is computed once per call, and from it each query tile's
//    range of key tiles (and each key tile's range of query tiles) whose
//    id ranges meet. Tiles whose ranges are disjoint share no id and are
//    skipped in every pass; this holds for ids in any order, and sorted ids
//    (documents one after another) give narrow ranges, so most tiles of a
//    pack are skipped. Inside a visited tile ids are compared per element.

#ifndef FATRAIN_ISA
#error "define FATRAIN_ISA before including attention_cpu_impl.h"
#endif

#include <climits>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "attention_cpu.h"

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
constexpr int kMR = 4;  // micro-kernel rows
constexpr int kNR = 4;  // micro-kernel vectors per row (16 zmm accumulators)
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
static inline int64_t imin(int64_t a, int64_t b) { return a < b ? a : b; }
static inline int64_t imax(int64_t a, int64_t b) { return a > b ? a : b; }
static inline int64_t round_up(int64_t a, int64_t m) { return (a + m - 1) / m * m; }
static inline float fmaxs(float a, float b) { return a > b ? a : b; }

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
// to an f32 lane (avx512_bf16's vdpbf16ps), twice the f32 FMA rate. The tile
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

template <class Pk>
struct Lanes;

template <>
struct Lanes<float> {
  using V = vf;
  static constexpr int64_t kPair = 1;  // elements per Pk
  static inline __attribute__((always_inline)) V load(const float* p) { return ld(p); }
  static inline __attribute__((always_inline)) V bcast(float x) { return bc(x); }
  static inline __attribute__((always_inline)) vf madd(vf c, V a, V b) { return c + a * b; }
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
    c = c + a_hi * b_hi;
    return c + a_lo * b_lo;
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

static inline __attribute__((always_inline)) vf vexp2(vf x) {
#if defined(__AVX512F__)
  // AVX-512: round with vrndscaleps and apply 2^r with vscalefps, which
  // underflows x < -149 to +0 and keeps NaN: 11 vector operations instead of
  // 16, the same polynomial, and the same results where 2^x is a normal float.
  const vf xc = x < bc(-150.0f) ? bc(-150.0f) : x;
  const vf r = _mm512_roundscale_ps(xc, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const vf f = xc - r;
  vf p = bc(kC7);
  p = p * f + kC6;
  p = p * f + kC5;
  p = p * f + kC4;
  p = p * f + kC3;
  p = p * f + kC2;
  p = p * f + kC1;
  p = p * f + 1.0f;
  return _mm512_scalef_ps(p, r);
#else
  const vf lo = bc(-127.0f), hi = bc(127.0f);
  vf xc = x < lo ? lo : x;
  xc = xc > hi ? hi : xc;
  vf r = (xc + kRound) - kRound;
  vf f = xc - r;
  vf p = bc(kC7);
  p = p * f + kC6;
  p = p * f + kC5;
  p = p * f + kC4;
  p = p * f + kC3;
  p = p * f + kC2;
  p = p * f + kC1;
  p = p * f + 1.0f;
  vi n = __builtin_convertvector(r, vi);
  vi bits = (n + 127) << 23;  // n = -127 -> +0.0
  vf s;
  memcpy(&s, &bits, sizeof(s));
  return p * s;
#endif
}

static inline float sexp2(float x) {
  if (x != x) return x;  // NaN
  float xc = x > -127.0f ? x : -127.0f;
  xc = xc < 127.0f ? xc : 127.0f;
  float r = (xc + kRound) - kRound;
  float f = xc - r;
  float p = kC7;
  p = p * f + kC6;
  p = p * f + kC5;
  p = p * f + kC4;
  p = p * f + kC3;
  p = p * f + kC2;
  p = p * f + kC1;
  p = p * f + 1.0f;
  int32_t n = static_cast<int32_t>(r);
  return p * u2f(static_cast<uint32_t>(n + 127) << 23);
}

static inline float hmax(vf v) {
  float m = v[0];
  for (int k = 1; k < W; ++k) m = fmaxs(m, v[k]);
  return m;
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

static inline float* falloc(int64_t n) {
  size_t bytes = static_cast<size_t>(round_up(n > 0 ? n : 1, 16)) * 4;
  return static_cast<float*>(aligned_alloc(64, bytes));
}

// Large packed-operand scratch, kept in a one-slot cache between calls so
// that repeated calls do not pay page faults for fresh pages (tens of MB at
// long sequence lengths). The slot keeps the largest recently released block
// (at most kCacheMax bytes); take/give use atomic exchanges only, so any
// interleaving of concurrent calls is safe (each block is owned by exactly one
// caller or by the slot). A block is [64-byte header holding its capacity in
// floats][data].
constexpr int64_t kCacheMaxFloats = int64_t(1) << 28;  // 1 GiB
void* g_scratch_slot = nullptr;

static inline int64_t block_cap(void* blk) { return *static_cast<int64_t*>(blk); }

static float* scratch_take(int64_t n, void** handle) {
  n = round_up(n > 0 ? n : 1, 16);
  void* blk = __atomic_exchange_n(&g_scratch_slot, static_cast<void*>(nullptr), __ATOMIC_ACQ_REL);
  if (blk != nullptr && block_cap(blk) < n) {
    free(blk);
    blk = nullptr;
  }
  if (blk == nullptr) {
    blk = aligned_alloc(64, 64 + static_cast<size_t>(n) * 4);
    if (blk == nullptr) return nullptr;
    *static_cast<int64_t*>(blk) = n;
  }
  *handle = blk;
  return reinterpret_cast<float*>(static_cast<char*>(blk) + 64);
}

static void scratch_give(void* blk) {
  if (blk == nullptr) return;
  if (block_cap(blk) > kCacheMaxFloats) {
    free(blk);
    return;
  }
  void* old = __atomic_exchange_n(&g_scratch_slot, blk, __ATOMIC_ACQ_REL);
  if (old == nullptr) return;
  if (block_cap(old) > block_cap(blk)) {
    // Keep the larger block in the slot; free whatever it displaces.
    void* cur = __atomic_exchange_n(&g_scratch_slot, old, __ATOMIC_ACQ_REL);
    free(cur);
  } else {
    free(old);
  }
}

// Carves 64-byte aligned sub-arrays out of one scratch block.
struct Carver {
  float* base;
  int64_t used;
  float* take(int64_t n) {
    float* p = base + used;
    used += round_up(n > 0 ? n : 1, 16);
    return p;
  }
};
static inline int64_t carve_size(int64_t n) { return round_up(n > 0 ? n : 1, 16); }

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

// K counts Pk elements (pairs for bf16), the strides too. Element (i, k) of
// A is A[i * sa + k * sk]: sk = 1 for A stored by rows (the usual case),
// sa = 1 for A stored by columns (A is the transpose of a row-major tile, read
// in place instead of being transposed first).
template <int M, int N, Sum kSum, class Pk>
static void mk(int64_t K, const Pk* __restrict A, int64_t sa, int64_t sk, const Pk* __restrict B,
               int64_t ldb, float* __restrict C, int64_t ldc) {
  using L = Lanes<Pk>;
  using V = typename L::V;
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
#pragma GCC unroll 8
    for (int i = 0; i < M; ++i) {
#pragma GCC unroll 8
      for (int j = 0; j < N; ++j) c[i][j] = (add && !kScores) ? ld(C + i * ldc + j * W) : vf{};
    }
    for (int64_t k = k0; k < k1; ++k) {
      V b[N];
#pragma GCC unroll 8
      for (int j = 0; j < N; ++j) b[j] = L::load(B + k * ldb + j * W);
#pragma GCC unroll 8
      for (int i = 0; i < M; ++i) {
        V a = L::bcast(A[i * sa + k * sk]);
#pragma GCC unroll 8
        for (int j = 0; j < N; ++j) c[i][j] = L::madd(c[i][j], a, b[j]);
      }
    }
#pragma GCC unroll 8
    for (int i = 0; i < M; ++i) {
#pragma GCC unroll 8
      for (int j = 0; j < N; ++j) {
        float* p = C + i * ldc + j * W;
        st(p, (add && kScores) ? ld(p) + c[i][j] : c[i][j]);
      }
    }
  }
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

template <int N, Sum kSum, class Pk>
static void gemm_cols(int64_t M, int64_t K, const Pk* A, int64_t sa, int64_t sk, const Pk* B,
                      int64_t ldb, float* C, int64_t ldc) {
  int64_t i = 0;
  for (; i + kMR <= M; i += kMR)
    mk<kMR, N, kSum, Pk>(K, A + i * sa, sa, sk, B, ldb, C + i * ldc, ldc);
  if (i < M)
    mk_rows_rem<kMR - 1, N, kSum, Pk>(M - i, K, A + i * sa, sa, sk, B, ldb, C + i * ldc, ldc);
}

template <int R, Sum kSum, class Pk>
static inline void gemm_cols_rem(int64_t r, int64_t M, int64_t K, const Pk* A, int64_t sa,
                                 int64_t sk, const Pk* B, int64_t ldb, float* C, int64_t ldc) {
  if constexpr (R > 0) {
    if (r == R)
      gemm_cols<R, kSum, Pk>(M, K, A, sa, sk, B, ldb, C, ldc);
    else
      gemm_cols_rem<R - 1, kSum, Pk>(r, M, K, A, sa, sk, B, ldb, C, ldc);
  }
}

template <Sum kSum, class Pk>
static void gemm(int64_t M, int64_t N, int64_t K, const Pk* A, int64_t sa, int64_t sk,
                 const Pk* B, int64_t ldb, float* C, int64_t ldc) {
  if (M <= 0 || N <= 0) return;
  int64_t nv = N / W, j = 0;
  for (; j + kNR <= nv; j += kNR)
    gemm_cols<kNR, kSum, Pk>(M, K, A, sa, sk, B + j * W, ldb, C + j * W, ldc);
  if (j < nv)
    gemm_cols_rem<kNR - 1, kSum, Pk>(nv - j, M, K, A, sa, sk, B + j * W, ldb, C + j * W, ldc);
}

// C[M x N] = A[M x K] . B[K x N], K the head dim (see above), A by rows.
// K past kScoreKBlock Pk elements is summed a K block at a time over all of
// C, so that the block of B every micro-kernel call reads (K block x N, 16 KB
// for N = 64) and C fit the L1 cache together; the chunks and their order
// stay the same (the block is a multiple of the chunk).
constexpr int64_t kScoreKBlock = 64;
static_assert(kScoreKBlock % kScoreSumChunk == 0, "K blocks must end on chunk boundaries");
template <class Pk>
static inline void score_gemm(int64_t M, int64_t N, int64_t K, const Pk* A, int64_t lda,
                              const Pk* B, int64_t ldb, float* C, int64_t ldc) {
  constexpr int64_t kb = kScoreKBlock;
  gemm<kChunks, Pk>(M, N, imin(K, kb), A, lda, 1, B, ldb, C, ldc);
  for (int64_t k0 = kb; k0 < K; k0 += kb)
    gemm<kMoreChunks, Pk>(M, N, imin(K - k0, kb), A + k0, lda, 1, B + k0 * ldb, ldb, C, ldc);
}

// C[M x N] += A[M x K] . B[K x N], A by rows.
template <class Pk>
static inline void acc_gemm(int64_t M, int64_t N, int64_t K, const Pk* A, int64_t lda,
                            const Pk* B, int64_t ldb, float* C, int64_t ldc) {
  gemm<kSequential, Pk>(M, N, K, A, lda, 1, B, ldb, C, ldc);
}

// C[M x N] += A[M x K] . B[K x N], A by columns: element (i, k) at At[k * ldat + i].
template <class Pk>
static inline void acc_gemm_at(int64_t M, int64_t N, int64_t K, const Pk* At, int64_t ldat,
                               const Pk* B, int64_t ldb, float* C, int64_t ldc) {
  gemm<kSequential, Pk>(M, N, K, At, 1, ldat, B, ldb, C, ldc);
}

// A computed f32 tile (rows x ld, n real columns) as the A operand of a
// product over its columns: itself for f32; for bf16, words of rounded
// column pairs (ld / 2 per row), a column n paired with 0.
template <class Pk>
static inline const Pk* a_tile(const float* t, int64_t rows, int64_t ld, int64_t n, Pk* words);
template <>
inline const float* a_tile<float>(const float* t, int64_t, int64_t, int64_t, float*) {
  return t;
}
template <>
inline const uint32_t* a_tile<uint32_t>(const float* t, int64_t rows, int64_t ld, int64_t n,
                                        uint32_t* words) {
  const int64_t full = n / 2, ldw = ld / 2;
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = t + r * ld;
    uint32_t* w = words + r * ldw;
    for (int64_t p = 0; p < full; ++p) w[p] = bf16_pair(row[2 * p], row[2 * p + 1]);
    if (n % 2) w[full] = bf16_pair(row[n - 1], 0.0f);
  }
  return words;
}

// A computed f32 tile (rows x ld, n computed columns) as an operand summed
// over its rows (the B operand Pᵀ of Oᵀ += Vᵀ Pᵀ, the A operand dSᵀ of
// dQ += dS K read by columns): itself for f32; for bf16, words of rounded row
// pairs, words[u * ld + c] = (t[2u][c], t[2u + 1][c]), an odd last row paired
// with 0.
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
      const vu w = vbf16_bits(ld(lo + c)) | (vbf16_bits(has_hi ? ld(hi + c) : zero) << 16);
      memcpy(words + u * ldt + c, &w, sizeof(w));
    }
  }
  return words;
}

// ---------------------------------------------------------------------------
// Parallel helpers.
// ---------------------------------------------------------------------------
template <class F>
static void trampoline(void* context, int64_t i) {
  (*static_cast<F*>(context))(i);
}
template <class F>
static void parallel_for(const ParallelFor& pf, int64_t count, F& f) {
  if (count <= 0) return;
  if (pf.run == nullptr || count == 1) {
    for (int64_t i = 0; i < count; ++i) f(i);
  } else {
    pf.run(pf.self, count, &trampoline<F>, &f);
  }
}
static inline void set_fail(int* flag) { __atomic_store_n(flag, 1, __ATOMIC_RELAXED); }

// ---------------------------------------------------------------------------
// Problem geometry and visibility.
// ---------------------------------------------------------------------------
struct Geo {
  int64_t B, N, KH, G, T, S, D, Dp, Tp, Sp, ntq, ntk;
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
  vf vs = bc(scale), vl = bc(kLog2e);
  if (brow) {
    for (int64_t c = 0; c < nc; c += W) st(s + c, (ld(s + c) * vs + ld(brow + c)) * vl);
  } else {
    for (int64_t c = 0; c < nc; c += W) st(s + c, (ld(s + c) * vs) * vl);
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
        st(s + c, (col < vlo) | (col > vhi) ? bc(-kInf) : ld(s + c));
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

// ---------------------------------------------------------------------------
// Packing.
// ---------------------------------------------------------------------------
// Row-major f32 copy [Lp, Dp] of head h of x, zero padded.
static void pack_rows(const SeqTensor& x, int64_t b, int64_t h, int64_t L, int64_t Lp, int64_t D,
                      int64_t Dp, float* dst) {
  for (int64_t t = 0; t < L; ++t) {
    float* d = dst + t * Dp;
    load_row(row_ptr(x, b, t, h), x.dtype, D, d);
    for (int64_t k = D; k < Dp; ++k) d[k] = 0.0f;
  }
  memset(dst + L * Dp, 0, static_cast<size_t>((Lp - L) * Dp) * 4);
}
// Transposed copy blocked by tile: dst[blk][d][c] = rows[blk*bt + c][d].
static void pack_transposed(const float* rows, int64_t Lp, int64_t D, int64_t Dp, int64_t bt,
                            float* dst) {
  for (int64_t blk = 0; blk < Lp / bt; ++blk) {
    float* o = dst + blk * D * bt;
    const float* r = rows + blk * bt * Dp;
    for (int64_t d = 0; d < D; ++d)
      for (int64_t c = 0; c < bt; ++c) o[d * bt + c] = r[c * Dp + d];
  }
}

// bf16 pair packs (Lanes<uint32_t>), from f32 row packs [Lp, Dp] whose values
// are bf16 (so the rounding is exact). Dp and Lp are even; padding stays 0.
// Rows, pairs along D: dst[t][p] = (rows[t][2p], rows[t][2p+1]), Dp/2 words a row.
static void pack_pair_rows(const float* rows, int64_t Lp, int64_t Dp, uint32_t* dst) {
  for (int64_t i = 0; i < Lp * Dp / 2; ++i) dst[i] = bf16_pair(rows[2 * i], rows[2 * i + 1]);
}
// Transposed by tile, pairs along D: dst[blk][p][c] = (rows[blk*bt + c][2p], ..[2p+1]),
// p < Dk = ceil(D / 2).
static void pack_pair_transposed(const float* rows, int64_t Lp, int64_t D, int64_t Dp, int64_t bt,
                                 uint32_t* dst) {
  const int64_t Dk = (D + 1) / 2;
  for (int64_t blk = 0; blk < Lp / bt; ++blk) {
    uint32_t* o = dst + blk * Dk * bt;
    const float* r = rows + blk * bt * Dp;
    for (int64_t p = 0; p < Dk; ++p)
      for (int64_t c = 0; c < bt; ++c) o[p * bt + c] = bf16_pair(r[c * Dp + 2 * p], r[c * Dp + 2 * p + 1]);
  }
}
// Pairs along the sequence: dst[u][d] = (rows[2u][d], rows[2u+1][d]), the B
// operand of the products summed over keys or queries (O, dV, dK, dQ).
static void pack_pair_interleaved(const float* rows, int64_t Lp, int64_t Dp, uint32_t* dst) {
  for (int64_t u = 0; u < Lp / 2; ++u)
    for (int64_t d = 0; d < Dp; ++d)
      dst[u * Dp + d] = bf16_pair(rows[2 * u * Dp + d], rows[(2 * u + 1) * Dp + d]);
}

// ---------------------------------------------------------------------------
// Forward.
// ---------------------------------------------------------------------------
struct FwdState {
  Geo g;
  const ForwardOperands* op;
  float* K;  // [B*KH][Sp][Dp] rows
  float* V;  // [B*KH][Sp][Dp] rows
  // With bf16 pairs (words): K with pairs along D [B*KH][Sp][Dp / 2] and V
  // with pairs along keys [B*KH][Sp / 2][Dp], both in K's space; V's space is
  // the f32 packing scratch.
  bool words;
  uint32_t* Kw;
  uint32_t* Vw;
  int fail;
};

static void fwd_pack(FwdState& s, int64_t idx) {
  const Geo& g = s.g;
  int64_t b = idx / g.KH, h = idx % g.KH;
  const int64_t head = idx * g.Sp * g.Dp;
  if (s.words) {
    float* rows = s.V + head;
    pack_rows(s.op->k, b, h, g.S, g.Sp, g.D, g.Dp, rows);
    pack_pair_rows(rows, g.Sp, g.Dp, s.Kw + head / 2);
    pack_rows(s.op->v, b, h, g.S, g.Sp, g.D, g.Dp, rows);
    pack_pair_interleaved(rows, g.Sp, g.Dp, s.Vw + head / 2);
    return;
  }
  pack_rows(s.op->k, b, h, g.S, g.Sp, g.D, g.Dp, s.K + head);
  pack_rows(s.op->v, b, h, g.S, g.Sp, g.D, g.Dp, s.V + head);
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
  int64_t Dp = g.Dp, D = g.D, Dk = (D + kP - 1) / kP;
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
  const int64_t head = (b * g.KH + kh) * g.Sp * Dp;
  // A of Sᵀ = K Qᵀ: K's rows; A of Oᵀ += Vᵀ Pᵀ: V by columns (f32 rows, or
  // key pairs for bf16), both Dp / kP elements a row.
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
    score_gemm<Pk>(nj, ncq, Dk, Kh + j0 * (Dp / kP), Dp / kP, QT, BQ, St, BQ);
    const TileScores<false> scores(g, b, n, i0, ni, ncq, cls, te, se);
    for (int64_t r = 0; r < nj; ++r) scores.prep(St + r * BQ, j0 + r, brow);
    // New running max per query. A query that has seen no finite score keeps
    // m = -inf and exponentiates against 0 (its p are 0, or NaN from a NaN
    // score); any NaN score makes its query's l, and so its O and L, NaN.
    bool rescale = false;
    for (int64_t v = 0; v < nqv; ++v) {
      vf mx = bc(-kInf);
      for (int64_t r = 0; r < nj; ++r) mx = vmax(mx, ld(St + r * BQ + v * W));
      const vf mold = ld(mrow + v * W), mnew = vmax(mold, mx);
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
        const vf p = vexp2(ld(srow + v * W) - ld(mexp + v * W));
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
    acc_gemm_at<Pk>(Dp, ncq, (nj + kP - 1) / kP, Vh + j0 / kP * Dp, Dp,
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

// ---------------------------------------------------------------------------
// Backward (and bias gradient) shared packing.
// ---------------------------------------------------------------------------
struct BwdState {
  Geo g;
  const SeqTensor *q, *k, *v, *o, *d_o;
  const float* lse;
  const BackwardOperands* bop;
  const BiasGradOperands* gop;
  bool need_transposed_q;  // QT / dOT / Kp / Vp (pass 2)
  float *Qp, *dOp, *QT, *dOT, *Drow, *Lb;  // per q head
  float *Kp, *Vp, *KT, *VT;              // per kv head
  // bf16 pairs (words): the products read these instead of the f32 packs,
  // which then only feed them and Drow (QT, dOT, KT, VT are not made).
  // Rows with pairs along D (..w), transposed by tile (..Tw), and pairs along
  // the sequence (..i) for the B operands of dK, dV and dQ.
  bool words;
  uint32_t *Qw, *dOw, *QTw, *dOTw, *Qi, *dOi;  // per q head
  uint32_t *Kw, *Vw, *KTw, *VTw, *Ki;          // per kv head
  int fail;
};

// The packed operands as the tile products read them. A: rows [len][lda];
// T: transposed by tile [ntiles][Dk][tile]; B: the B operand of products
// summed over the sequence, [len / kPair][Dp] (the f32 rows themselves).
template <class Pk>
struct PackView {
  const Pk *Qa, *dOa, *QT, *dOT, *Qb, *dOb;  // per q head
  const Pk *Ka, *Va, *KT, *VT, *Kb;          // per kv head
  int64_t lda;  // Dp / kPair
  int64_t Dk;   // ceil(D / kPair): K of the score products
};

template <class Pk>
static PackView<Pk> pack_view(const BwdState& s);
template <>
inline PackView<float> pack_view<float>(const BwdState& s) {
  return {s.Qp, s.dOp, s.QT, s.dOT, s.Qp, s.dOp, s.Kp, s.Vp, s.KT, s.VT, s.Kp, s.g.Dp, s.g.D};
}
template <>
inline PackView<uint32_t> pack_view<uint32_t>(const BwdState& s) {
  return {s.Qw, s.dOw, s.QTw, s.dOTw, s.Qi, s.dOi, s.Kw, s.Vw, s.KTw, s.VTw, s.Ki,
          s.g.Dp / 2, (s.g.D + 1) / 2};
}

static void bwd_pack(BwdState& s, int64_t idx) {
  const Geo& g = s.g;
  int64_t Dp = g.Dp, D = g.D;
  if (idx < g.B * g.N) {
    int64_t b = idx / g.N, n = idx % g.N;
    float* Q = s.Qp + idx * g.Tp * Dp;
    float* dO = s.dOp + idx * g.Tp * Dp;
    pack_rows(*s.q, b, n, g.T, g.Tp, D, Dp, Q);
    pack_rows(*s.d_o, b, n, g.T, g.Tp, D, Dp, dO);
    if (s.words) {
      const int64_t wsz = g.Tp * Dp / 2, tsz = g.Tp * ((D + 1) / 2);
      pack_pair_rows(Q, g.Tp, Dp, s.Qw + idx * wsz);
      pack_pair_rows(dO, g.Tp, Dp, s.dOw + idx * wsz);
      pack_pair_transposed(Q, g.Tp, D, Dp, BQ, s.QTw + idx * tsz);
      pack_pair_transposed(dO, g.Tp, D, Dp, BQ, s.dOTw + idx * tsz);
      pack_pair_interleaved(Q, g.Tp, Dp, s.Qi + idx * wsz);
      pack_pair_interleaved(dO, g.Tp, Dp, s.dOi + idx * wsz);
    } else if (s.need_transposed_q) {
      pack_transposed(Q, g.Tp, D, Dp, BQ, s.QT + idx * g.Tp * D);
      pack_transposed(dO, g.Tp, D, Dp, BQ, s.dOT + idx * g.Tp * D);
    }
    float* Dr = s.Drow + idx * g.Tp;
    float* Lb = s.Lb + idx * g.Tp;
    const float* L = s.lse + idx * g.T;
    float orow[kMaxHeadDim];
    int64_t te = q_eff(g, b);
    for (int64_t t = 0; t < g.Tp; ++t) {
      float l = t < g.T ? L[t] : -kInf;
      // Dead rows (L = -inf, or past the query length) get p = 0 through
      // L = +inf; a NaN L (a NaN row of the forward) stays NaN and spreads to
      // the gradients as in jax.nn.
      if (t >= te || l == -kInf) {
        Dr[t] = 0.0f;
        Lb[t] = kInf;
        continue;
      }
      load_row(row_ptr(*s.o, b, t, n), s.o->dtype, D, orow);
      const float* dr = dO + t * Dp;
      float acc = 0.0f;
      for (int64_t d = 0; d < D; ++d) acc += dr[d] * orow[d];
      Dr[t] = acc;
      Lb[t] = l * kLog2e;
    }
  } else {
    idx -= g.B * g.N;
    int64_t b = idx / g.KH, h = idx % g.KH;
    float* K = s.Kp + idx * g.Sp * Dp;
    float* V = s.Vp + idx * g.Sp * Dp;
    pack_rows(*s.k, b, h, g.S, g.Sp, D, Dp, K);
    pack_rows(*s.v, b, h, g.S, g.Sp, D, Dp, V);
    if (s.words) {
      const int64_t wsz = g.Sp * Dp / 2, tsz = g.Sp * ((D + 1) / 2);
      pack_pair_rows(K, g.Sp, Dp, s.Kw + idx * wsz);
      pack_pair_rows(V, g.Sp, Dp, s.Vw + idx * wsz);
      pack_pair_transposed(K, g.Sp, D, Dp, BK, s.KTw + idx * tsz);
      pack_pair_transposed(V, g.Sp, D, Dp, BK, s.VTw + idx * tsz);
      pack_pair_interleaved(K, g.Sp, Dp, s.Ki + idx * wsz);
      return;
    }
    pack_transposed(K, g.Sp, D, Dp, BK, s.KT + idx * g.Sp * D);
    pack_transposed(V, g.Sp, D, Dp, BK, s.VT + idx * g.Sp * D);
  }
}

// dS tile in q-major orientation: rows = queries i0.. (ni), cols = keys j0..
// (nc computed, nj real). On return Sb holds dS = P * (dP - Drow); dPb is
// clobbered. brow: scratch of BK floats.
template <class Pk>
static void ds_tile_q(const BwdState& s, int64_t b, int64_t n, int64_t qt, int64_t kt, int cls,
                      int64_t te, int64_t se, float* Sb, float* dPb, float* brow) {
  const Geo& g = s.g;
  const PackView<Pk> o = pack_view<Pk>(s);
  int64_t i0 = qt * BQ, ni = imin(BQ, g.T - i0);
  int64_t j0 = kt * BK, nj = imin(BK, g.S - j0), nc = round_up(nj, W);
  int64_t qh = b * g.N + n, kvh = b * g.KH + n / g.G;
  const int64_t Tq = (qh * g.Tp + i0) * o.lda, Tk = kvh * g.Sp * o.Dk + kt * o.Dk * BK;
  score_gemm<Pk>(ni, nc, o.Dk, o.Qa + Tq, o.lda, o.KT + Tk, BK, Sb, BK);
  score_gemm<Pk>(ni, nc, o.Dk, o.dOa + Tq, o.lda, o.VT + Tk, BK, dPb, BK);
  const float* Lb = s.Lb + qh * g.Tp;
  const float* Dr = s.Drow + qh * g.Tp;
  const TileScores<true> scores(g, b, n, j0, nj, nc, cls, te, se);
  for (int64_t r = 0; r < ni; ++r) {
    int64_t i = i0 + r;
    float* srow = Sb + r * BK;
    float* dprow = dPb + r * BK;
    scores.prep(srow, i, brow);
    vf vL = bc(Lb[i]), vD = bc(Dr[i]);
    for (int64_t c = 0; c < nc; c += W) {
      vf p = vexp2(ld(srow + c) - vL);
      st(srow + c, p * (ld(dprow + c) - vD));
    }
  }
}

template <class Pk>
static void bwd_pass1(BwdState& s, int64_t idx) {
  constexpr int64_t kP = Lanes<Pk>::kPair;
  const Geo& g = s.g;
  const BackwardOperands& op = *s.bop;
  const PackView<Pk> o = pack_view<Pk>(s);
  int64_t qt = g.ntq - 1 - idx / (g.B * g.N);
  int64_t bn = idx % (g.B * g.N);
  int64_t b = bn / g.N, n = bn % g.N, kvh = b * g.KH + n / g.G;
  int64_t i0 = qt * BQ, ni = imin(BQ, g.T - i0);
  int64_t Dp = g.Dp, D = g.D;
  float* buf = falloc(BQ * Dp + 2 * BQ * BK + BK + (kP == 1 ? 0 : BQ * BK / 2));
  if (!buf) {
    set_fail(&s.fail);
    return;
  }
  float* dQ = buf;
  float* Sb = dQ + BQ * Dp;
  float* dPb = Sb + BQ * BK;
  float* brow = dPb + BQ * BK;
  Pk* dSw = reinterpret_cast<Pk*>(brow + BK);  // [BQ][BK / 2] (bf16 pairs only)
  memset(dQ, 0, static_cast<size_t>(BQ * Dp) * 4);
  int64_t te = q_eff(g, b), se = kv_eff(g, b);
  int64_t kt_begin, kt_end, visited = 0;
  key_tile_range(g, b, qt, &kt_begin, &kt_end);
  for (int64_t kt = kt_begin; kt < kt_end; ++kt) {
    int64_t j0 = kt * BK, nj = imin(BK, g.S - j0), nc = round_up(nj, W);
    int cls = classify(g, b, i0, ni, j0, nj, nc, ni, te, se);
    if (cls == 0) continue;
    ++visited;
    ds_tile_q<Pk>(s, b, n, qt, kt, cls, te, se, Sb, dPb, brow);
    acc_gemm<Pk>(ni, Dp, (nj + kP - 1) / kP, a_tile<Pk>(Sb, ni, BK, nj, dSw), BK / kP,
                 o.Kb + (kvh * g.Sp + j0) / kP * Dp, Dp, dQ, Dp);
  }
  count_tile_visits(kTileVisitsBackwardDq, visited);
  for (int64_t r = 0; r < ni; ++r)
    store_row(row_ptr_mut(op.dq, b, i0 + r, n), op.dq.dtype, D, dQ + r * Dp, g.scale);
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
  const int64_t Dp = g.Dp, qh = b * g.N + n;
  const int64_t i0 = qt * BQ, ni = imin(BQ, g.T - i0), ncq = round_up(ni, W);
  const float* Lb = s.Lb + qh * g.Tp;
  const float* Dr = s.Drow + qh * g.Tp;
  const TileScores<false> scores(g, b, n, i0, ni, ncq, cls, te, se);
  score_gemm<Pk>(nj, ncq, o.Dk, Kh, o.lda, o.QT + qh * g.Tp * o.Dk + qt * o.Dk * BQ, BQ, St, BQ);
  score_gemm<Pk>(nj, ncq, o.Dk, Vh, o.lda, o.dOT + qh * g.Tp * o.Dk + qt * o.Dk * BQ, BQ, dPt,
                 BQ);
  for (int64_t r = 0; r < nj; ++r) {
    float* srow = St + r * BQ;
    float* dprow = dPt + r * BQ;
    scores.prep(srow, j0 + r, brow);
    for (int64_t c = 0; c < ncq; c += W) {
      vf p = vexp2(ld(srow + c) - ld(Lb + i0 + c));
      st(srow + c, p);
      st(dprow + c, p * (ld(dprow + c) - ld(Dr + i0 + c)));
    }
  }
  acc_gemm<Pk>(nj, Dp, (ni + kP - 1) / kP, a_tile<Pk>(St, nj, BQ, ni, Pw), BQ / kP,
               o.dOb + (qh * g.Tp + i0) / kP * Dp, Dp, dV, Dp);
  acc_gemm<Pk>(nj, Dp, (ni + kP - 1) / kP, a_tile<Pk>(dPt, nj, BQ, ni, dSw), BQ / kP,
               o.Qb + (qh * g.Tp + i0) / kP * Dp, Dp, dK, Dp);
}

template <class Pk>
static void bwd_pass2(BwdState& s, int64_t idx) {
  constexpr int64_t kP = Lanes<Pk>::kPair;
  const Geo& g = s.g;
  const BackwardOperands& op = *s.bop;
  const PackView<Pk> o = pack_view<Pk>(s);
  int64_t kt = idx / (g.B * g.KH);
  int64_t bk = idx % (g.B * g.KH);
  int64_t b = bk / g.KH, kh = bk % g.KH;
  int64_t j0 = kt * BK, nj = imin(BK, g.S - j0);
  int64_t Dp = g.Dp, D = g.D;
  float* buf = falloc(2 * BK * Dp + 2 * BK * BQ + BQ + (kP == 1 ? 0 : BK * BQ));
  if (!buf) {
    set_fail(&s.fail);
    return;
  }
  float* dK = buf;
  float* dV = dK + BK * Dp;
  float* St = dV + BK * Dp;
  float* dPt = St + BK * BQ;
  float* brow = dPt + BK * BQ;
  Pk* Pw = reinterpret_cast<Pk*>(brow + BQ);  // [BK][BQ / 2] each (bf16 pairs only)
  Pk* dSw = Pw + BK * BQ / 2;
  memset(dK, 0, static_cast<size_t>(2 * BK * Dp) * 4);
  int64_t te = q_eff(g, b), se = kv_eff(g, b);
  const Pk* Kh = o.Ka + (bk * g.Sp + j0) * o.lda;
  const Pk* Vh = o.Va + (bk * g.Sp + j0) * o.lda;
  int64_t qt_begin, qt_end, visited = 0;
  query_tile_range(g, b, kt, &qt_begin, &qt_end);
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
  count_tile_visits(kTileVisitsBackwardDkDv, visited);
  for (int64_t r = 0; r < nj; ++r) {
    store_row(row_ptr_mut(op.dk, b, j0 + r, kh), op.dk.dtype, D, dK + r * Dp, g.scale);
    store_row(row_ptr_mut(op.dv, b, j0 + r, kh), op.dv.dtype, D, dV + r * Dp, 1.0f);
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
  constexpr int64_t kP = Lanes<Pk>::kPair;
  const Geo& g = s.g;
  const BackwardOperands& op = *s.bop;
  const PackView<Pk> o = pack_view<Pk>(s);
  int64_t b = idx / g.KH, kh = idx % g.KH;
  int64_t Dp = g.Dp, D = g.D;
  float* buf = falloc(g.G * g.Tp * Dp + 2 * BK * Dp + 2 * BK * BQ + BQ +
                      (kP == 1 ? 0 : 3 * BK * BQ / 2));
  if (!buf) {
    set_fail(&s.fail);
    return;
  }
  float* dQ = buf;
  float* dK = dQ + g.G * g.Tp * Dp;
  float* dV = dK + BK * Dp;
  float* St = dV + BK * Dp;
  float* dPt = St + BK * BQ;
  float* brow = dPt + BK * BQ;
  // Pᵀ and dSᵀ with pairs along queries, dSᵀ with pairs along keys (bf16 only).
  Pk* Pw = reinterpret_cast<Pk*>(brow + BQ);
  Pk* dSw = Pw + BK * BQ / 2;
  Pk* dSq = dSw + BK * BQ / 2;
  memset(dQ, 0, static_cast<size_t>(g.G * g.Tp * Dp) * 4);
  int64_t te = q_eff(g, b), se = kv_eff(g, b), visited = 0;
  for (int64_t kt = 0; kt < g.ntk; ++kt) {
    int64_t j0 = kt * BK, nj = imin(BK, g.S - j0), nc = round_up(nj, W);
    const Pk* Kh = o.Ka + (idx * g.Sp + j0) * o.lda;
    const Pk* Vh = o.Va + (idx * g.Sp + j0) * o.lda;
    memset(dK, 0, static_cast<size_t>(2 * BK * Dp) * 4);
    int64_t qt_begin, qt_end;
    query_tile_range(g, b, kt, &qt_begin, &qt_end);
    for (int64_t gi = 0; gi < g.G; ++gi) {
      int64_t n = kh * g.G + gi;
      for (int64_t qt = qt_begin; qt < qt_end; ++qt) {
        int64_t i0 = qt * BQ, ni = imin(BQ, g.T - i0), ncq = round_up(ni, W);
        int cls = classify(g, b, i0, ni, j0, nj, nc, ncq, te, se);
        if (cls == 0) continue;
        ++visited;
        dkdv_tile<Pk>(s, o, b, n, qt, cls, j0, nj, Kh, Vh, te, se, St, dPt, brow, Pw, dSw, dK,
                      dV);
        // dQ[i0.., :] += dS . K, dS read by columns out of dSᵀ in dPt.
        acc_gemm_at<Pk>(ni, Dp, (nj + kP - 1) / kP, row_pair_tile<Pk>(dPt, nj, BQ, ncq, dSq),
                        BQ, o.Kb + (idx * g.Sp + j0) / kP * Dp, Dp, dQ + (gi * g.Tp + i0) * Dp,
                        Dp);
      }
    }
    for (int64_t r = 0; r < nj; ++r) {
      store_row(row_ptr_mut(op.dk, b, j0 + r, kh), op.dk.dtype, D, dK + r * Dp, g.scale);
      store_row(row_ptr_mut(op.dv, b, j0 + r, kh), op.dv.dtype, D, dV + r * Dp, 1.0f);
    }
  }
  // Each tile pair served both the dQ and the dK/dV sums of the two-pass form.
  count_tile_visits(kTileVisitsBackwardDq, visited);
  count_tile_visits(kTileVisitsBackwardDkDv, visited);
  for (int64_t gi = 0; gi < g.G; ++gi) {
    int64_t n = kh * g.G + gi;
    for (int64_t t = 0; t < g.T; ++t)
      store_row(row_ptr_mut(op.dq, b, t, n), op.dq.dtype, D, dQ + (gi * g.Tp + t) * Dp, g.scale);
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
          ds_tile_q<float>(s, b, n, qt, kt, cls, te, se, Sb, dPb, brow);
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

template <class State, void (*Fn)(State&, int64_t)>
struct Bound {
  State* st;
  void operator()(int64_t i) const { Fn(*st, i); }
};

template <class State, void (*Fn)(State&, int64_t)>
static void run_items(const ParallelFor& pf, int64_t count, State& st) {
  Bound<State, Fn> b{&st};
  parallel_for(pf, count, b);
}

static const char* kOom = "jax_fatrain cpu: out of memory for attention scratch";

// Packs the operands (words: the bf16 pair packs instead of the f32
// transposed ones, see BwdState).
static const char* backward_common(BwdState& s, const ParallelFor& parallel, bool need_pass2,
                                   bool words, void** handle) {
  const Geo& g = s.g;
  int64_t qsz = g.B * g.N * g.Tp * g.Dp, qtsz = g.B * g.N * g.Tp * g.D;
  int64_t ksz = g.B * g.KH * g.Sp * g.Dp, ktsz = g.B * g.KH * g.Sp * g.D;
  int64_t rsz = g.B * g.N * g.Tp;
  int64_t segsz = s.g.qseg ? segment_tile_ints(g) : 0;
  // Word packs: rows and sequence pairs hold half an f32 row pack each,
  // transposed ones ceil(D / 2) words per row.
  int64_t qwsz = qsz / 2, qtwsz = g.B * g.N * g.Tp * ((g.D + 1) / 2);
  int64_t kwsz = ksz / 2, ktwsz = g.B * g.KH * g.Sp * ((g.D + 1) / 2);
  s.need_transposed_q = need_pass2;
  s.words = words;
  int64_t total = 2 * carve_size(qsz) + 2 * carve_size(rsz) + 2 * carve_size(ksz) +
                  carve_size(segsz);
  if (words)
    total += 4 * carve_size(qwsz) + 2 * carve_size(qtwsz) + 3 * carve_size(kwsz) +
             2 * carve_size(ktwsz);
  else
    total += 2 * carve_size(ktsz) + (need_pass2 ? 2 * carve_size(qtsz) : 0);
  float* base = scratch_take(total, handle);
  if (!base) return kOom;
  Carver c{base, 0};
  if (s.g.qseg) make_segment_tiles(s.g, reinterpret_cast<int32_t*>(c.take(segsz)));
  s.Qp = c.take(qsz);
  s.dOp = c.take(qsz);
  s.Drow = c.take(rsz);
  s.Lb = c.take(rsz);
  s.Kp = c.take(ksz);
  s.Vp = c.take(ksz);
  if (words) {
    auto w = [&c](int64_t n) { return reinterpret_cast<uint32_t*>(c.take(n)); };
    s.Qw = w(qwsz);
    s.dOw = w(qwsz);
    s.Qi = w(qwsz);
    s.dOi = w(qwsz);
    s.QTw = w(qtwsz);
    s.dOTw = w(qtwsz);
    s.Kw = w(kwsz);
    s.Vw = w(kwsz);
    s.Ki = w(kwsz);
    s.KTw = w(ktwsz);
    s.VTw = w(ktwsz);
  } else {
    s.QT = need_pass2 ? c.take(qtsz) : nullptr;
    s.dOT = need_pass2 ? c.take(qtsz) : nullptr;
    s.KT = c.take(ktsz);
    s.VT = c.take(ktsz);
  }
  s.fail = 0;
  run_items<BwdState, bwd_pack>(parallel, g.B * g.N + g.B * g.KH, s);
  return s.fail ? kOom : nullptr;
}

}  // namespace

// ---------------------------------------------------------------------------
// Entry points (problem and operands already validated by attention_cpu.cc).
// ---------------------------------------------------------------------------
const char* attention_forward(const AttentionProblem& problem, const ForwardOperands& operands,
                              const ParallelFor& parallel, bool bf16_dot) {
  FwdState s;
  make_geo(problem, s.g);
  const Geo& g = s.g;
  s.op = &operands;
  s.fail = 0;
  s.words = kHasBf16Dot && bf16_dot && operands.q.dtype == DType::kBF16;
  void* handle = nullptr;
  const int64_t packsz = g.B * g.KH * g.Sp * g.Dp;  // K's and V's space each (see FwdState)
  int64_t segsz = g.qseg ? segment_tile_ints(g) : 0;
  float* base = scratch_take(2 * carve_size(packsz) + carve_size(segsz), &handle);
  const char* err = nullptr;
  if (!base) {
    err = kOom;
  } else {
    Carver c{base, 0};
    s.K = c.take(packsz);
    s.V = c.take(packsz);
    s.Kw = reinterpret_cast<uint32_t*>(s.K);
    s.Vw = s.Kw + packsz / 2;
    if (g.qseg) make_segment_tiles(s.g, reinterpret_cast<int32_t*>(c.take(segsz)));
    run_items<FwdState, fwd_pack>(parallel, g.B * g.KH, s);
    if (s.fail) err = kOom;
  }
  if (!err) {
    if constexpr (kHasBf16Dot) {
      if (s.words)
        run_items<FwdState, fwd_item<uint32_t>>(parallel, g.B * g.N * g.ntq, s);
      else
        run_items<FwdState, fwd_item<float>>(parallel, g.B * g.N * g.ntq, s);
    } else {
      run_items<FwdState, fwd_item<float>>(parallel, g.B * g.N * g.ntq, s);
    }
    if (s.fail) err = kOom;
  }
  scratch_give(handle);
  return err;
}

// The backward in operand format Pk (see Lanes).
template <class Pk>
static void run_backward(BwdState& s, const ParallelFor& parallel) {
  const Geo& g = s.g;
  if (use_fused_backward(g, parallel.num_threads)) {
    run_items<BwdState, bwd_fused<Pk>>(parallel, g.B * g.KH, s);
  } else {
    run_items<BwdState, bwd_pass1<Pk>>(parallel, g.B * g.N * g.ntq, s);
    if (!s.fail) run_items<BwdState, bwd_pass2<Pk>>(parallel, g.B * g.KH * g.ntk, s);
  }
}

const char* attention_backward(const AttentionProblem& problem, const BackwardOperands& operands,
                               const ParallelFor& parallel, bool bf16_dot) {
  BwdState s;
  memset(&s, 0, sizeof(s));
  make_geo(problem, s.g);
  s.q = &operands.q;
  s.k = &operands.k;
  s.v = &operands.v;
  s.o = &operands.o;
  s.d_o = &operands.d_o;
  s.lse = operands.lse;
  s.bop = &operands;
  void* handle = nullptr;
  const bool words = kHasBf16Dot && bf16_dot && operands.q.dtype == DType::kBF16;
  const char* err = backward_common(s, parallel, true, words, &handle);
  if (!err) {
    if constexpr (kHasBf16Dot) {
      if (words)
        run_backward<uint32_t>(s, parallel);
      else
        run_backward<float>(s, parallel);
    } else {
      run_backward<float>(s, parallel);
    }
    if (s.fail) err = kOom;
  }
  scratch_give(handle);
  return err;
}

const char* attention_bias_grad(const AttentionProblem& problem, const BiasGradOperands& operands,
                                const ParallelFor& parallel) {
  BwdState s;
  memset(&s, 0, sizeof(s));
  make_geo(problem, s.g);
  const Geo& g = s.g;
  s.q = &operands.q;
  s.k = &operands.k;
  s.v = &operands.v;
  s.o = &operands.o;
  s.d_o = &operands.d_o;
  s.lse = operands.lse;
  s.gop = &operands;
  void* handle = nullptr;
  const char* err = backward_common(s, parallel, false, false, &handle);
  if (!err) {
    BiasGradState bg;
    for (int d = 0; d < 4; ++d) bg.db[d] = problem.bias.dims[d];
    bg.s = &s;
    bg.out = operands.dbias;
    // Split over T blocks when dbias keeps the T axis, else over S blocks
    // when it keeps the S axis; never both (items stay coarse).
    bg.items_t = bg.db[2] != 1 ? g.ntq : 1;
    bg.items_s = (bg.db[2] == 1 && bg.db[3] != 1) ? g.ntk : 1;
    int64_t count = bg.db[0] * bg.db[1] * bg.items_t * bg.items_s;
    run_items<BiasGradState, bias_grad_item>(parallel, count, bg);
    if (s.fail) err = kOom;
  }
  scratch_give(handle);
  return err;
}

// Floating-point operations done by `iters` rounds of 12 independent vector
// FMAs (enough in flight to fill the FMA units): fma_peak_gflops' loop. An
// empty asm "reads and writes" the 12 accumulators in vector registers after
// every round, so the compiler keeps them there and can neither fold nor
// shorten the loop.
double fma_loop(int64_t iters) {
  vf r0 = bc(1.000f), r1 = bc(1.001f), r2 = bc(1.002f), r3 = bc(1.003f), r4 = bc(1.004f),
     r5 = bc(1.005f), r6 = bc(1.006f), r7 = bc(1.007f), r8 = bc(1.008f), r9 = bc(1.009f),
     r10 = bc(1.010f), r11 = bc(1.011f);
  const vf m = bc(0.9999999f), a = bc(1e-7f);
  for (int64_t it = 0; it < iters; ++it) {
    r0 = r0 * m + a; r1 = r1 * m + a; r2 = r2 * m + a; r3 = r3 * m + a;
    r4 = r4 * m + a; r5 = r5 * m + a; r6 = r6 * m + a; r7 = r7 * m + a;
    r8 = r8 * m + a; r9 = r9 * m + a; r10 = r10 * m + a; r11 = r11 * m + a;
#if defined(__x86_64__)
    __asm__ volatile("" : "+x"(r0), "+x"(r1), "+x"(r2), "+x"(r3), "+x"(r4), "+x"(r5),
                     "+x"(r6), "+x"(r7), "+x"(r8), "+x"(r9), "+x"(r10), "+x"(r11));
#elif defined(__aarch64__)
    __asm__ volatile("" : "+w"(r0), "+w"(r1), "+w"(r2), "+w"(r3), "+w"(r4), "+w"(r5),
                     "+w"(r6), "+w"(r7), "+w"(r8), "+w"(r9), "+w"(r10), "+w"(r11));
#endif
  }
  volatile float sink = hsum(r0 + r1 + r2 + r3 + r4 + r5 + r6 + r7 + r8 + r9 + r10 + r11);
  (void)sink;
  return double(iters) * 12 * W * 2;
}

// Floating-point operations done by `iters` rounds of 12 independent bf16
// pair dot products (each lane adds two products: 4 FLOPs): the bf16 peak's
// loop, like fma_loop. Only the native vdpbf16ps kernels have it; elsewhere
// it does nothing and returns 0 (there is no bf16 dot-product peak).
double bf16_dot_loop(int64_t iters) {
#if defined(FATRAIN_BF16_DOT) && FATRAIN_BF16_DOT == 1
  using L = Lanes<uint32_t>;
  vf r0 = bc(1.0f), r1 = bc(1.1f), r2 = bc(1.2f), r3 = bc(1.3f), r4 = bc(1.4f), r5 = bc(1.5f),
     r6 = bc(1.6f), r7 = bc(1.7f), r8 = bc(1.8f), r9 = bc(1.9f), r10 = bc(2.0f), r11 = bc(2.1f);
  const L::V a = L::bcast(bf16_pair(1e-3f, -1e-3f)), b = L::bcast(bf16_pair(0.5f, 0.25f));
  for (int64_t it = 0; it < iters; ++it) {
    r0 = L::madd(r0, a, b); r1 = L::madd(r1, a, b); r2 = L::madd(r2, a, b);
    r3 = L::madd(r3, a, b); r4 = L::madd(r4, a, b); r5 = L::madd(r5, a, b);
    r6 = L::madd(r6, a, b); r7 = L::madd(r7, a, b); r8 = L::madd(r8, a, b);
    r9 = L::madd(r9, a, b); r10 = L::madd(r10, a, b); r11 = L::madd(r11, a, b);
    __asm__ volatile("" : "+x"(r0), "+x"(r1), "+x"(r2), "+x"(r3), "+x"(r4), "+x"(r5),
                     "+x"(r6), "+x"(r7), "+x"(r8), "+x"(r9), "+x"(r10), "+x"(r11));
  }
  volatile float sink = hsum(r0 + r1 + r2 + r3 + r4 + r5 + r6 + r7 + r8 + r9 + r10 + r11);
  (void)sink;
  return double(iters) * 12 * W * 4;
#else
  (void)iters;
  return 0.0;
#endif
}

// The vector instructions this translation unit was compiled for, from the
// compiler's own macros (what `baseline` means on a given target).
const char* vector_isa() {
#if defined(__AVX512F__)
  return "avx512";
#elif defined(__AVX2__)
  return "avx2";
#elif defined(__SSE2__)
  return "sse2";
#elif defined(__aarch64__) && defined(__ARM_NEON)
  return "neon";
#else
  return "scalar";
#endif
}

}  // namespace fatrain::cpu::FATRAIN_ISA
