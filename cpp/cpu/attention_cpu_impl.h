// FlashAttention-2 training kernels for the CPU: the one implementation that
// is compiled once per instruction set.
//
// Each ISA translation unit (attention_cpu_isa_{baseline,avx2,avx512,...}.cc)
// defines FATRAIN_ISA and includes this header once, so everything below lands
// in the distinct namespace fatrain::cpu::<isa>. All helpers live in an
// anonymous namespace (internal linkage), and the code uses no standard
// library templates or inline library functions: nothing compiled with wide
// vector instructions can be merged (COMDAT) into another ISA's code. Only the
// entry points at the bottom have external linkage.
//
// The parts, one job each, in cpp/cpu/kernels/ (each opens the same
// namespaces, so they can only be included from here):
//  * vectors.h: vector types and register blocking per ISA, the bf16 pair
//    operand format (Lanes), exp2, element and row conversions.
//  * scratch.h: per-item buffers and the packed-operand scratch block.
//  * tile_products.h: every tile GEMM is C[M x N] (+)= A[M x K] . B[K x N]
//    with B row-major and A by rows or by columns, one register-blocked
//    micro-kernel (kMR rows x kNR vectors of W floats) written with GCC
//    vector extensions, so the same source becomes AVX-512, AVX2+FMA, SSE2
//    or NEON code depending on the TU's flags.
//  * work_items.h: running a pass's items on the caller's ParallelFor.
//  * visibility.h: geometry, lengths, causality, windows, segment-id tile
//    ranges (tiles whose id ranges are disjoint are skipped in every pass;
//    inside a visited tile ids are compared per element), masked scores.
//  * packing.h: operands packed per head into float32 rows, transposed tiles
//    or bf16 pairs, converting bf16/f16 once; padding is zero.
//  * forward.h: items (b, n, q_tile), key-major tiles, online softmax in
//    base 2 with the statistics as vectors of queries.
//  * backward.h: Drow / base-2 L pre-pass, then one fused pass per (b, kv
//    head) or pass 1 (dQ, q tiles outer) and pass 2 (dK/dV, kv tiles outer),
//    GQA group and q tiles looped in a fixed order. No atomics on data:
//    bitwise deterministic.
//  * bias_grad.h: items own disjoint slices of dbias and loop over the
//    contributing (b, n) in a fixed order.
// Below: the entry points and the peak-rate loops.

#ifndef FATRAIN_ISA
#error "define FATRAIN_ISA before including attention_cpu_impl.h"
#endif

#include <cstdint>
#include <cstring>

#include "kernels/bias_grad.h"
#include "kernels/backward.h"
#include "kernels/forward.h"
#include "kernels/tile_products.h"
#include "kernels/vectors.h"

namespace fatrain::cpu::FATRAIN_ISA {

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
  // K's and V's space each (see FwdState; the AMX packs' rows may be wider).
  const int64_t packsz =
      g.B * g.KH * g.Sp * (kAmx && s.words ? imax(g.Dr, fwd_amx_dim(g)) : g.Dr);
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
    // Key-major items where the packs allow (see fwd_pack_keys).
    const int64_t key_items = g.B * fwd_pack_key_chunks(g);
    if (!s.words) {
      run_items<FwdState, fwd_pack_keys>(parallel, key_items, s);
    } else {
#if defined(FATRAIN_AMX)
      if (fwd_amx_packs_from_bf16(s))
        run_items<FwdState, fwd_amx_pack_keys>(parallel, key_items, s);
      else
#endif
        run_items<FwdState, fwd_pack_words>(parallel, g.B * g.KH, s);
    }
    if (s.fail) err = kOom;
  }
  if (!err) {
    s.qtiles = forward_query_tiles(g, parallel.num_threads);
    const int64_t items = forward_items(g, s.qtiles);
    if constexpr (kHasBf16Dot) {
      if (s.words)
        run_items<FwdState, fwd_item<uint32_t>>(parallel, items, s);
      else
        run_items<FwdState, fwd_item<float>>(parallel, items, s);
    } else {
      run_items<FwdState, fwd_item<float>>(parallel, items, s);
    }
    if (s.fail) err = kOom;
  }
  scratch_give(handle);
  return err;
}

// The backward in operand format Pk (see Lanes), fused or in two passes
// (backward_common packed that form's operands).
template <class Pk>
static void run_backward(BwdState& s, const ParallelFor& parallel, bool fused) {
  const Geo& g = s.g;
  if (fused) {
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
  const bool fused = use_fused_backward(s.g, parallel.num_threads);
  const char* err =
      backward_common(s, parallel, fused ? BwdForms::kFused : BwdForms::kTwoPass, words, &handle);
  if (!err) {
    if constexpr (kHasBf16Dot) {
      if (words)
        run_backward<uint32_t>(s, parallel, fused);
      else
        run_backward<float>(s, parallel, fused);
    } else {
      run_backward<float>(s, parallel, fused);
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
  const char* err = backward_common(s, parallel, BwdForms::kPass1, false, &handle);
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

// Floating-point operations done by `iters` rounds of 4 independent
// TDPBF16PS (each C tile [16][16] f32 += A [16][32 bf16] . B, 16 x 16 x 32 x 2
// FLOPs) on tiles that stay in the tile registers: the AMX bf16 peak's loop,
// like fma_loop. Only the avx512_amx kernels have it; elsewhere it does
// nothing and returns 0.
double amx_loop(int64_t iters) {
#if defined(FATRAIN_AMX)
  alignas(64) uint16_t ab[16 * 32];
  for (int i = 0; i < 16 * 32; ++i) ab[i] = 0x3c00;  // bf16 2^-7
  alignas(64) float c[16 * 16];
  amx_begin();
  _tile_loadd(4, ab, 64);
  _tile_loadd(5, ab, 64);
  _tile_loadd(6, ab, 64);
  _tile_loadd(7, ab, 64);
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t it = 0; it < iters; ++it) {
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
  _tile_stored(0, c, 64);
  amx_end();
  volatile float sink = c[0];
  (void)sink;
  return double(iters) * 4 * 16 * 16 * 32 * 2;
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
