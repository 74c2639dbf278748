// Paired timing of two versions of the CPU kernels in one process: this
// tree's AVX-512 kernels (namespace fatrain::cpu::avx512, from
// attention_cpu_isa_avx512.cc; with FATRAIN_COMPARE_BF16_PAIRS their bf16
// pair path, bfloat16 only, on a CPU with avx512_bf16; with
// FATRAIN_COMPARE_AMX its AMX variant,
// fatrain::cpu::avx512_amx, bfloat16 only; with FATRAIN_COMPARE_AVX2 its
// AVX2 kernels, fatrain::cpu::avx2) against another checkout's,
// compiled from its attention_cpu_impl.h into namespace fatrain::cpu::other
// with the same flags (build_and_test.sh compare). The two run alternately, call after call, and
// the result is the median over rounds of each round's time ratio, so that a
// machine whose speed drifts over seconds (a shared virtual machine) moves
// both sides of every ratio alike. Both checkouts must share
// cpp/cpu/attention_cpu.h's types.
//
//   compare_trees [threads] [rounds] [T] [D] [causal 0/1] [f32|bf16]
//
// B = 1, N = 8, T = S; bf16 runs the products in float32 (the `avx512`
// variant's path), as bf16 pairs with FATRAIN_COMPARE_BF16_PAIRS, or on AMX
// tiles with FATRAIN_COMPARE_AMX. Prints whether the two give bitwise the same
// outputs (O, L, dQ, dK, dV) and per pass (forward, backward) the median times
// and the median, lowest and highest of other / this.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

#include "../attention_cpu.h"
#include "bench_problem.h"
#include "threaded_for.h"
#include "testing/attention_check.h"

