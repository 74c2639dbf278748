// Times the CPU kernels' tile products on their own, one thread, on operands
// that stay in the L1/L2 caches: the micro-kernel's speed without the
// softmax, the packing or the memory traffic of a whole pass, against this
// core's FMA peak, and, where the CPU has avx512_bf16, the bf16 pair
// products (vdpbf16ps, operands as bf16 pair words) against its bf16
// dot-product peak, and where the kernels run AMX tiles (avx512_amx), the
// AMX forward's products against the AMX bf16 peak. Built by
// `build_and_test.sh tiles` for the AVX-512 kernels, or with
// FATRAIN_TILES_ISA=avx2 for the AVX2 ones (FATRAIN_ISA = tile_bench, its own
// namespace).
//
// Shapes of one 64 x 64 tile pair at head dim D (64, 128), in f32 elements
// (the pair products sum over half as many pair words):
//   score:  C[64 x 64]  = A[64 x D] . B[D x 64]   (S = K Qᵀ, dP = dO Vᵀ; chunked sums)
//   acc:    C[64 x D]  += A[64 x 64] . B[64 x D]  (dV += Pᵀ dO, dK += dSᵀ Q)
//   acc_at: C[D x 64]  += A[D x 64] . B[64 x 64], A read by columns
//                                                 (Oᵀ += Vᵀ Pᵀ, dQ += dS K)
// The AMX forward's, in bf16 pairs as it packs them:
//   score:  C[64 x 64]  = A[64 x D] . B[D x 64]   per key tile (Sᵀ = K Qᵀ)
//   acc:    C[D x 64]  += A[D x 1024] . B[1024 x 64] over a group of
//           kFwdAmxKeyTiles key tiles (Oᵀ += Vᵀ Pᵀ)
//
// Built with FATRAIN_TILES_ONEDNN (`build_and_test.sh tiles` with
// FATRAIN_TILES_ONEDNN=1, against Debian's libdnnl-dev), each row also times
// oneDNN's matmul primitive on the same shapes, f32 or bf16 operands with an
// f32 C (+= through a sum post-op), on one thread, and prints its
// implementation (brg: its brgemm kernels). oneDNN takes plain row-major
// operands (acc_at's A column-major), not the kernels' packed ones; the AMX
// score row calls it once per key tile, as the forward runs the product, and
// once for the group's 1,024 x 64 scores in one call.
#define FATRAIN_ISA tile_bench
#if defined(__AVX512BF16__)
#define FATRAIN_BF16_DOT 1
#endif
// -mamx-tile -mamx-bf16 (GCC's macros, and clang 14's spelling).
#if (defined(__AMX_TILE__) || defined(__AMXTILE__)) && \
    (defined(__AMX_BF16__) || defined(__AMXBF16__))
#define FATRAIN_AMX 1
#endif
#include "../attention_cpu_impl.h"

#include <chrono>
#include <cmath>
#include <cstdio>
#if defined(FATRAIN_TILES_ONEDNN)
#include <string>
#include <unordered_map>

#include <oneapi/dnnl/dnnl.hpp>
#endif

