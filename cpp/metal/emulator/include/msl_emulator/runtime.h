// MSL emulator runtime: the execution model of a Metal compute dispatch on the
// CPU. Plain C++ (no MSL keyword macros), included by the metal_stdlib shim
// and by hosts that run dispatches (tests, the metal_emulated FFI target).
//
// Model:
//  * one dispatch = a grid of threadgroups; threadgroups run independently
//    (possibly on several OS threads), each to completion;
//  * inside a threadgroup every thread is a fiber with its own stack; fibers
//    switch only at synchronisation points (threadgroup_barrier, simd_* and
//    simdgroup_matrix operations), so all 32 lanes of a simdgroup meet at every
//    simdgroup operation and all threads meet at every barrier;
//  * device buffers are bounds-checked pointers (dptr), threadgroup memory is
//    poisoned with 0xFF bytes (NaN for float/half/bfloat) at threadgroup start;
//  * a barrier or simdgroup operation that not every participant reaches is
//    reported as an error, never a hang;
//  * threadgroup memory is accessed through tracked elements (tgelem<T>, see
//    the shim): every read and write is checked against the threadgroup
//    variables' bounds and against the accesses of other threads since the
//    last barrier (the race detector);
//  * on request a dispatch also counts what decides its cost on a GPU
//    (DispatchStats), optionally over a sample of its threadgroups.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace msl {
namespace rt {

// Thrown inside a kernel; the scheduler turns it into the dispatch's error.
struct KernelError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

[[noreturn]] void fail(const std::string& message);

// One bound buffer (device memory or setBytes data).
struct BufferBinding {
  int index = -1;
  void* data = nullptr;
  size_t size = 0;
  bool is_bytes = false;  // constant data copied at encode time (setBytes)
};

struct BufferInfo {  // what a checked pointer knows about its buffer
  const char* kernel = "";
  int index = -1;
  char* base = nullptr;
  size_t size = 0;
  bool is_bytes = false;  // setBytes data: constant memory, not counted as device traffic
};

[[noreturn]] void out_of_bounds(const BufferInfo* info, const void* address,
                                size_t bytes);

#define MSL_EMU_INLINE inline __attribute__((always_inline))

// Non-zero while a dispatch that counts (DispatchStats requested) runs in
// this process; the inline hooks test it before calling into the runtime, so
// counting costs one load and a predictable branch per access when off.
extern std::atomic<int> g_counting_dispatches;
MSL_EMU_INLINE bool counting_active() {
  return g_counting_dispatches.load(std::memory_order_relaxed) != 0;
}
// A device-memory access of `bytes` bytes at `address` (one lane). The
// access site is this function's return address, so the hook must be called
// from code inlined into the access site (dptr's always-inline operators).
__attribute__((noinline)) void count_device_access(const BufferInfo* info, const void* address,
                                                   uint32_t bytes, bool store);

// A bounds-checked device/constant pointer. Every dereference checks that the
// whole element lies inside the bound buffer.
template <class T>
struct dptr {
  T* p = nullptr;
  const BufferInfo* info = nullptr;

  dptr() = default;
  dptr(T* p_, const BufferInfo* info_) : p(p_), info(info_) {}
  template <class U, class = std::enable_if_t<std::is_convertible<U*, T*>::value>>
  dptr(const dptr<U>& other) : p(other.p), info(other.info) {}
  // MSL's explicit pointer casts between element types, e.g. a vector load
  // through `(const device half4*)p`; accesses are checked for the new size.
  template <class U, std::enable_if_t<!std::is_convertible<U*, T*>::value, int> = 0>
  explicit dptr(const dptr<U>& other) : p(reinterpret_cast<T*>(other.p)), info(other.info) {}