namespace fatrain::cpu {
#if defined(FATRAIN_COMPARE_AMX)
namespace avx512_amx {
#elif defined(FATRAIN_COMPARE_AVX2)
namespace avx2 {
#else
namespace avx512 {
#endif
const char* attention_forward(const AttentionProblem&, const ForwardOperands&, const ParallelFor&,
                              bool bf16_dot);
const char* attention_backward(const AttentionProblem&, const BackwardOperands&,
                               const ParallelFor&, bool bf16_dot);
}  // namespace avx512 (avx512_amx, avx2)
namespace other {
const char* attention_forward(const AttentionProblem&, const ForwardOperands&, const ParallelFor&,
                              bool bf16_dot);
const char* attention_backward(const AttentionProblem&, const BackwardOperands&,
                               const ParallelFor&, bool bf16_dot);
}  // namespace other
}  // namespace fatrain::cpu

using namespace fatrain::cpu;
using namespace fatrain::testing;
#if defined(FATRAIN_COMPARE_AMX)
namespace mine = fatrain::cpu::avx512_amx;
constexpr bool kBf16Products = true;  // bf16 problems as bf16 pairs on AMX tiles
constexpr const char* kProducts = "bf16 (AMX)";
#elif defined(FATRAIN_COMPARE_AVX2)
namespace mine = fatrain::cpu::avx2;
constexpr bool kBf16Products = false;  // bf16 problems converted to float32
constexpr const char* kProducts = "bf16 (float32 products)";
#elif defined(FATRAIN_COMPARE_BF16_PAIRS)
namespace mine = fatrain::cpu::avx512;
constexpr bool kBf16Products = true;  // bf16 problems as bf16 pairs on vdpbf16ps
constexpr const char* kProducts = "bf16 (pairs)";
#else
namespace mine = fatrain::cpu::avx512;
constexpr bool kBf16Products = false;  // bf16 problems converted to float32
constexpr const char* kProducts = "bf16 (float32 products)";
#endif

namespace {

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

struct Summary {
  std::vector<double> mine, theirs, ratio;
  void print(const char* pass) const {
    std::printf("  %-8s this %9.2f ms  other %9.2f ms  other/this median %.3f (%.3f-%.3f)\n", pass,
                1e3 * median(mine), 1e3 * median(theirs), median(ratio),
                *std::min_element(ratio.begin(), ratio.end()),
                *std::max_element(ratio.begin(), ratio.end()));
  }
};

}  // namespace

int main(int argc, char** argv) {
  const int threads = argc > 1 ? std::atoi(argv[1]) : 2;
  const int rounds = argc > 2 ? std::atoi(argv[2]) : 12;
  const int64_t T = argc > 3 ? std::atoll(argv[3]) : 2048;
  const int64_t D = argc > 4 ? std::atoll(argv[4]) : 64;
  const bool causal = argc > 5 && std::atoi(argv[5]) != 0;
  const DType dt = argc > 6 && std::strcmp(argv[6], "bf16") == 0 ? DType::kBF16 : DType::kF32;
  if (threads < 1 || rounds < 1 || T < 1 || D < 1 || D > 256) {
    std::fprintf(stderr, "usage: compare_trees [threads] [rounds] [T] [D <= 256] [causal] [f32|bf16]\n");
    return 2;
  }
#if defined(FATRAIN_COMPARE_AMX)
  // selected_isa() asks Linux for the AMX tile state (attention_cpu.cc).
  if (dt != DType::kBF16 || std::strcmp(selected_isa(), "avx512_amx") != 0) {
    std::fprintf(stderr, "compare: the AMX kernels need bf16 and a CPU running avx512_amx (got %s)\n",
                 selected_isa());
    return 2;
  }
#elif defined(FATRAIN_COMPARE_BF16_PAIRS)
  if (dt != DType::kBF16 || !__builtin_cpu_supports("avx512bf16")) {
    std::fprintf(stderr, "compare: the bf16 pair path needs bf16 and a CPU with avx512_bf16\n");
    return 2;
  }
#endif
  ThreadedFor tf{threads};
  const ParallelFor pf = tf.pf();
  BenchProblem bp(dt, T, D, causal);
  const AttentionProblem& p = bp.p;

  // One forward and one backward of one side: their times in f and b.
  auto call = [&](bool theirs, double* f, double* b) {
    const auto t0 = std::chrono::steady_clock::now();
    const char* e1 = theirs ? other::attention_forward(p, bp.fo, pf, kBf16Products)
                            : mine::attention_forward(p, bp.fo, pf, kBf16Products);
    const auto t1 = std::chrono::steady_clock::now();
    const char* e2 = theirs ? other::attention_backward(p, bp.bo, pf, kBf16Products)
                            : mine::attention_backward(p, bp.bo, pf, kBf16Products);
    const auto t2 = std::chrono::steady_clock::now();
    if (e1 || e2) {
      std::fprintf(stderr, "error: %s\n", e1 ? e1 : e2);
      std::exit(1);
    }
    *f = std::chrono::duration<double>(t1 - t0).count();
    *b = std::chrono::duration<double>(t2 - t1).count();
  };
  // The warm-up of both sides, whose outputs are compared bit for bit.
  auto outputs = [&] {
    std::vector<uint8_t> all;
    for (const Seq* x : {&bp.o, &bp.dq, &bp.dk, &bp.dv})
      all.insert(all.end(), x->buf.bytes.begin(), x->buf.bytes.end());
    const uint8_t* l = reinterpret_cast<const uint8_t*>(bp.lse.data());
    all.insert(all.end(), l, l + bp.lse.size() * sizeof(float));
    return all;
  };
  double f, b;
  call(false, &f, &b);
  const std::vector<uint8_t> mine_out = outputs();
  call(true, &f, &b);
  const bool same = mine_out == outputs();
  Summary fwd, bwd;
  for (int r = 0; r < rounds; ++r) {
    double fm, bm, ft, bt;
    if (r % 2) {  // alternate which side goes first
      call(true, &ft, &bt);
      call(false, &fm, &bm);
    } else {
      call(false, &fm, &bm);
      call(true, &ft, &bt);
    }
    fwd.mine.push_back(fm);
    fwd.theirs.push_back(ft);
    fwd.ratio.push_back(ft / fm);
    bwd.mine.push_back(bm);
    bwd.theirs.push_back(bt);
    bwd.ratio.push_back(bt / bm);
  }
  std::printf("compare: threads=%d rounds=%d B=%lld N=%lld T=S=%lld D=%lld causal=%d %s\n", threads,
              rounds, (long long)BenchProblem::kB, (long long)BenchProblem::kN, (long long)T,
              (long long)D, causal ? 1 : 0,
              dt != DType::kBF16 ? "f32" : kProducts);
  std::printf("  outputs (O, L, dQ, dK, dV): %s\n", same ? "bitwise identical" : "differ");
  fwd.print("forward");
  bwd.print("backward");
  return 0;
}
