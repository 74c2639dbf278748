// Validation, ISA dispatch and the public entry points of the CPU kernels.
// Compiled with the baseline flags only; the kernels themselves live in
// attention_cpu_impl.h, compiled once per ISA into fatrain::cpu::<isa>.
//
// ISA choice (made once per process): on x86-64, avx512_amx when the CPU has
// avx512f+bw+vl+dq, amx_tile and amx_bf16 and the kernel grants this process
// AMX tile data (the avx512 kernels, with bf16 products on AMX tiles: the
// forward, and the backward where the head dim is a multiple of 32; see
// amx_permitted), else avx512_bf16 when the CPU has
// avx512f+bw+vl+dq and avx512_bf16 and runs vdpbf16ps at full rate (AMD; see
// bf16_dot_pays) (the avx512 kernels, with bf16 problems multiplied as bf16
// pairs by vdpbf16ps), else avx512, else avx2 when it has
// avx2+fma+f16c, else baseline; other architectures use baseline (NEON on
// arm64). The environment variable JAX_FATRAIN_CPU_ISA selects a different
// variant for testing, but only one the CPU supports: baseline, avx2, avx512,
// avx512_bf16, avx512_amx, or avx2_bf16_emulated (the bf16 pair kernels with
// the dot product emulated on AVX2, so machines without avx512_bf16 test their
// data flow; never chosen otherwise). A value naming an unsupported or unknown
// variant is ignored and the detected choice stays.
#include "attention_cpu.h"
#include "phase_timers.h"

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include <algorithm>
#include <chrono>
#include <initializer_list>
#include <thread>
#include <utility>
#include <vector>

#if defined(__linux__)
#include <sched.h>
#endif
#if defined(__x86_64__)
#include <cpuid.h>
#endif
#if defined(__x86_64__) && defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace fatrain::cpu {

#if defined(FATRAIN_PHASE_TIMERS)
uint64_t g_phase_cycles[kPhaseCount] = {};
#endif

#define FATRAIN_DECLARE_ISA(isa)                                                           \
  namespace isa {                                                                          \
  const char* attention_forward(const AttentionProblem&, const ForwardOperands&,          \
                                const ParallelFor&, bool bf16_dot);                        \
  const char* attention_backward(const AttentionProblem&, const BackwardOperands&,        \
                                 const ParallelFor&, bool bf16_dot);                       \
  const char* attention_bias_grad(const AttentionProblem&, const BiasGradOperands&,       \
                                  const ParallelFor&);                                     \
  double fma_loop(int64_t iters);                                                          \
  double bf16_dot_loop(int64_t iters);                                                     \
  double amx_loop(int64_t iters);                                                          \
  const char* vector_isa();                                                                \
  }
FATRAIN_DECLARE_ISA(baseline)
#if defined(__x86_64__)
FATRAIN_DECLARE_ISA(avx2)
FATRAIN_DECLARE_ISA(avx2_bf16_emulated)
FATRAIN_DECLARE_ISA(avx512)
FATRAIN_DECLARE_ISA(avx512_amx)
#endif
#undef FATRAIN_DECLARE_ISA

