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
//    reported as an error, never a hang.
#pragma once

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
};

[[noreturn]] void out_of_bounds(const BufferInfo* info, const void* address,
                                size_t bytes);

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

  T* check(T* q) const {
    const char* c = reinterpret_cast<const char*>(q);
    if (info == nullptr || info->base == nullptr || c < info->base ||
        c + sizeof(T) > info->base + info->size) {
      out_of_bounds(info, q, sizeof(T));
    }
    return q;
  }
  template <class I>
  T& operator[](I i) const { return *check(p + static_cast<ptrdiff_t>(i)); }
  T& operator*() const { return *check(p); }
  T* operator->() const { return check(p); }
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

struct DispatchSpec {
  std::string kernel;
  std::vector<ConstantValue> constants;
  std::vector<BufferBinding> buffers;
  size_t threadgroup_memory_length = 0;  // dynamic [[threadgroup(0)]] bytes
  Size3 grid;         // threadgroups per grid
  Size3 threadgroup;  // threads per threadgroup
};

// Executes one dispatch. Returns "" on success, else the first error
// (kernel name, threadgroup, thread and what went wrong).
std::string run_dispatch(const DispatchSpec& spec, const ParallelFor& parallel);

// ---------------------------------------------------------------------------
// Used by the shim (inside kernels).
// ---------------------------------------------------------------------------
struct Vec3u {
  uint32_t x, y, z;
};

uint32_t builtin_scalar(Builtin b);
Vec3u builtin_vec(Builtin b);
const BufferInfo* buffer_info(int index, const char* param_name, bool optional_absent);
void* threadgroup_param(int index);
void* tg_alloc(size_t size, size_t align);
uint32_t lane_id();

// Simdgroup exchange: a lane writes into its slot, calls simd_sync, then may
// read every lane's slot of the same operation.
constexpr size_t kExchangeBytes = 64;
char* simd_exchange_begin();          // this lane's slot for the next op
const char* simd_exchange_peer(int lane);  // a lane's slot of the current op
enum class SyncKind : int { kSimdReduce, kSimdShuffle, kSimdMatrix, kSimdBarrier };
void simd_sync(SyncKind kind, const char* what);
void threadgroup_barrier_sync();

template <class T>
T& tg_var() {
  return *static_cast<T*>(tg_alloc(sizeof(T), alignof(T) < 16 ? 16 : alignof(T)));
}

template <class T>
struct is_dptr : std::false_type {};
template <class T>
struct is_dptr<dptr<T>> : std::true_type {};

}  // namespace rt
}  // namespace msl