  // Bounds check; when counting, records the access (a store if T is not
  // const: kernels read through const pointers and write through the others).
  MSL_EMU_INLINE T* check(T* q) const {
    const char* c = reinterpret_cast<const char*>(q);
    if (info == nullptr || info->base == nullptr || c < info->base ||
        c + sizeof(T) > info->base + info->size) {
      out_of_bounds(info, q, sizeof(T));
    }
    if (__builtin_expect(counting_active(), 0)) {
      count_device_access(info, q, sizeof(T), !std::is_const<T>::value);
    }
    return q;
  }
  template <class I>
  MSL_EMU_INLINE T& operator[](I i) const { return *check(p + static_cast<ptrdiff_t>(i)); }
  MSL_EMU_INLINE T& operator*() const { return *check(p); }
  MSL_EMU_INLINE T* operator->() const { return check(p); }
  template <class I, class = std::enable_if_t<std::is_integral<I>::value>>
  dptr operator+(I i) const { return dptr(p + static_cast<ptrdiff_t>(i), info); }
  template <class I, class = std::enable_if_t<std::is_integral<I>::value>>
  dptr operator-(I i) const { return dptr(p - static_cast<ptrdiff_t>(i), info); }
  template <class I> dptr& operator+=(I i) { p += static_cast<ptrdiff_t>(i); return *this; }
  template <class I> dptr& operator-=(I i) { p -= static_cast<ptrdiff_t>(i); return *this; }
  dptr& operator++() { ++p; return *this; }
  dptr operator++(int) { dptr old = *this; ++p; return old; }
  ptrdiff_t operator-(const dptr& o) const { return p - o.p; }
  bool operator==(const dptr& o) const { return p == o.p; }
  bool operator!=(const dptr& o) const { return p != o.p; }
  explicit operator bool() const { return p != nullptr; }
};
template <class I, class T, class = std::enable_if_t<std::is_integral<I>::value>>
dptr<T> operator+(I i, const dptr<T>& d) { return d + i; }

// Builtin kernel parameter values.
enum class Builtin : int {
  kThreadgroupPositionInGrid,
  kThreadPositionInThreadgroup,
  kThreadPositionInGrid,
  kThreadsPerThreadgroup,
  kThreadgroupsPerGrid,
  kThreadsPerGrid,
  kThreadIndexInThreadgroup,
  kThreadIndexInSimdgroup,
  kSimdgroupIndexInThreadgroup,
  kThreadsPerSimdgroup,
  kSimdgroupsPerThreadgroup,
};

enum class ParamKind : int { kBuffer, kBuiltin, kThreadgroup };

struct ParamAttr {
  ParamKind kind;
  int index;             // buffer / threadgroup index, or (int)Builtin
  bool (*guard)();       // function_constant guard of an optional buffer, or null
  const char* name;      // parameter name, for messages
};

struct FunctionConstantDecl {
  int index;
  const char* name;
};

struct ConstantValue {
  int index;
  double value;  // bool/int/uint/float constants
};

struct KernelEntry {
  const char* name;            // host_name
  const char* source;          // .metal file
  void (*run)();               // runs one thread of the kernel (in a fiber)
  void (*set_constants)(const ConstantValue* values, int count);
  const FunctionConstantDecl* used_constants;  // referenced by the kernel body
  int used_constant_count;
  // Threads per threadgroup the kernel accepts: its
  // [[max_total_threads_per_threadgroup(N)]] (declared_max_threads), else 1024.
  unsigned long max_threads;
  bool declared_max_threads;
};

struct Registrar {
  Registrar(const KernelEntry* entries, int count);
};
const KernelEntry* find_kernel(const std::string& name);
std::vector<std::string> kernel_names();

struct Size3 {
  uint32_t x = 1, y = 1, z = 1;
};

// Runs body(context, i) for i in [0, count); may run items concurrently.
struct ParallelFor {
  void (*run)(void* self, int64_t count, void (*body)(void*, int64_t),
              void* context) = nullptr;
  void* self = nullptr;
  int64_t num_threads = 1;
};
ParallelFor thread_parallel_for(int threads);  // std::thread workers (0: hw)

// Which threadgroups of a dispatch run. The default runs all of them. A
// sample runs round(fraction * total) threadgroups, at most max_threadgroups
// when that is non-zero (at least one), spread evenly over grid x (query or
// key tiles, so causal work is represented) and, within each chosen x, over
// the (y, z) pairs. Outputs of a sampled dispatch are incomplete: for
// measuring only.
struct Sampling {
  double fraction = 1.0;
  uint64_t max_threadgroups = 0;
  bool all() const { return fraction >= 1.0 && max_threadgroups == 0; }
};

struct DispatchSpec {
  std::string kernel;
  std::vector<ConstantValue> constants;
  std::vector<BufferBinding> buffers;
  size_t threadgroup_memory_length = 0;  // dynamic [[threadgroup(0)]] bytes
  Size3 grid;         // threadgroups per grid
  Size3 threadgroup;  // threads per threadgroup
  Sampling sample;
};

// The counters of one dispatch, X(name): summed over the executed
// threadgroups, then scaled by total / executed threadgroups when sampled
// (except peak_tg_bytes, threadgroups_*, threads_per_threadgroup and races).
//   simdgroup_mma          8x8x8 simdgroup_multiply_accumulate, once per simdgroup
//   device_bytes_read      bytes lanes read from device buffers (not setBytes data)
//   device_bytes_written   bytes lanes wrote to device buffers
//   device_load_instrs     simdgroup-wide load instructions: the k-th execution of
//   device_store_instrs    one access site by the lanes of a simdgroup between two
//                          simdgroup synchronisations (simdgroup_load/store of a
//                          lane's two elements is one instruction)
//   device_lines64         distinct 64-byte / 128-byte lines (offsets within the
//   device_lines128        buffer) per simdgroup-wide instruction, summed
//   device_lines128_merged distinct 128-byte lines the lanes of a simdgroup touch
//                          between two simdgroup synchronisations (loads and
//                          stores apart), summed: the lines needed once a compiler
//                          merges a lane's contiguous scalar accesses into vector
//                          accesses and the cache serves repeats in that interval
//   tg_bytes_read          bytes lanes read from / wrote to threadgroup memory
//   tg_bytes_written
//   barriers               threadgroup_barrier executions (once per threadgroup)
//   simd_barriers          simdgroup_barrier executions (once per simdgroup)
//   peak_tg_bytes          threadgroup memory per threadgroup (max over threadgroups)
//   threadgroups_executed  threadgroups run (the sample) / in the grid
//   threadgroups_total
//   threads_per_threadgroup
//   races                  racing threadgroup-memory accesses observed (not scaled)
//   transcendentals        per-lane calls of exp, exp2, log, log2, log10, pow, sqrt,
//                          rsqrt, sin, cos, tanh (metal::, fast::, precise::, the
//                          vector forms per element and the __metal_* intrinsics)
//   bfloat_conversions     per-lane float <-> bfloat conversions (a bfloat made from
//                          a number, or read as float); half converts in hardware
//                          operands and is not counted; simdgroup_matrix operands
//                          are not counted (the matrix unit reads them)
//   simd_shuffles          simd_shuffle*, simd_broadcast, once per simdgroup
//   simd_reductions        simd_sum/max/min/product/and/or/xor/all/any and the
//                          simd_prefix_* scans, once per simdgroup
//   tg_lines               distinct 128-byte device lines each threadgroup touches,
//                          summed over threadgroups
//   tg_lines_new_x         of those, the lines the threadgroup's neighbour in grid x
//   tg_lines_new_y         (in y, or z when the grid has one row) does not touch, and
//   tg_lines_new_xy        the lines neither neighbour touches: per buffer, the
//                          threadgroup's lines times the fraction of a probe
//                          threadgroup's lines its neighbour lacks (see
//                          probe_neighbours in runtime.cc)
#define MSL_EMU_DISPATCH_COUNTERS(X)                                            \
  X(simdgroup_mma) X(device_bytes_read) X(device_bytes_written)                 \
  X(device_load_instrs) X(device_store_instrs) X(device_lines64)                \
  X(device_lines128) X(device_lines128_merged) X(tg_bytes_read) X(tg_bytes_written) X(barriers)           \
  X(simd_barriers) X(peak_tg_bytes) X(threadgroups_executed)                    \
  X(threadgroups_total) X(threads_per_threadgroup) X(races)                     \
  X(transcendentals) X(bfloat_conversions) X(simd_shuffles) X(simd_reductions)  \
  X(tg_lines) X(tg_lines_new_x) X(tg_lines_new_y) X(tg_lines_new_xy)
constexpr int kMaxBufferIndex = 31;  // buffer indices 0..30

struct DispatchStats {
#define MSL_EMU_COUNTER_FIELD(name) uint64_t name = 0;
  MSL_EMU_DISPATCH_COUNTERS(MSL_EMU_COUNTER_FIELD)
#undef MSL_EMU_COUNTER_FIELD
  double sampled_fraction = 1.0;          // threadgroups_executed / threadgroups_total
  uint64_t tg_lines_by_buffer[kMaxBufferIndex] = {};  // tg_lines per buffer index (unscaled)
  std::vector<std::string> race_reports;  // the first few races, as error messages
};
constexpr size_t kMaxRaceReports = 4;

// Executes one dispatch. Returns "" on success, else the first error
// (kernel name, threadgroup, thread and what went wrong). A threadgroup-memory
// race is an error, unless `stats` is given: then the dispatch counts its
// races and keeps the first reports in stats->race_reports.
std::string run_dispatch(const DispatchSpec& spec, const ParallelFor& parallel,
                         DispatchStats* stats = nullptr);

// ---------------------------------------------------------------------------
// Used by the shim (inside kernels).
// ---------------------------------------------------------------------------
struct Vec3u {
  uint32_t x, y, z;
};

uint32_t builtin_scalar(Builtin b);
Vec3u builtin_vec(Builtin b);
const BufferInfo* buffer_info(int index, const char* param_name, bool optional_absent);
void* threadgroup_param(int index, const char* name = "[[threadgroup(0)]]");
// Allocates a threadgroup variable (every thread of the threadgroup gets the
// same address for the same declaration); `name` is used in reports.
void* tg_alloc(size_t size, size_t align, const char* name = "threadgroup variable");
uint32_t lane_id();

// A read or write of threadgroup memory by the calling thread: bounds check
// against the threadgroup variables, race check, counters. Addresses outside
// the threadgroup's memory (a tgelem copied to the stack) are ignored.
void tg_access(const void* address, uint32_t bytes, bool write);

// Marks the device accesses of one lane between begin and end as a single
// simdgroup-wide instruction (simdgroup_load/store move two elements a lane).
void instr_group_begin();
void instr_group_end();
struct InstrGroup {
  bool on;
  MSL_EMU_INLINE InstrGroup() : on(counting_active()) {
    if (on) instr_group_begin();
  }
  MSL_EMU_INLINE ~InstrGroup() {
    if (on) instr_group_end();
  }
};
void count_mma();  // one simdgroup_multiply_accumulate (counted for lane 0)
void count_transcendental();     // one lane's exp/log/rsqrt/... call
void count_bfloat_conversion();  // one lane's float <-> bfloat conversion
// The inline forms the shim calls (one load and a branch when not counting).
MSL_EMU_INLINE void note_transcendental() {
  if (__builtin_expect(counting_active(), 0)) count_transcendental();
}
MSL_EMU_INLINE void note_bfloat_conversion() {
  if (__builtin_expect(counting_active(), 0)) count_bfloat_conversion();
}

// Simdgroup exchange: a lane writes into its slot, calls simd_sync, then may
// read every lane's slot of the same operation.
constexpr size_t kExchangeBytes = 64;
char* simd_exchange_begin();          // this lane's slot for the next op
const char* simd_exchange_peer(int lane);  // a lane's slot of the current op
// Lane 0's slot of the current op; lane l's is kExchangeBytes * l further.
const char* simd_exchange_peers();
enum class SyncKind : int { kSimdReduce, kSimdShuffle, kSimdMatrix, kSimdBarrier };
void simd_sync(SyncKind kind, const char* what);
// `orders_threadgroup_memory`: the barrier's flags include mem_threadgroup,
// so threadgroup-memory accesses before it happen before those after it.
void simd_barrier_sync(bool orders_threadgroup_memory);
void threadgroup_barrier_sync(bool orders_threadgroup_memory = true);

template <class T>
T& tg_var(const char* name = "threadgroup variable") {
  return *static_cast<T*>(tg_alloc(sizeof(T), alignof(T) < 16 ? 16 : alignof(T), name));
}

// A threadgroup-memory element. The pre-pass turns `threadgroup T` storage,
// pointers and references into tgelem<T> ones (same size and alignment as T),
// so arrays, pointer arithmetic and pointer casts stay native C++ while every
// read and write of an element goes through tg_access (bounds, races,
// counters). Reading converts to T (and to float when T is a class type that
// converts to float, such as bfloat); writing assigns a T.
template <class Self, class T, bool = std::is_class<T>::value && std::is_convertible<T, float>::value>
struct tgelem_float_conversion {};
template <class Self, class T>
struct tgelem_float_conversion<Self, T, true> {
  MSL_EMU_INLINE operator float() const {
    return static_cast<float>(static_cast<const Self*>(this)->load());
  }
};

template <class T>
struct tgelem : tgelem_float_conversion<tgelem<T>, T> {
  T v;
  using value_type = T;
  tgelem() = default;
  explicit MSL_EMU_INLINE tgelem(const T& x) : v(x) {}
  MSL_EMU_INLINE tgelem(const tgelem& o) : v(o.load()) {}
  MSL_EMU_INLINE T load() const {
    tg_access(this, sizeof(T), false);
    return v;
  }
  MSL_EMU_INLINE operator T() const { return load(); }
  MSL_EMU_INLINE tgelem& operator=(const T& x) {
    tg_access(this, sizeof(T), true);
    v = x;
    return *this;
  }
  MSL_EMU_INLINE tgelem& operator=(const tgelem& o) { return *this = o.load(); }
#define MSL_EMU_TG_COMPOUND(op)                      \
  template <class U>                                 \
  MSL_EMU_INLINE tgelem& operator op##=(const U& x) { \
    return *this = T(load() op x);                   \
  }
  MSL_EMU_TG_COMPOUND(+) MSL_EMU_TG_COMPOUND(-) MSL_EMU_TG_COMPOUND(*) MSL_EMU_TG_COMPOUND(/)
  MSL_EMU_TG_COMPOUND(%) MSL_EMU_TG_COMPOUND(&) MSL_EMU_TG_COMPOUND(|) MSL_EMU_TG_COMPOUND(^)
  MSL_EMU_TG_COMPOUND(<<) MSL_EMU_TG_COMPOUND(>>)
#undef MSL_EMU_TG_COMPOUND
  MSL_EMU_INLINE tgelem& operator++() { return *this = T(load() + 1); }
  MSL_EMU_INLINE tgelem& operator--() { return *this = T(load() - 1); }
  MSL_EMU_INLINE T operator++(int) { T old = load(); *this = T(old + 1); return old; }
  MSL_EMU_INLINE T operator--(int) { T old = load(); *this = T(old - 1); return old; }
};

// The value type behind a pointer's element (T for tgelem<T>).
template <class T>
struct tg_value { using type = T; };
template <class T>
struct tg_value<tgelem<T>> { using type = T; };
template <class T>
using tg_value_t = typename tg_value<std::remove_cv_t<T>>::type;

template <class T>
struct is_dptr : std::false_type {};
template <class T>
struct is_dptr<dptr<T>> : std::true_type {};

}  // namespace rt
}  // namespace msl
