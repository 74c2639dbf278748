// Standalone test and benchmark of the CPU attention kernels.
//
//   test_attention_cpu [NAME...]  run the correctness suite (the cases whose
//                                 names contain one of the NAMEs) on the ISA chosen
//                                 by selected_isa() (set JAX_FATRAIN_CPU_ISA to
//                                 force a lower one); with
//                                 FATRAIN_EXPECT_VECTOR_ISA set, fail unless
//                                 the kernels use those vector instructions
//   test_attention_cpu bench [threads] [reps] [T] [ROW]
//                                 time fwd and fwd+bwd at B=1 N=8 T=S=T (2048),
//                                 D=64/128, causal or not, f32 and bf16, against
//                                 the machine's FMA, bf16 dot-product and AMX peaks
//                                 (ROW, e.g. f32-64-causal: that row only); built
//                                 with FATRAIN_PHASE_TIMERS (build_and_test.sh
//                                 phases), also each row's shares of time by phase
//
// The cases, the double-precision reference and the comparisons are those of
// cpp/testing/attention_check.h, which the CUDA kernels' check shares; here
// the forward, backward and bias gradient must also be bit for bit the same
// serially and on 4 threads.
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "../attention_cpu.h"
#include "../phase_timers.h"
#include "bench_problem.h"
#include "threaded_for.h"
#include "testing/attention_check.h"

using namespace fatrain::cpu;
using namespace fatrain::testing;

// ---------------------------------------------------------------------------
// The CPU kernels as a backend of the shared check: run 0 of the backward and
// bias gradient on 4 threads, run 1 serially.
// ---------------------------------------------------------------------------
class CpuBackend : public Backend {
 public:
  Tolerance tolerance(DType d) const override {
    if (d == DType::kF32) return {2e-5, 1e-4, 1e-4, 2e-4};
    if (d == DType::kBF16) return {1.2e-2, 2e-2, 1.8e-2, 3.6e-2};
    return {2e-3, 2e-2, 3e-3, 6e-3};
  }
  int backward_reruns() const override { return 1; }
  // Serially, then on 4 threads: the two must agree bit for bit (the items,
  // and how many query tiles each takes, differ with the thread count).
  const char* forward(const AttentionProblem& p, const ForwardOperands& ops) override {
    const char* err = attention_forward(p, ops, serial_parallel_for());
    if (err) return err;
    const int64_t elements = (p.batch - 1) * ops.o.batch_stride +
                             (p.q_len - 1) * ops.o.seq_stride +
                             (p.q_heads - 1) * ops.o.head_stride + p.head_dim;
    const size_t obytes = size_t(elements) * (ops.o.dtype == DType::kF32 ? 4 : 2);
    const size_t lbytes = size_t(p.batch * p.q_heads * p.q_len) * sizeof(float);
    const char* o = static_cast<const char*>(ops.o.data);
    const char* l = reinterpret_cast<const char*>(ops.lse);
    std::vector<char> serial_o(o, o + obytes), serial_lse(l, l + lbytes);
    err = attention_forward(p, ops, threaded_.pf());
    if (err) return err;
    if (std::memcmp(serial_o.data(), o, obytes) != 0 ||
        std::memcmp(serial_lse.data(), l, lbytes) != 0)
      return "forward: the serial and 4-thread results differ";
    return nullptr;
  }
  const char* backward(const AttentionProblem& p, const BackwardOperands& ops, int run) override {
    return attention_backward(p, ops, run == 0 ? threaded_.pf() : serial_parallel_for());
  }
  const char* bias_grad(const AttentionProblem& p, const BiasGradOperands& ops,
                        int run) override {
    return attention_bias_grad(p, ops, run == 0 ? threaded_.pf() : serial_parallel_for());
  }

 private:
  ThreadedFor threaded_{4};
};

// ---------------------------------------------------------------------------
// Validation of bad problems.
// ---------------------------------------------------------------------------
static void test_validation() {
  AttentionProblem p;
  p.batch = 1; p.q_heads = 4; p.kv_heads = 3; p.q_len = 4; p.kv_len = 4; p.head_dim = 64;
  check(validate_problem(p) != nullptr, "kv_heads not dividing q_heads must be rejected");
  p.kv_heads = 2;
  check(validate_problem(p) == nullptr, "valid problem accepted");
  p.head_dim = 257;
  check(validate_problem(p) != nullptr, "head_dim 257 rejected");
  p.head_dim = 64;
  p.scale = INFINITY;
  check(validate_problem(p) != nullptr, "inf scale rejected");
  p.scale = 1;
  float dummy = 0;
  p.bias.data = &dummy;
  p.bias.dims[2] = 3;
  check(validate_problem(p) != nullptr, "bad bias dim rejected");
  p.bias.dims[2] = 4;
  check(validate_problem(p) == nullptr, "good bias dims accepted");
  ForwardOperands fo;
  check(attention_forward(p, fo, serial_parallel_for()) != nullptr, "null operands rejected");
}