namespace {

enum class Isa { kBaseline, kAvx2, kAvx2Bf16Emulated, kAvx512, kAvx512Bf16, kAvx512Amx };

struct IsaName {
  Isa isa;
  const char* name;
};
constexpr IsaName kIsaNames[] = {{Isa::kBaseline, "baseline"},
                                 {Isa::kAvx2, "avx2"},
                                 {Isa::kAvx2Bf16Emulated, "avx2_bf16_emulated"},
                                 {Isa::kAvx512, "avx512"},
                                 {Isa::kAvx512Bf16, "avx512_bf16"},
                                 {Isa::kAvx512Amx, "avx512_amx"}};

// Whether this process may use AMX tile data: Linux enables the tile state
// per process on request (arch_prctl ARCH_REQ_XCOMP_PERM for
// XFEATURE_XTILEDATA); without it the first tile instruction faults. Asked
// once per process. Linux refuses the request while any thread has an
// alternate signal stack too small for the tile state (then the next variant
// runs), and once it is granted refuses such stacks (sigaltstack fails with
// ENOMEM below the AT_MINSIGSTKSZ the kernel reports, about 12 KB).
bool amx_permitted() {
#if defined(__x86_64__) && defined(__linux__)
  constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  static const bool granted = syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  return granted;
#else
  return false;
#endif
}

#if defined(__x86_64__)
// Bit `bit` of CPUID leaf `leaf`, subleaf 0, register `reg` (0-3: EAX, EBX,
// ECX, EDX); false where the CPU lacks the leaf. For the features whose
// __builtin_cpu_supports names not every compiler knows (clang 14 knows
// neither "f16c" nor "amx-tile"): none of them needs more OS support than
// the checks beside them establish (AVX state for F16C; the tile state is
// asked of Linux by amx_permitted).
static bool cpuid_bit(unsigned leaf, int reg, int bit) {
  unsigned r[4] = {0, 0, 0, 0};
  if (!__get_cpuid_count(leaf, 0, &r[0], &r[1], &r[2], &r[3])) return false;
  return (r[reg] >> bit) & 1u;
}
#endif

bool cpu_supports(Isa isa) {
#if defined(__x86_64__)
  __builtin_cpu_init();
  const bool f16c = cpuid_bit(1, 2, 29);
  const bool amx_tile = cpuid_bit(7, 3, 24), amx_bf16 = cpuid_bit(7, 3, 22);
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && f16c;
  const bool avx512 = avx2 && __builtin_cpu_supports("avx512f") &&
                      __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
                      __builtin_cpu_supports("avx512dq");
  switch (isa) {
    case Isa::kBaseline:
      return true;
    case Isa::kAvx2:
    case Isa::kAvx2Bf16Emulated:
      return avx2;
    case Isa::kAvx512:
      return avx512;
    case Isa::kAvx512Bf16:
      return avx512 && __builtin_cpu_supports("avx512bf16");
    case Isa::kAvx512Amx:
      return avx512 && amx_tile && amx_bf16 && amx_permitted();
  }
  return false;
#else
  return isa == Isa::kBaseline;
#endif
}

// Whether vdpbf16ps multiplies faster than float32 FMAs here. AMD's cores
// (Zen 4, Zen 5) issue it at the FMA's rate, so its 4 FLOPs a lane give twice
// the float32 peak; Intel's issue one every two cycles (an Emerald Rapids
// Xeon: 0.5x its float32 FMA rate, `test_attention_cpu bench`), so there
// bf16 problems run faster converted to float32 once while packing.
bool bf16_dot_pays() {
#if defined(__x86_64__)
  __builtin_cpu_init();
  return __builtin_cpu_is("amd");
#else
  return false;
#endif
}

// A variant named by JAX_FATRAIN_CPU_ISA is taken before any other is
// probed, so that naming one other than avx512_amx never asks for the AMX
// permission (which changes the process: see amx_permitted).
Isa detect_isa() {
  if (const char* env = std::getenv("JAX_FATRAIN_CPU_ISA")) {
    for (const IsaName& n : kIsaNames)
      if (std::strcmp(env, n.name) == 0 && cpu_supports(n.isa)) return n.isa;
  }
  Isa best = Isa::kBaseline;
  for (Isa isa : {Isa::kAvx2, Isa::kAvx512, Isa::kAvx512Bf16, Isa::kAvx512Amx})
    if (cpu_supports(isa) && (isa != Isa::kAvx512Bf16 || bf16_dot_pays())) best = isa;
  return best;
}

// Whether the kernels multiply bf16 problems as bf16 pairs (avx512_amx: in its
// own bf16 passes, see attention_forward and attention_backward).
bool bf16_dot(Isa isa) { return isa == Isa::kAvx512Bf16 || isa == Isa::kAvx2Bf16Emulated; }

Isa current_isa() {
  static const Isa isa = detect_isa();
  return isa;
}

thread_local char g_error[256];

const char* fmt_error(const char* fmt, long long a, long long b = 0) {
  std::snprintf(g_error, sizeof(g_error), fmt, a, b);
  return g_error;
}

bool is_float_dtype(DType d) { return d == DType::kF32 || d == DType::kBF16 || d == DType::kF16; }

const char* check_score_tensor(const ScoreTensor& t, const AttentionProblem& p, const char* name,
                               bool is_mask) {
  if (t.data == nullptr) return nullptr;
  if (is_mask ? t.dtype != DType::kBool : !is_float_dtype(t.dtype)) {
    std::snprintf(g_error, sizeof(g_error), "jax_fatrain cpu: %s has an unsupported dtype (%d)",
                  name, static_cast<int>(t.dtype));
    return g_error;
  }
  const int64_t full[4] = {p.batch, p.q_heads, p.q_len, p.kv_len};
  static const char* const axis[4] = {"batch", "heads", "q_len", "kv_len"};
  for (int d = 0; d < 4; ++d) {
    if (t.dims[d] != 1 && t.dims[d] != full[d]) {
      std::snprintf(g_error, sizeof(g_error),
                    "jax_fatrain cpu: %s dim %d (%s) is %lld, expected 1 or %lld", name, d,
                    axis[d], static_cast<long long>(t.dims[d]), static_cast<long long>(full[d]));
      return g_error;
    }
  }
  return nullptr;
}

const char* check_seq(const SeqTensor& t, const char* name, DType want) {
  if (t.data == nullptr) {
    std::snprintf(g_error, sizeof(g_error), "jax_fatrain cpu: %s is null", name);
    return g_error;
  }
  if (t.dtype != want) {
    std::snprintf(g_error, sizeof(g_error),
                  "jax_fatrain cpu: %s dtype (%d) differs from q's dtype (%d)", name,
                  static_cast<int>(t.dtype), static_cast<int>(want));
    return g_error;
  }
  return nullptr;
}

const char* check_q_dtype(const SeqTensor& q) {
  if (!is_float_dtype(q.dtype))
    return fmt_error("jax_fatrain cpu: q has an unsupported dtype (%lld)",
                     static_cast<long long>(q.dtype));
  return nullptr;
}

void serial_run(void*, int64_t count, void (*body)(void*, int64_t), void* context) {
  for (int64_t i = 0; i < count; ++i) body(context, i);
}

}  // namespace

