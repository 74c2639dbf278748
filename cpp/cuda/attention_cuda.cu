// Host side of the CUDA kernels: validation, path selection, launches.
#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <vector>

#if __has_include(<cxxabi.h>)
#include <cxxabi.h>
#define FATRAIN_HAVE_CXXABI 1
#endif

#include "cuda/attention_cuda.h"
#include "cuda/common.cuh"
#include "cuda/kernel_choice.h"
#include "cuda/launch.h"

namespace fatrain::cuda {
namespace {

thread_local char g_message[512];

const char* fmt_error(const char* fmt, long long a, long long b = 0) {
  std::snprintf(g_message, sizeof(g_message), fmt, a, b);
  return g_message;
}

const char* cuda_error(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return nullptr;
  std::snprintf(g_message, sizeof(g_message), "jax_fatrain cuda: %s failed: %s (%s)", what,
                cudaGetErrorString(e), cudaGetErrorName(e));
  return g_message;
}

const char* check_score(const ScoreTensor& t, const AttentionProblem& p, const char* name,
                        bool want_bool) {
  if (t.data == nullptr) return nullptr;
  if (want_bool != (t.dtype == DType::kBool) || t.dtype == DType::kI32) {
    std::snprintf(g_message, sizeof(g_message), "jax_fatrain cuda: %s has the wrong dtype", name);
    return g_message;
  }
  const int64_t full[4] = {p.batch, p.q_heads, p.q_len, p.kv_len};
  for (int a = 0; a < 4; ++a) {
    if (t.dims[a] != 1 && t.dims[a] != full[a]) {
      std::snprintf(g_message, sizeof(g_message),
                    "jax_fatrain cuda: %s dim %d is %lld, expected 1 or %lld", name, a,
                    static_cast<long long>(t.dims[a]), static_cast<long long>(full[a]));
      return g_message;
    }
  }
  return nullptr;
}

// The fastest kernel family launches may use (set_fastest_kernel_family).
std::atomic<int> g_fastest_family{static_cast<int>(KernelFamily::kHopper)};

KernelFamily fastest_allowed() {
  return static_cast<KernelFamily>(g_fastest_family.load(std::memory_order_relaxed));
}

bool aligned16(const SeqTensor& t) {
  return (reinterpret_cast<uintptr_t>(t.data) & 15) == 0 && t.batch_stride % 8 == 0 &&
         t.seq_stride % 8 == 0 && t.head_stride % 8 == 0;
}

// Runs the first family that takes the problem, from `first` on: each
// launcher returns cudaErrorNotSupported for a problem it does not take.
template <class Hopper, class MmaSync, class Simt>
cudaError_t launch_from(KernelFamily first, Hopper&& hopper, MmaSync&& mma_sync, Simt&& simt) {
  cudaError_t err = cudaErrorNotSupported;
  if (first == KernelFamily::kHopper) err = hopper();
  if (err == cudaErrorNotSupported && first != KernelFamily::kSimt) err = mma_sync();
  if (err == cudaErrorNotSupported) err = simt();
  return err;
}

size_t align256(size_t x) { return (x + 255) & ~size_t(255); }

// Whether the Hopper kernels may stage the score tensor a tile at a time with
// 16-byte copies (KParams::staged): exactly one of mask and bias, a mask or a
// 16-bit bias, contiguous along keys, every row 16-byte aligned and S a
// multiple of 16 bytes' worth of keys. Returns its bytes per element, else 0
// (the kernels then load each score's mask or bias on its own).
// Not with segment ids: the kernels compare those per score only where the
// mask or bias is read one score at a time.
int staged_score_bytes(const AttentionProblem& pr) {
  const bool has_bias = pr.bias.data != nullptr, has_mask = pr.mask.data != nullptr;
  if (has_bias == has_mask || pr.q_segment_ids != nullptr) return 0;
  const ScoreTensor& t = has_bias ? pr.bias : pr.mask;
  const int bytes = has_mask ? 1 : (t.dtype == DType::kF32 ? 4 : 2);
  if (bytes == 4) return 0;
  const int64_t per_chunk = 16 / bytes;
  if (t.dims[3] != pr.kv_len || t.strides[3] != 1 || pr.kv_len % per_chunk != 0) return 0;
  for (int a = 0; a < 3; ++a)
    if (t.strides[a] % per_chunk != 0) return 0;
  if (reinterpret_cast<uintptr_t>(t.data) % 16 != 0) return 0;
  return bytes;
}

KParams make_params(const AttentionProblem& pr, const SeqTensor& q, const SeqTensor& k) {
  KParams p;
  std::memset(&p, 0, sizeof(p));
  p.q_bs = q.batch_stride; p.q_ss = q.seq_stride; p.q_hs = q.head_stride;
  p.k_bs = k.batch_stride; p.k_ss = k.seq_stride; p.k_hs = k.head_stride;
  p.B = static_cast<int>(pr.batch); p.N = static_cast<int>(pr.q_heads);
  p.K = static_cast<int>(pr.kv_heads); p.T = static_cast<int>(pr.q_len);
  p.S = static_cast<int>(pr.kv_len); p.D = static_cast<int>(pr.head_dim);
  p.scale = pr.scale;
  p.scale_log2 = pr.scale * kLog2e;
  p.causal = pr.causal ? 1 : 0;
  p.wl = pr.window_left < 0 ? -1 : static_cast<int>(std::min<int64_t>(pr.window_left, 1 << 30));
  p.wr = pr.window_right < 0 ? -1 : static_cast<int>(std::min<int64_t>(pr.window_right, 1 << 30));
  p.q_lengths = pr.q_lengths; p.kv_lengths = pr.kv_lengths;
  p.bias = pr.bias.data;
  p.bias_dtype = static_cast<int>(pr.bias.dtype);
  for (int a = 0; a < 4; ++a) {
    p.bias_st[a] = pr.bias.strides[a];
    p.bias_dims[a] = pr.bias.dims[a];
    p.mask_st[a] = pr.mask.strides[a];
  }
  p.mask = static_cast<const uint8_t*>(pr.mask.data);
  p.staged = staged_score_bytes(pr);
  p.q_seg = pr.q_segment_ids;
  p.kv_seg = pr.kv_segment_ids;
  return p;
}

bool same_layout(const SeqTensor& a, const SeqTensor& b) {
  return a.batch_stride == b.batch_stride && a.seq_stride == b.seq_stride &&
         a.head_stride == b.head_stride && a.dtype == b.dtype;
}

const char* check_operands(const AttentionProblem& p, const SeqTensor& q, const SeqTensor& k,
                           const SeqTensor& v) {
  if (q.dtype != DType::kF32 && q.dtype != DType::kBF16 && q.dtype != DType::kF16)
    return "jax_fatrain cuda: query must be float32, bfloat16 or float16";
  if (!same_layout(k, v) || k.dtype != q.dtype)
    return "jax_fatrain cuda: key and value must share query's dtype and key's layout";
  if (!q.data || !k.data || !v.data) return "jax_fatrain cuda: null operand";
  (void)p;
  return nullptr;
}

}  // namespace

const char* validate_problem(const AttentionProblem& p) {
  if (p.batch <= 0) return fmt_error("jax_fatrain cuda: batch must be > 0, got %lld", p.batch);
  if (p.q_heads <= 0) return fmt_error("jax_fatrain cuda: q_heads must be > 0, got %lld", p.q_heads);
  if (p.kv_heads <= 0)
    return fmt_error("jax_fatrain cuda: kv_heads must be > 0, got %lld", p.kv_heads);
  if (p.q_heads % p.kv_heads != 0)
    return fmt_error("jax_fatrain cuda: kv_heads (%lld) must divide q_heads (%lld)", p.kv_heads,
                     p.q_heads);
  if (p.q_len <= 0) return fmt_error("jax_fatrain cuda: q_len must be > 0, got %lld", p.q_len);
  if (p.kv_len <= 0) return fmt_error("jax_fatrain cuda: kv_len must be > 0, got %lld", p.kv_len);
  if (p.head_dim < 1 || p.head_dim > kMaxHeadDim)
    return fmt_error("jax_fatrain cuda: head_dim must be in [1, %lld], got %lld", kMaxHeadDim,
                     p.head_dim);
  if (!std::isfinite(p.scale)) return "jax_fatrain cuda: scale must be finite";
  if (p.q_len >= (1ll << 30) || p.kv_len >= (1ll << 30) || p.batch >= (1ll << 30) ||
      p.q_heads >= (1ll << 20))
    return "jax_fatrain cuda: problem too large";
  if (const char* e = check_score(p.bias, p, "bias", false)) return e;
  if (const char* e = check_score(p.mask, p, "mask", true)) return e;
  if ((p.q_segment_ids == nullptr) != (p.kv_segment_ids == nullptr))
    return "jax_fatrain cuda: q_segment_ids and kv_segment_ids must be given together";
  return nullptr;
}

const char* selected_path(const AttentionProblem& problem, DType dtype) {
  return first_family(dtype, problem.head_dim, true, fastest_allowed()) == KernelFamily::kSimt
             ? "simt"
             : "tensor_core";
}

bool set_fastest_kernel_family(std::string_view name) {
  KernelFamily family;
  if (name == "hopper") family = KernelFamily::kHopper;
  else if (name == "mma_sync") family = KernelFamily::kMmaSync;
  else if (name == "simt") family = KernelFamily::kSimt;
  else return false;
  g_fastest_family.store(static_cast<int>(family), std::memory_order_relaxed);
  return true;
}

namespace {
std::atomic<bool> g_recording{false};
std::mutex g_record_mutex;
std::vector<std::string> g_record;
}  // namespace

void set_launch_recording(bool on) { g_recording.store(on, std::memory_order_relaxed); }

std::vector<std::string> take_launch_record() {
  std::lock_guard<std::mutex> lock(g_record_mutex);
  std::vector<std::string> names;
  names.swap(g_record);
  return names;
}

void record_launch(const void* kernel) {
  if (!g_recording.load(std::memory_order_relaxed)) return;
  // A launch that failed is not recorded, and its error stays for the
  // launcher's cudaGetLastError.
  if (cudaPeekAtLastError() != cudaSuccess) return;
  const char* name = "(unknown: the kernel's name needs CUDA 12.3 or newer)";
#if CUDART_VERSION >= 12030
  if (const char* n = nullptr; cudaFuncGetName(&n, kernel) == cudaSuccess && n != nullptr) {
    name = n;
  } else {
    cudaGetLastError();  // the lookup's own error, not the launch's
    name = "(unknown: cudaFuncGetName failed)";
  }
#else
  (void)kernel;
#endif
  std::string readable = name;
#if defined(FATRAIN_HAVE_CXXABI)
  // "bwd_ws_kernel<__nv_bfloat16, 64, true, 0, 128>(...)" rather than the
  // mangled symbol, so that tests can match template arguments too.
  int status = 0;
  if (char* d = abi::__cxa_demangle(name, nullptr, nullptr, &status); d != nullptr) {
    if (status == 0) readable = d;
    std::free(d);
  }
#endif
  std::lock_guard<std::mutex> lock(g_record_mutex);
  g_record.push_back(std::move(readable));
}

namespace {
// Tile-visit counters in device memory ({forward, backward}), allocated when
// counting first starts; g_counting says whether launches pass them.
enum TileVisitCounter : int { kForwardVisits = 0, kBackwardVisits = 1, kVisitCounters = 2 };
std::atomic<bool> g_counting{false};
unsigned long long* g_tile_visits = nullptr;
std::mutex g_tile_visits_mutex;

unsigned long long* tile_visit_counter(TileVisitCounter which) {
  return g_counting.load(std::memory_order_relaxed) ? g_tile_visits + which : nullptr;
}
}  // namespace

const char* set_tile_visit_counting(bool on) {
  std::lock_guard<std::mutex> lock(g_tile_visits_mutex);
  if (on && g_tile_visits == nullptr) {
    const size_t bytes = kVisitCounters * sizeof(unsigned long long);
    if (const char* e = cuda_error(cudaMalloc(&g_tile_visits, bytes), "tile-visit counters"))
      return e;
    if (const char* e = cuda_error(cudaMemset(g_tile_visits, 0, bytes), "tile-visit counters"))
      return e;
  }
  g_counting.store(on, std::memory_order_relaxed);
  return nullptr;
}

std::vector<unsigned long long> take_tile_visits() {
  std::lock_guard<std::mutex> lock(g_tile_visits_mutex);
  std::vector<unsigned long long> counts(kVisitCounters, 0);
  if (g_tile_visits == nullptr) return counts;
  cudaDeviceSynchronize();
  cudaMemcpy(counts.data(), g_tile_visits, kVisitCounters * sizeof(unsigned long long),
             cudaMemcpyDeviceToHost);
  cudaMemset(g_tile_visits, 0, kVisitCounters * sizeof(unsigned long long));
  return counts;
}

// Scratch layouts: forward [segment tables]; backward [dsum | dq_acc (atomic
// mode) | segment tables]; bias gradient [dsum | segment tables].
size_t forward_scratch_bytes(const AttentionProblem& p) { return segment_table_bytes(p); }

size_t backward_scratch_bytes(const AttentionProblem& p, bool deterministic) {
  const size_t rows = static_cast<size_t>(p.batch) * p.q_heads * p.q_len;
  size_t bytes = align256(rows * sizeof(float));  // dsum
  if (!deterministic) bytes += align256(rows * p.head_dim * sizeof(float));  // dq_acc
  return bytes + segment_table_bytes(p);
}

size_t bias_grad_scratch_bytes(const AttentionProblem& p) {
  return align256(static_cast<size_t>(p.batch) * p.q_heads * p.q_len * sizeof(float)) +
         segment_table_bytes(p);
}

const char* attention_forward(const AttentionProblem& problem, const ForwardOperands& op,
                              void* scratch, cudaStream_t stream) {
  if (const char* e = validate_problem(problem)) return e;
  if (const char* e = check_operands(problem, op.q, op.k, op.v)) return e;
  if (!same_layout(op.o, op.q)) return "jax_fatrain cuda: output must have query's layout";
  if (op.lse == nullptr) return "jax_fatrain cuda: lse is null";
  KParams p = make_params(problem, op.q, op.k);
  p.q = op.q.data; p.k = op.k.data; p.v = op.v.data;
  p.out = op.o.data;
  p.lse = op.lse;
  p.tile_visits = tile_visit_counter(kForwardVisits);
  if (p.q_seg != nullptr) {
    if (scratch == nullptr) return "jax_fatrain cuda: segment ids need scratch memory";
    if (const char* e = cuda_error(launch_segment_tables(&p, scratch, stream), "segment tables"))
      return e;
  }
  const DType dt = op.q.dtype;
  const bool aligned = aligned16(op.q) && aligned16(op.k) && aligned16(op.v) && aligned16(op.o);
  const cudaError_t err = launch_from(
      first_family(dt, problem.head_dim, aligned, fastest_allowed()),
      [&] { return launch_fwd_hopper(p, dt, stream); },
      [&] { return launch_fwd_tc(p, dt, stream); },
      [&] { return launch_fwd_simt(p, dt, stream); });
  return cuda_error(err, "forward launch");
}

const char* attention_backward(const AttentionProblem& problem, const BackwardOperands& op,
                               bool deterministic, void* scratch, cudaStream_t stream) {
  if (const char* e = validate_problem(problem)) return e;
  if (const char* e = check_operands(problem, op.q, op.k, op.v)) return e;
  if (!same_layout(op.o, op.q) || !same_layout(op.d_o, op.q) || !same_layout(op.dq, op.q))
    return "jax_fatrain cuda: out, d_out and dq must have query's layout";
  if (!same_layout(op.dk, op.k) || !same_layout(op.dv, op.k))
    return "jax_fatrain cuda: dk and dv must have key's layout";
  if (op.lse == nullptr) return "jax_fatrain cuda: lse is null";
  if (scratch == nullptr) return "jax_fatrain cuda: backward needs scratch memory";
  KParams p = make_params(problem, op.q, op.k);
  p.q = op.q.data; p.k = op.k.data; p.v = op.v.data; p.o = op.o.data; p.d_o = op.d_o.data;
  p.dq = op.dq.data; p.dk = op.dk.data; p.dv = op.dv.data;
  p.lse = const_cast<float*>(op.lse);
  const size_t rows = static_cast<size_t>(problem.batch) * problem.q_heads * problem.q_len;
  p.dsum = static_cast<float*>(scratch);
  p.tile_visits = tile_visit_counter(kBackwardVisits);
  if (p.q_seg != nullptr) {
    void* tables = static_cast<char*>(scratch) + backward_scratch_bytes(problem, deterministic) -
                   segment_table_bytes(problem);
    if (const char* e = cuda_error(launch_segment_tables(&p, tables, stream), "segment tables"))
      return e;
  }
  const DType dt = op.q.dtype;
  if (const char* e = cuda_error(launch_dsum(p, dt, stream), "backward dsum")) return e;
  const bool aligned = aligned16(op.q) && aligned16(op.k) && aligned16(op.v) &&
                       aligned16(op.o) && aligned16(op.d_o) && aligned16(op.dq) &&
                       aligned16(op.dk) && aligned16(op.dv);
  const KernelFamily first = first_family(dt, problem.head_dim, aligned, fastest_allowed());
  const bool atomic_dq = !deterministic;
  if (atomic_dq && first != KernelFamily::kSimt) {
    // The tensor-core backwards add dQ into float32 scratch; dq_convert
    // writes it out. The deterministic mode's dQ has a kernel of its own.
    p.dq_acc =
        reinterpret_cast<float*>(static_cast<char*>(scratch) + align256(rows * sizeof(float)));
    if (const char* e = cuda_error(
            cudaMemsetAsync(p.dq_acc, 0, rows * problem.head_dim * sizeof(float), stream),
            "backward dq scratch memset"))
      return e;
  }
  // A tensor-core family computes dK, dV (and the atomic dQ), then dQ
  // follows; SIMT computes all three in one.
  auto with_dq = [&](cudaError_t err) {
    if (err != cudaSuccess) return err;
    return atomic_dq ? launch_dq_convert(p, dt, stream) : launch_dq_tc(p, dt, stream);
  };
  const cudaError_t err = launch_from(
      first, [&] { return with_dq(launch_bwd_hopper(p, dt, atomic_dq, stream)); },
      [&] { return with_dq(launch_bwd_tc(p, dt, atomic_dq, stream)); },
      [&] { return launch_bwd_simt(p, dt, stream); });
  return cuda_error(err, "backward launch");
}

const char* attention_bias_grad(const AttentionProblem& problem, const BiasGradOperands& op,
                                void* scratch, cudaStream_t stream) {
  if (const char* e = validate_problem(problem)) return e;
  if (problem.bias.data == nullptr) return "jax_fatrain cuda: bias gradient without a bias";
  if (const char* e = check_operands(problem, op.q, op.k, op.v)) return e;
  if (!same_layout(op.o, op.q) || !same_layout(op.d_o, op.q))
    return "jax_fatrain cuda: out and d_out must have query's layout";
  if (op.lse == nullptr || op.dbias == nullptr) return "jax_fatrain cuda: null lse or dbias";
  if (scratch == nullptr) return "jax_fatrain cuda: bias gradient needs scratch memory";
  KParams p = make_params(problem, op.q, op.k);
  p.q = op.q.data; p.k = op.k.data; p.v = op.v.data; p.o = op.o.data; p.d_o = op.d_o.data;
  p.lse = const_cast<float*>(op.lse);
  p.dsum = static_cast<float*>(scratch);
  p.dbias = op.dbias;
  if (p.q_seg != nullptr) {
    void* tables = static_cast<char*>(scratch) + bias_grad_scratch_bytes(problem) -
                   segment_table_bytes(problem);
    if (const char* e = cuda_error(launch_segment_tables(&p, tables, stream), "segment tables"))
      return e;
  }
  const DType dt = op.q.dtype;
  if (const char* e = cuda_error(launch_dsum(p, dt, stream), "bias grad dsum")) return e;
  int64_t count = 1;
  for (int a = 0; a < 4; ++a) count *= problem.bias.dims[a];
  return cuda_error(launch_dbias_simt(p, dt, count, stream), "bias grad");
}

}  // namespace fatrain::cuda