// ---------------------------------------------------------------------------
// Benchmark.
// ---------------------------------------------------------------------------

#if defined(FATRAIN_PHASE_TIMERS)
// Adds the kernels' phase counters to `into` and clears them.
static void take_phase_cycles(uint64_t* into) {
  for (int p = 0; p < kPhaseCount; ++p)
    into[p] += __atomic_exchange_n(&g_phase_cycles[p], uint64_t{0}, __ATOMIC_RELAXED);
}
// One pass's shares of its thread time (packing plus the items, summed over
// threads): the phases inside the items, and the rest of the items (the
// softmax, masking, rounding P and dS to bf16, writing the gradients).
static void print_phase_shares(const char* pass, const uint64_t* c) {
  const double total = double(c[kPhasePack] + c[kPhaseItems]);
  if (total <= 0) return;
  const uint64_t inside = c[kPhaseLoadQ] + c[kPhaseStoreO] + c[kPhaseScoreProducts] +
                          c[kPhaseAccProducts];
  const double rest = c[kPhaseItems] > inside ? double(c[kPhaseItems] - inside) : 0.0;
  auto pct = [&](double x) { return 100.0 * x / total; };
  std::printf("      %s: pack %.0f%%", pass, pct(c[kPhasePack]));
  if (c[kPhaseLoadQ] > 0) std::printf(", read q %.0f%%", pct(c[kPhaseLoadQ]));
  std::printf(", score products %.0f%%, accumulating products %.0f%%, rest of the items %.0f%%",
              pct(c[kPhaseScoreProducts]), pct(c[kPhaseAccProducts]), pct(rest));
  if (c[kPhaseStoreO] > 0) std::printf(", write O and L %.0f%%", pct(c[kPhaseStoreO]));
  std::printf("\n");
}
#endif

