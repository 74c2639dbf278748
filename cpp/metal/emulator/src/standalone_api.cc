// C entry points of a standalone emulator library: a .metal file translated by
// msl_prepass.py, compiled together with runtime.cc and this file into a
// shared library that Python loads with ctypes (jax_fatrain/_msl_standalone.py).
// Kernels register themselves when the library loads; a dispatch names one.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <exception>
#include <string>

#include "msl_emulator/runtime.h"

// The library is compiled with hidden visibility; only these are exported.
#define MSL_EMU_API __attribute__((visibility("default")))

extern "C" {

struct MslEmuBuffer {
  int32_t index;
  int32_t is_bytes;  // setBytes data (copied per threadgroup) rather than a buffer
  void* data;
  uint64_t size;
};

struct MslEmuConstant {
  int32_t index;
  double value;
};

struct MslEmuDispatch {
  const char* kernel;
  const MslEmuConstant* constants;
  int32_t num_constants;
  const MslEmuBuffer* buffers;
  int32_t num_buffers;
  uint64_t threadgroup_memory_length;
  uint32_t grid[3];         // threadgroups per grid
  uint32_t threadgroup[3];  // threads per threadgroup
  int32_t worker_threads;   // OS threads running threadgroups; 0: one per core
};

// Layout version of the structs above.
MSL_EMU_API uint32_t msl_emu_abi_version() { return 1; }

// Runs one dispatch. Returns 0 on success, else 1 with the error message
// (truncated to err_len - 1 bytes) in err. `counters` receives up to
// `num_counters` per-dispatch counters, in the order msl_emu_counter_names()
// lists them; it may be null.
MSL_EMU_API int msl_emu_dispatch(const MslEmuDispatch* d, uint64_t* counters, int32_t num_counters,
                     char* err, uint64_t err_len) {
  std::string error;
  try {
    msl::rt::DispatchSpec spec;
    spec.kernel = d->kernel;
    for (int32_t i = 0; i < d->num_constants; ++i) {
      spec.constants.push_back({d->constants[i].index, d->constants[i].value});
    }
    for (int32_t i = 0; i < d->num_buffers; ++i) {
      msl::rt::BufferBinding b;
      b.index = d->buffers[i].index;
      b.data = d->buffers[i].data;
      b.size = static_cast<size_t>(d->buffers[i].size);
      b.is_bytes = d->buffers[i].is_bytes != 0;
      spec.buffers.push_back(b);
    }
    spec.threadgroup_memory_length = static_cast<size_t>(d->threadgroup_memory_length);
    spec.grid = {d->grid[0], d->grid[1], d->grid[2]};
    spec.threadgroup = {d->threadgroup[0], d->threadgroup[1], d->threadgroup[2]};
    error = msl::rt::run_dispatch(spec, msl::rt::thread_parallel_for(d->worker_threads));
    if (counters != nullptr) std::fill(counters, counters + std::max(0, num_counters), 0);
  } catch (const std::exception& e) {
    error = std::string("msl emulator: ") + e.what();
  }
  if (error.empty()) return 0;
  if (err != nullptr && err_len > 0) {
    const size_t n = std::min<size_t>(error.size(), static_cast<size_t>(err_len - 1));
    std::memcpy(err, error.data(), n);
    err[n] = '\0';
  }
  return 1;
}

// Names of the counters msl_emu_dispatch can return, newline separated
// (none yet). Returns the length of the full list; writes at most len bytes
// (NUL-terminated when it fits).
MSL_EMU_API uint64_t msl_emu_counter_names(char* out, uint64_t len) {
  const std::string names;
  if (out != nullptr && len > 0) {
    const size_t n = std::min<size_t>(names.size(), static_cast<size_t>(len - 1));
    std::memcpy(out, names.data(), n);
    out[n] = '\0';
  }
  return names.size();
}

// Host names of the kernels this library registered, newline separated.
// Same return convention as msl_emu_counter_names.
MSL_EMU_API uint64_t msl_emu_kernel_names(char* out, uint64_t len) {
  std::string names;
  for (const auto& n : msl::rt::kernel_names()) names += n + "\n";
  if (out != nullptr && len > 0) {
    const size_t n = std::min<size_t>(names.size(), static_cast<size_t>(len - 1));
    std::memcpy(out, names.data(), n);
    out[n] = '\0';
  }
  return names.size();
}

}  // extern "C"