namespace fatrain::cpu::tile_bench {
namespace {

// The seconds of the best of 5 runs of run(), and in *peak the best peak
// read_peak() gives before each run (the machine's speed moves; both are best
// cases).
template <class ReadPeak, class Run>
double best_of_5(ReadPeak read_peak, double* peak, Run run) {
  double best = 1e30;
  *peak = 0;
  for (int t = 0; t < 5; ++t) {
    *peak = fmax(*peak, read_peak());
    const auto t0 = std::chrono::steady_clock::now();
    run();
    best = fmin(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  return best;
}

// GFLOP/s of the best of 5 runs of `reps` products of one kind, and in *peak
// the best single-core peak read before each run (FMA for float, bf16 dot
// product for pair words).
template <class Pk>
double time_product(int kind, int64_t D, double* peak) {
  constexpr int64_t kP = Lanes<Pk>::kPair;
  const int64_t ld = D % 128 == 0 ? D + 16 : D;  // the kernels' padded row stride
  Pk* A = static_cast<Pk*>(static_cast<void*>(falloc(64 * 272)));
  Pk* B = static_cast<Pk*>(static_cast<void*>(falloc(272 * 64)));
  float* C = falloc(64 * 272);
  for (int64_t i = 0; i < 64 * 272; ++i) {
    if constexpr (kP == 1) {
      A[i] = 0.01f * float(i % 7);
      B[i] = 0.01f * float(i % 5);
    } else {
      A[i] = bf16_pair(0.01f * float(i % 7), 0.02f);
      B[i] = bf16_pair(0.01f * float(i % 5), 0.03f);
    }
    C[i] = 0.0f;
  }
  const int reps = 4000;
  const double best = best_of_5(
      [] { return kP == 1 ? fma_peak_gflops(1, 0.05) : bf16_dot_peak_gflops(1, 0.05); }, peak,
      [&] {
        for (int r = 0; r < reps; ++r) {
          if (kind == 0)
            score_gemm<Pk>(64, 64, D / kP, A, ld / kP, B, 64, C, 64);
          else if (kind == 1)
            acc_gemm<Pk>(64, D, 64 / kP, A, 64 / kP, B, ld, C, ld);
          else
            acc_gemm_at<Pk>(D, 64, 64 / kP, A, ld, B, 64, C, 64);
        }
      });
  volatile float sink = C[0];
  (void)sink;
  free(A);
  free(B);
  free(C);
  return 2.0 * 64 * 64 * double(D) * reps / best / 1e9;
}

#if defined(FATRAIN_AMX)
// GFLOP/s of the best of 5 runs of the AMX forward's product `kind` (0: the
// scores of kFwdAmxKeyTiles key tiles, 1: Oᵀ += Vᵀ Pᵀ over them) at head dim
// D, their operands laid out as the forward packs them; in *peak the best
// one-core AMX peak read before each run.
double time_amx_product(int kind, int64_t D, double* peak) {
  constexpr int64_t kTiles = kFwdAmxKeyTiles, kKeys = kTiles * BK;
  const int64_t Da = round_up(D, 32);
  uint32_t* K = reinterpret_cast<uint32_t*>(falloc(kKeys * Da / 2));  // key rows
  uint32_t* Vt = reinterpret_cast<uint32_t*>(falloc(kKeys * Da / 2));  // per tile [Da][BK]
  uint32_t* Qt = reinterpret_cast<uint32_t*>(falloc(Da / 2 * BQ));     // [Da / 2][BQ]
  uint32_t* Pt = reinterpret_cast<uint32_t*>(falloc(kKeys / 2 * BQ));  // [keys / 2][BQ]
  float* S = falloc(kKeys * BQ);
  float* Ot = falloc(Da * BQ);
  for (int64_t i = 0; i < kKeys * Da / 2; ++i) K[i] = Vt[i] = bf16_pair(0.01f * float(i % 7), 0.02f);
  for (int64_t i = 0; i < Da / 2 * BQ; ++i) Qt[i] = bf16_pair(0.01f * float(i % 5), 0.03f);
  for (int64_t i = 0; i < kKeys / 2 * BQ; ++i) Pt[i] = bf16_pair(0.01f * float(i % 3), 0.04f);
  for (int64_t i = 0; i < Da * BQ; ++i) Ot[i] = 0.0f;
  const uint32_t* as[kKeys / 32];
  const uint32_t* bs[kKeys / 32];
  for (int64_t k = 0; k < kKeys / 32; ++k) {
    as[k] = Vt + k / 2 * Da * BK / 2 + 16 * (k % 2);
    bs[k] = Pt + 16 * k * BQ;
  }
  const int reps = 200;
  // Each run configures the tiles itself: reading the peak releases them.
  const double best = best_of_5([] { return amx_bf16_peak_gflops(1, 0.05); }, peak, [&] {
    amx_begin();
    for (int r = 0; r < reps; ++r) {
      if (kind == 0)
        for (int64_t kt = 0; kt < kTiles; ++kt)
          amx_gemm(BK / 32, BQ / 32, Da / 32, K + kt * BK * Da / 2, Da / 2, Qt, BQ,
                   S + kt * BK * BQ, BQ);
      else
        amx_acc_steps(Da / 32, BQ / 32, kKeys / 32, as, BK / 2, bs, BQ, Ot, BQ);
    }
    amx_end();
  });
  volatile float sink = S[0] + Ot[0];
  (void)sink;
  free(K);
  free(Vt);
  free(Qt);
  free(Pt);
  free(S);
  free(Ot);
  return 2.0 * BQ * double(kKeys) * double(D) * reps / best / 1e9;
}
#endif

#if defined(FATRAIN_TILES_ONEDNN)
// GFLOP/s of the best of 5 runs of `reps` x `calls` calls of oneDNN's matmul
// C[M x N] (+= with acc) = A[M x K] . B[K x N], A row-major or (a_by_columns)
// column-major, f32 or bf16 operands (small values) and an f32 C; *impl:
// oneDNN's name for the implementation it chose.
double time_onednn(bool bf16, int64_t M, int64_t N, int64_t K, bool acc, bool a_by_columns,
                   int calls, int reps, std::string* impl) {
  using dnnl::memory;
  const memory::data_type in = bf16 ? memory::data_type::bf16 : memory::data_type::f32;
  dnnl::engine eng(dnnl::engine::kind::cpu, 0);
  dnnl::stream stream(eng);
  const memory::desc a({M, K}, in, a_by_columns ? memory::format_tag::ba : memory::format_tag::ab);
  const memory::desc b({K, N}, in, memory::format_tag::ab);
  const memory::desc c({M, N}, memory::data_type::f32, memory::format_tag::ab);
  dnnl::primitive_attr attr;
  if (acc) {
    dnnl::post_ops ops;
    ops.append_sum(1.0f);
    attr.set_post_ops(ops);
  }
#if DNNL_VERSION_MAJOR >= 3
  const dnnl::matmul::primitive_desc pd(eng, a, b, c, attr);
#else
  const dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(a, b, c), attr, eng);
#endif
  *impl = pd.impl_info_str();
  const dnnl::matmul product(pd);
  memory A(a, eng), B(b, eng), C(c, eng);
  auto fill = [&](memory& m, int64_t n, int mod) {
    for (int64_t i = 0; i < n; ++i) {
      const float x = 0.01f * float(i % mod);
      if (bf16)
        static_cast<uint16_t*>(m.get_data_handle())[i] = f32_to_bf16(x);
      else
        static_cast<float*>(m.get_data_handle())[i] = x;
    }
  };
  fill(A, M * K, 7);
  fill(B, K * N, 5);
  for (int64_t i = 0; i < M * N; ++i) static_cast<float*>(C.get_data_handle())[i] = 0.0f;
  const std::unordered_map<int, memory> args{
      {DNNL_ARG_SRC, A}, {DNNL_ARG_WEIGHTS, B}, {DNNL_ARG_DST, C}};
  double peak = 0;
  const double best = best_of_5([] { return 0.0; }, &peak, [&] {
    for (int r = 0; r < reps; ++r)
      for (int k = 0; k < calls; ++k) product.execute(stream, args);
    stream.wait();
  });
  return 2.0 * double(M) * double(N) * double(K) * calls * reps / best / 1e9;
}

// The oneDNN columns of a row: its GFLOP/s (time_onednn), ours over its, and
// its implementation.
void print_onednn(double ours, bool bf16, int64_t M, int64_t N, int64_t K, bool acc,
                  bool a_by_columns, int calls, int reps) {
  std::string impl;
  const double gf = time_onednn(bf16, M, N, K, acc, a_by_columns, calls, reps, &impl);
  std::printf("  %9.1f %7.2f  %s", gf, ours / gf, impl.c_str());
}
#endif

}  // namespace
}  // namespace fatrain::cpu::tile_bench

int main() {
  using namespace fatrain::cpu::tile_bench;
  const char* names[] = {"score", "acc", "acc_at"};
  std::printf("tile products, one thread (best of 5 x 4000, each against the best peak read between its runs)\n");
#if defined(FATRAIN_TILES_ONEDNN)
  std::printf("  %-7s %-5s %4s %9s %7s  %9s %7s  %s\n", "product", "dtype", "D", "GFLOP/s", "%peak",
              "oneDNN", "ours/it", "oneDNN's implementation");
#else
  std::printf("  %-7s %-5s %4s %9s %7s\n", "product", "dtype", "D", "GFLOP/s", "%peak");
#endif
  // The pair products where the kernels run them (bf16_dot_peak_gflops is 0
  // elsewhere).
#if defined(__AVX512BF16__)
  const bool pairs = fatrain::cpu::bf16_dot_peak_gflops(1, 0.01) > 0;
#else
  const bool pairs = false;
#endif
  for (int pk = 0; pk < (pairs ? 2 : 1); ++pk)
    for (int64_t D = 64; D <= 128; D *= 2) {
      for (int kind = 0; kind < 3; ++kind) {
        double peak = 0;
        const double gf = pk == 0 ? time_product<float>(kind, D, &peak)
                                  : time_product<uint32_t>(kind, D, &peak);
        std::printf("  %-7s %-5s %4lld %9.1f %6.0f%%", names[kind], pk == 0 ? "f32" : "bf16",
                    (long long)D, gf, 100 * gf / peak);
#if defined(FATRAIN_TILES_ONEDNN)
        // score: [64 x D] . [D x 64]; acc: [64 x 64] . [64 x D]; acc_at:
        // [D x 64] (by columns) . [64 x 64].
        const int64_t M = kind == 2 ? D : 64, N = kind == 1 ? D : 64, K = kind == 0 ? D : 64;
        print_onednn(gf, pk == 1, M, N, K, kind > 0, kind == 2, 1, 4000);
#endif
        std::printf("\n");
      }
    }
#if defined(FATRAIN_AMX)
  // The AMX products where the kernels run them (amx_bf16_peak_gflops is 0
  // elsewhere, and asking for it first grants this process AMX tile data).
  if (fatrain::cpu::amx_bf16_peak_gflops(1, 0.01) > 0)
    for (int64_t D = 64; D <= 128; D *= 2)
      for (int kind = 0; kind < 2; ++kind) {
        double peak = 0;
        const double gf = time_amx_product(kind, D, &peak);
        std::printf("  %-7s %-5s %4lld %9.1f %6.0f%%", names[kind], "amx", (long long)D, gf,
                    100 * gf / peak);
#if defined(FATRAIN_TILES_ONEDNN)
        constexpr int64_t kKeys = kFwdAmxKeyTiles * BK;
        if (kind == 0) {
          print_onednn(gf, true, BK, BQ, D, false, false, kFwdAmxKeyTiles, 200);
          std::printf("\n  %-7s %-5s %4lld %9s %7s", "", "", (long long)D, "", "");
          print_onednn(gf, true, kKeys, BQ, D, false, false, 1, 200);
        } else {
          print_onednn(gf, true, D, BQ, kKeys, true, false, 1, 200);
        }
#endif
        std::printf("\n");
      }
#endif
  return 0;
}