// Times forward and forward+backward at B = 1, N = 8, T = S = `T` for D = 64
// and 128, causal and not, float32 and bfloat16, and reports GFLOP/s (the
// FlashAttention convention: forward 4 B N T S D, halved when causal;
// forward+backward 3.5x that) against this machine's peak for the dtype's
// products: the float32 FMA peak, or for bfloat16 the bf16 dot-product peak
// where the kernels run vdpbf16ps and the AMX bf16 peak where they run AMX
// tiles (avx512_amx; at D = 64 and 128 its forward and backward both do).
static void bench(int threads, int reps, int64_t T, const char* only) {
  ThreadedFor tf{threads};
  ParallelFor pf = tf.pf();
  const int64_t B = BenchProblem::kB, N = BenchProblem::kN;
  const double bf16_peak = bf16_dot_peak_gflops(threads, 0.3);
  const double amx_peak = amx_bf16_peak_gflops(threads, 0.3);
  const bool bf16_dot = bf16_peak > 0, amx = amx_peak > 0;
  std::printf("bench: isa=%s threads=%d B=%lld N=%lld T=S=%lld, best of %d; peaks: f32 FMA %.1f, "
              "bf16 dot %.1f, AMX bf16 %.1f GFLOP/s (0: the kernels do not run that "
              "instruction); each row against the best peak measured between its runs (bf16: "
              "the %s peak)\n",
              selected_isa(), threads, (long long)B, (long long)N, (long long)T, reps,
              fma_peak_gflops(threads, 0.3), bf16_peak, amx_peak,
              amx ? "AMX bf16" : bf16_dot ? "bf16 dot-product" : "f32 FMA");
  std::printf("  %-5s %4s %-6s %10s %8s %6s %10s %8s %6s %8s\n", "dtype", "D", "causal", "fwd ms",
              "GFLOP/s", "%peak", "f+b ms", "GFLOP/s", "%peak", "peak");
  for (DType dt : {DType::kF32, DType::kBF16}) {
    auto measure_peak = [&] {
      if (dt == DType::kBF16 && amx) return amx_bf16_peak_gflops(threads, 0.1);
      return dt == DType::kBF16 && bf16_dot ? bf16_dot_peak_gflops(threads, 0.1)
                                            : fma_peak_gflops(threads, 0.1);
    };
    for (int64_t D : {64, 128}) {
      for (bool causal : {false, true}) {
        char name[32];
        std::snprintf(name, sizeof(name), "%s-%lld-%s", dname(dt), (long long)D,
                      causal ? "causal" : "full");
        if (only && std::strcmp(only, name) != 0) continue;
        BenchProblem bp(dt, T, D, causal);
        double best_f = 1e9, best_fb = 1e9, peak = 0;
#if defined(FATRAIN_PHASE_TIMERS)
        uint64_t fwd_phases[kPhaseCount] = {}, bwd_phases[kPhaseCount] = {};
        uint64_t earlier[kPhaseCount] = {};
        take_phase_cycles(earlier);  // clears what the kernels counted before this row
#endif
        for (int r = 0; r < reps; ++r) {
          peak = std::max(peak, measure_peak());
          auto t0 = std::chrono::steady_clock::now();
          const char* e1 = attention_forward(bp.p, bp.fo, pf);
          auto t1 = std::chrono::steady_clock::now();
#if defined(FATRAIN_PHASE_TIMERS)
          take_phase_cycles(fwd_phases);
#endif
          const char* e2 = attention_backward(bp.p, bp.bo, pf);
          auto t2 = std::chrono::steady_clock::now();
#if defined(FATRAIN_PHASE_TIMERS)
          take_phase_cycles(bwd_phases);
#endif
          if (e1 || e2) {
            std::printf("error: %s\n", e1 ? e1 : e2);
            return;
          }
          best_f = std::min(best_f, std::chrono::duration<double>(t1 - t0).count());
          best_fb = std::min(best_fb, std::chrono::duration<double>(t2 - t0).count());
        }
        const double flops = 4.0 * B * N * T * T * D * (causal ? 0.5 : 1.0);
        const double gf = flops / best_f / 1e9, gfb = 3.5 * flops / best_fb / 1e9;
        std::printf("  %-5s %4lld %-6s %10.2f %8.1f %5.0f%% %10.2f %8.1f %5.0f%% %8.1f\n",
                    dname(dt), (long long)D, causal ? "yes" : "no", best_f * 1e3, gf,
                    100 * gf / peak, best_fb * 1e3, gfb, 100 * gfb / peak, peak);
#if defined(FATRAIN_PHASE_TIMERS)
        print_phase_shares("forward ", fwd_phases);
        print_phase_shares("backward", bwd_phases);
#endif
        std::fflush(stdout);
      }
    }
  }
}

int main(int argc, char** argv) {
  if (argc > 1 && std::strcmp(argv[1], "bench") == 0) {
    int threads = argc > 2 ? std::atoi(argv[2]) : 2;
    int reps = argc > 3 ? std::atoi(argv[3]) : 5;
    int64_t T = argc > 4 ? std::atoll(argv[4]) : 2048;
    bench(threads, reps, T, argc > 5 ? argv[5] : nullptr);
    return 0;
  }
  const char* want = std::getenv("JAX_FATRAIN_CPU_ISA");
  std::printf("isa: %s, vector instructions %s (requested %s)\n", selected_isa(),
              selected_vector_isa(), want ? want : "-");
  if (want && std::strcmp(want, selected_isa()) != 0) {
    std::printf("requested ISA not available on this CPU; skipping\n");
    return 0;
  }
  // A cross build run under an emulator names the vector instructions it must
  // have run (tools/arm64_check.sh: neon), so a build that lost them fails.
  const char* want_vector = std::getenv("FATRAIN_EXPECT_VECTOR_ISA");
  if (want_vector && std::strcmp(want_vector, selected_vector_isa()) != 0) {
    std::printf("FAILED: the kernels use %s vector instructions, expected %s\n",
                selected_vector_isa(), want_vector);
    return 1;
  }
  test_validation();
  CpuBackend backend;
  // Arguments, if any, select the cases whose names contain one of them.
  for (const Case& c : standard_cases()) {
    bool selected = argc == 1;
    for (int i = 1; i < argc; ++i) selected = selected || c.name.find(argv[i]) != std::string::npos;
    if (selected) run_case(c, backend);
  }
  if (failures()) {
    std::printf("FAILED: %d check(s)\n", failures());
    return 1;
  }
  std::printf("ALL PASSED\n");
  return 0;
}