ParallelFor serial_parallel_for() {
  ParallelFor p;
  p.run = serial_run;
  p.self = nullptr;
  p.num_threads = 1;
  return p;
}

const char* validate_problem(const AttentionProblem& p) {
  if (p.batch <= 0) return fmt_error("jax_fatrain cpu: batch must be > 0, got %lld", p.batch);
  if (p.q_heads <= 0) return fmt_error("jax_fatrain cpu: q_heads must be > 0, got %lld", p.q_heads);
  if (p.kv_heads <= 0)
    return fmt_error("jax_fatrain cpu: kv_heads must be > 0, got %lld", p.kv_heads);
  if (p.q_heads % p.kv_heads != 0)
    return fmt_error("jax_fatrain cpu: kv_heads (%lld) must divide q_heads (%lld)", p.kv_heads,
                     p.q_heads);
  if (p.q_len <= 0) return fmt_error("jax_fatrain cpu: q_len must be > 0, got %lld", p.q_len);
  if (p.kv_len <= 0) return fmt_error("jax_fatrain cpu: kv_len must be > 0, got %lld", p.kv_len);
  if (p.head_dim < 1 || p.head_dim > kMaxHeadDim)
    return fmt_error("jax_fatrain cpu: head_dim must be in [1, %lld], got %lld", kMaxHeadDim,
                     p.head_dim);
  if (!std::isfinite(p.scale)) return "jax_fatrain cpu: scale must be finite";
  // Guard the int64 index arithmetic of the kernels against absurd sizes.
  const double elems = static_cast<double>(p.batch) * static_cast<double>(p.q_heads) *
                       static_cast<double>(p.q_len + p.kv_len + 64) * 256.0;
  if (elems > 1e17) return "jax_fatrain cpu: problem too large";
  if (const char* e = check_score_tensor(p.bias, p, "bias", false)) return e;
  if (const char* e = check_score_tensor(p.mask, p, "mask", true)) return e;
  if ((p.q_segment_ids == nullptr) != (p.kv_segment_ids == nullptr))
    return "jax_fatrain cpu: q_segment_ids and kv_segment_ids must be given together";
  return nullptr;
}

