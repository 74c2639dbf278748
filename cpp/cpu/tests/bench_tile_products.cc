// Times the CPU kernels' tile products on their own, one thread, on operands
// that stay in the L1/L2 caches: the micro-kernel's speed without the
// softmax, the packing or the memory traffic of a whole pass, against this
// core's FMA peak. Built by `build_and_test.sh tiles` for the AVX-512
// kernels, or with FATRAIN_TILES_ISA=avx2 for the AVX2 ones (FATRAIN_ISA =
// tile_bench, its own namespace).
//
// Shapes of one 64 x 64 tile pair at head dim D (64, 128):
//   score:  C[64 x 64]  = A[64 x D] . B[D x 64]   (S = K Qᵀ, dP = dO Vᵀ; chunked sums)
//   acc:    C[64 x D]  += A[64 x 64] . B[64 x D]  (dV += Pᵀ dO, dK += dSᵀ Q)
//   acc_at: C[D x 64]  += A[D x 64] . B[64 x 64], A read by columns
//                                                 (Oᵀ += Vᵀ Pᵀ, dQ += dS K)
#define FATRAIN_ISA tile_bench
#if defined(__AVX512BF16__)
#define FATRAIN_BF16_DOT 1
#endif
#include "../attention_cpu_impl.h"

#include <chrono>
#include <cmath>
#include <cstdio>

namespace fatrain::cpu::tile_bench {
namespace {

// GFLOP/s of the best of 5 runs of `reps` products of one kind, and in *peak
// the best single-core FMA peak read before each run (the machine's speed
// moves; both are best cases).
double time_product(int kind, int64_t D, double* peak) {
  const int64_t ld = D % 128 == 0 ? D + 16 : D;  // the kernels' padded row stride
  float* A = falloc(64 * 272);
  float* B = falloc(272 * 64);
  float* C = falloc(64 * 272);
  for (int64_t i = 0; i < 64 * 272; ++i) {
    A[i] = 0.01f * float(i % 7);
    B[i] = 0.01f * float(i % 5);
    C[i] = 0.0f;
  }
  const int reps = 4000;
  double best = 1e30;
  *peak = 0;
  for (int t = 0; t < 5; ++t) {
    *peak = fmax(*peak, fma_peak_gflops(1, 0.05));
    auto t0 = std::chrono::steady_clock::now();
    for (int r = 0; r < reps; ++r) {
      if (kind == 0)
        score_gemm<float>(64, 64, D, A, ld, B, 64, C, 64);
      else if (kind == 1)
        acc_gemm<float>(64, D, 64, A, 64, B, ld, C, ld);
      else
        acc_gemm_at<float>(D, 64, 64, A, ld, B, 64, C, 64);
    }
    best = fmin(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  volatile float sink = C[0];
  (void)sink;
  free(A);
  free(B);
  free(C);
  return 2.0 * 64 * 64 * double(D) * reps / best / 1e9;
}

}  // namespace
}  // namespace fatrain::cpu::tile_bench

int main() {
  using fatrain::cpu::tile_bench::time_product;
  const char* names[] = {"score", "acc", "acc_at"};
  std::printf("tile products, float32, one thread (best of 5 x 4000, each against the best FMA peak read between its runs)\n");
  std::printf("  %-7s %4s %9s %7s\n", "product", "D", "GFLOP/s", "%peak");
  for (int64_t D = 64; D <= 128; D *= 2) {
    for (int kind = 0; kind < 3; ++kind) {
      double peak = 0;
      const double gf = time_product(kind, D, &peak);
      std::printf("  %-7s %4lld %9.1f %6.0f%%\n", names[kind], (long long)D, gf, 100 * gf / peak);
    }
  }
  return 0;
}
