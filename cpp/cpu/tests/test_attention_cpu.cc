// Standalone test and benchmark of the CPU attention kernels.
//
//   test_attention_cpu [NAME...]  run the correctness suite (the cases whose
//                                 names contain one of the NAMEs) on the ISA chosen
//                                 by selected_isa() (set JAX_FATRAIN_CPU_ISA to
//                                 force a lower one); with
//                                 FATRAIN_EXPECT_VECTOR_ISA set, fail unless
//                                 the kernels use those vector instructions
//   test_attention_cpu bench [threads] [reps]
//                                 time causal fwd/bwd at B=1 N=8 T=S=2048 D=64
//
// The cases, the double-precision reference and the comparisons are those of
// cpp/testing/attention_check.h, which the CUDA kernels' check shares; here
// the backward and bias gradient must also be bit for bit the same serially
// and on 4 threads.
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
#include "testing/attention_check.h"

using namespace fatrain::cpu;
using namespace fatrain::testing;

// ---------------------------------------------------------------------------
// A simple multithreaded ParallelFor: threads claim items dynamically.
// ---------------------------------------------------------------------------
struct ThreadedFor {
  int threads;
  static void run(void* self, int64_t count, void (*body)(void*, int64_t), void* ctx) {
    int nt = static_cast<ThreadedFor*>(self)->threads;
    std::atomic<int64_t> next{0};
    auto work = [&]() {
      for (;;) {
        int64_t i = next.fetch_add(1);
        if (i >= count) break;
        body(ctx, i);
      }
    };
    std::vector<std::thread> pool;
    for (int t = 1; t < nt; ++t) pool.emplace_back(work);
    work();
    for (auto& th : pool) th.join();
  }
  ParallelFor pf() {
    ParallelFor p;
    p.run = &ThreadedFor::run;
    p.self = this;
    p.num_threads = threads;
    return p;
  }
};


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
  const char* forward(const AttentionProblem& p, const ForwardOperands& ops) override {
    return attention_forward(p, ops, threaded_.pf());
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
static double cpu_seconds() {
  timespec ts;
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return ts.tv_sec + 1e-9 * ts.tv_nsec;
}

static void bench(int threads, int reps) {
  ThreadedFor tf{threads};
  ParallelFor pf = tf.pf();
  const int64_t B = 1, N = 8, T = 2048, D = 64;
  std::printf("bench: isa=%s threads=%d B=%lld N=%lld T=S=%lld D=%lld causal\n", selected_isa(),
              threads, (long long)B, (long long)N, (long long)T, (long long)D);
  for (DType dt : {DType::kF32, DType::kBF16}) {
    std::mt19937_64 rng(1);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    Seq q(dt, B, T, N, D, false), k(dt, B, T, N, D, false), v(dt, B, T, N, D, false);
    Seq o(dt, B, T, N, D, false), dO(dt, B, T, N, D, false), dq(dt, B, T, N, D, false),
        dk(dt, B, T, N, D, false), dv(dt, B, T, N, D, false);
    for (Seq* s : {&q, &k, &v, &dO})
      for (int64_t i = 0; i < s->buf.n; ++i) s->buf.set(i, nd(rng));
    std::vector<float> lse(B * N * T);
    AttentionProblem p;
    p.batch = B; p.q_heads = N; p.kv_heads = N; p.q_len = T; p.kv_len = T; p.head_dim = D;
    p.scale = 1.0f / 8.0f;
    p.causal = true;
    ForwardOperands fo;
    fo.q = q.view(); fo.k = k.view(); fo.v = v.view(); fo.o = o.view(); fo.lse = lse.data();
    BackwardOperands bo;
    bo.q = q.view(); bo.k = k.view(); bo.v = v.view(); bo.o = o.view(); bo.d_o = dO.view();
    bo.lse = lse.data(); bo.dq = dq.view(); bo.dk = dk.view(); bo.dv = dv.view();
    double best_f = 1e9, best_b = 1e9, best_fb = 1e9, cpu_f = 1e9, cpu_b = 1e9;
    for (int r = 0; r < reps; ++r) {
      double c0 = cpu_seconds();
      auto t0 = std::chrono::steady_clock::now();
      const char* e1 = attention_forward(p, fo, pf);
      auto t1 = std::chrono::steady_clock::now();
      double c1 = cpu_seconds();
      const char* e2 = attention_backward(p, bo, pf);
      auto t2 = std::chrono::steady_clock::now();
      double c2 = cpu_seconds();
      cpu_f = std::min(cpu_f, c1 - c0);
      cpu_b = std::min(cpu_b, c2 - c1);
      if (e1 || e2) {
        std::printf("error: %s\n", e1 ? e1 : e2);
        return;
      }
      double f = std::chrono::duration<double>(t1 - t0).count();
      double b = std::chrono::duration<double>(t2 - t1).count();
      best_f = std::min(best_f, f);
      best_b = std::min(best_b, b);
      best_fb = std::min(best_fb, f + b);
    }
    std::printf("  %-5s fwd %.4f s  bwd %.4f s  fwd+bwd %.4f s (best of %d; process CPU time "
                "fwd %.4f bwd %.4f)\n",
                dname(dt), best_f, best_b, best_fb, reps, cpu_f, cpu_b);
  }
}

int main(int argc, char** argv) {
  if (argc > 1 && std::strcmp(argv[1], "bench") == 0) {
    int threads = argc > 2 ? std::atoi(argv[2]) : 2;
    int reps = argc > 3 ? std::atoi(argv[3]) : 5;
    bench(threads, reps);
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