namespace {
int64_t g_tile_visits[kTileVisitCounters];
}  // namespace

void count_tile_visits(int counter, int64_t tiles) {
  if (tiles > 0) __atomic_fetch_add(&g_tile_visits[counter], tiles, __ATOMIC_RELAXED);
}

void tile_visits(int64_t out[kTileVisitCounters], bool reset) {
  for (int i = 0; i < kTileVisitCounters; ++i) {
    out[i] = reset ? __atomic_exchange_n(&g_tile_visits[i], int64_t(0), __ATOMIC_RELAXED)
                   : __atomic_load_n(&g_tile_visits[i], __ATOMIC_RELAXED);
  }
}

const char* selected_isa() {
  for (const IsaName& n : kIsaNames)
    if (n.isa == current_isa()) return n.name;
  return "baseline";
}

#if defined(__x86_64__)
#define FATRAIN_DISPATCH(fn, ...)                                 \
  switch (current_isa()) {                                        \
    case Isa::kAvx512:                                            \
    case Isa::kAvx512Bf16:                                        \
    case Isa::kAvx512Amx:                                         \
      return avx512::fn(__VA_ARGS__);                             \
    case Isa::kAvx2:                                              \
      return avx2::fn(__VA_ARGS__);                               \
    case Isa::kAvx2Bf16Emulated:                                  \
      return avx2_bf16_emulated::fn(__VA_ARGS__);                 \
    default:                                                      \
      return baseline::fn(__VA_ARGS__);                           \
  }
#else
#define FATRAIN_DISPATCH(fn, ...) return baseline::fn(__VA_ARGS__);
#endif

namespace {
ParallelFor usable(const ParallelFor& p) { return p.run ? p : serial_parallel_for(); }

// The operand checks of every entry point: q's dtype, then q, k, v, o and the
// stage's further sequence operands `more` (same dtype as q), then lse.
template <class Operands>
const char* check_operands(const Operands& op,
                           std::initializer_list<std::pair<const SeqTensor*, const char*>> more) {
  if (const char* e = check_q_dtype(op.q)) return e;
  for (auto [t, name] : {std::pair{&op.q, "q"}, {&op.k, "k"}, {&op.v, "v"}, {&op.o, "o"}}) {
    if (const char* e = check_seq(*t, name, op.q.dtype)) return e;
  }
  for (auto [t, name] : more) {
    if (const char* e = check_seq(*t, name, op.q.dtype)) return e;
  }
  if (op.lse == nullptr) return "jax_fatrain cpu: lse is null";
  return nullptr;
}
}  // namespace

const char* attention_forward(const AttentionProblem& problem, const ForwardOperands& op,
                              const ParallelFor& parallel) {
  if (const char* e = validate_problem(problem)) return e;
  if (const char* e = check_operands(op, {})) return e;
  const ParallelFor pf = usable(parallel);
#if defined(__x86_64__)
  // avx512_amx: bf16 forwards on AMX tiles; all else runs the avx512 kernels
  // (the backward: see attention_backward).
  if (current_isa() == Isa::kAvx512Amx && op.q.dtype == DType::kBF16)
    return avx512_amx::attention_forward(problem, op, pf, true);
#endif
  FATRAIN_DISPATCH(attention_forward, problem, op, pf, bf16_dot(current_isa()))
}

const char* attention_backward(const AttentionProblem& problem, const BackwardOperands& op,
                               const ParallelFor& parallel) {
  if (const char* e = validate_problem(problem)) return e;
  if (const char* e = check_operands(
          op, {{&op.d_o, "d_o"}, {&op.dq, "dq"}, {&op.dk, "dk"}, {&op.dv, "dv"}})) {
    return e;
  }
  const ParallelFor pf = usable(parallel);
#if defined(__x86_64__)
  // avx512_amx: bf16 backwards on AMX tiles where the head dim is whole AMX
  // steps (32 bf16; kernels/backward.h); all else runs the avx512 kernels.
  if (current_isa() == Isa::kAvx512Amx && op.q.dtype == DType::kBF16 &&
      problem.head_dim % 32 == 0)
    return avx512_amx::attention_backward(problem, op, pf, true);
#endif
  FATRAIN_DISPATCH(attention_backward, problem, op, pf, bf16_dot(current_isa()))
}

const char* attention_bias_grad(const AttentionProblem& problem, const BiasGradOperands& op,
                                const ParallelFor& parallel) {
  if (const char* e = validate_problem(problem)) return e;
  if (problem.bias.data == nullptr) return "jax_fatrain cpu: bias gradient without a bias";
  if (const char* e = check_operands(op, {{&op.d_o, "d_o"}})) return e;
  if (op.dbias == nullptr) return "jax_fatrain cpu: dbias is null";
  const ParallelFor pf = usable(parallel);
  FATRAIN_DISPATCH(attention_bias_grad, problem, op, pf)
}

namespace {
double fma_loop(int64_t iters) { FATRAIN_DISPATCH(fma_loop, iters) }
double bf16_dot_loop(int64_t iters) { FATRAIN_DISPATCH(bf16_dot_loop, iters) }

// The CPUs this process may run on: its affinity mask on Linux (what XLA's
// CPU thread pool counts, so `taskset` limits both), else every hardware thread.
int usable_cpus() {
#if defined(__linux__)
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0 && CPU_COUNT(&set) > 0) return CPU_COUNT(&set);
#endif
  return int(std::max(1u, std::thread::hardware_concurrency()));
}

// GFLOP/s of `loop` (FLOPs done by `iters` rounds) on `threads` threads
// (0: one per usable CPU), each running about `seconds`.
double loop_peak_gflops(double (*loop)(int64_t), int threads, double seconds) {
  if (threads <= 0) threads = usable_cpus();
  // Calibrate on one thread, then run every thread for about `seconds`.
  int64_t iters = 1 << 16;
  for (;;) {
    auto t0 = std::chrono::steady_clock::now();
    loop(iters);
    double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (dt > 0.02 || iters > (int64_t(1) << 40)) {
      iters = std::max<int64_t>(iters, int64_t(double(iters) * seconds / std::max(dt, 1e-9)));
      break;
    }
    iters *= 4;
  }
  std::vector<double> flops(threads);
  std::vector<std::thread> workers;
  auto t0 = std::chrono::steady_clock::now();
  for (int t = 0; t < threads; ++t) workers.emplace_back([&, t] { flops[t] = loop(iters); });
  for (auto& w : workers) w.join();
  double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  double total = 0;
  for (double f : flops) total += f;
  return total / dt / 1e9;
}
}  // namespace

const char* selected_vector_isa() { FATRAIN_DISPATCH(vector_isa) }

double fma_peak_gflops(int threads, double seconds) {
  return loop_peak_gflops(fma_loop, threads, seconds);
}

double bf16_dot_peak_gflops(int threads, double seconds) {
  if (!bf16_dot(current_isa()) || current_isa() == Isa::kAvx2Bf16Emulated) return 0.0;
  return loop_peak_gflops(bf16_dot_loop, threads, seconds);
}

double amx_bf16_peak_gflops(int threads, double seconds) {
#if defined(__x86_64__)
  if (current_isa() == Isa::kAvx512Amx)
    return loop_peak_gflops(avx512_amx::amx_loop, threads, seconds);
#endif
  return 0.0;
}

}  // namespace fatrain::cpu
