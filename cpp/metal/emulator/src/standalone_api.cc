// C entry points of a standalone emulator library: a .metal file translated by
// msl_prepass.py, compiled together with runtime.cc and this file into a
// shared library that Python loads with ctypes (jax_fatrain/emulator/msl_standalone.py).
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
  // Which threadgroups run (msl::rt::Sampling); 1 and 0 run all of them.
  double sample_fraction;
  uint64_t sample_max_threadgroups;
};

// Layout version of the structs above.
MSL_EMU_API uint32_t msl_emu_abi_version() { return 2; }

}  // extern "C"

namespace {
void copy_out(const std::string& text, char* out, uint64_t len) {
  if (out == nullptr || len == 0) return;
  const size_t n = std::min<size_t>(text.size(), static_cast<size_t>(len - 1));
  std::memcpy(out, text.data(), n);
  out[n] = '\0';
}

const char* const kCounterNames[] = {
#define MSL_EMU_COUNTER_NAME(name) #name,
    MSL_EMU_DISPATCH_COUNTERS(MSL_EMU_COUNTER_NAME)
#undef MSL_EMU_COUNTER_NAME
};
}  // namespace

extern "C" {

// Runs one dispatch. Returns 0 on success, else 1 with the error message
// (truncated to err_len - 1 bytes) in err. With `counters` non-null the
// dispatch is counted (msl::rt::DispatchStats): `counters` receives up to
// `num_counters` values in the order msl_emu_counter_names() lists them, and
// threadgroup-memory races are counted, their first reports (newline
// separated) written to `reports`, instead of failing the dispatch.
MSL_EMU_API int msl_emu_dispatch(const MslEmuDispatch* d, uint64_t* counters,
                                 int32_t num_counters, char* reports, uint64_t reports_len,
                                 char* err, uint64_t err_len) {
  std::string error;
  copy_out("", reports, reports_len);
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
    spec.sample.fraction = d->sample_fraction;
    spec.sample.max_threadgroups = d->sample_max_threadgroups;
    const msl::rt::ParallelFor parallel = msl::rt::thread_parallel_for(d->worker_threads);
    if (counters == nullptr) {
      error = msl::rt::run_dispatch(spec, parallel);
    } else {
      msl::rt::DispatchStats stats;
      error = msl::rt::run_dispatch(spec, parallel, &stats);
      const uint64_t values[] = {
#define MSL_EMU_COUNTER_VALUE(name) stats.name,
          MSL_EMU_DISPATCH_COUNTERS(MSL_EMU_COUNTER_VALUE)
#undef MSL_EMU_COUNTER_VALUE
      };
      const int n = std::min<int>(num_counters, int(sizeof(values) / sizeof(values[0])));
      std::copy(values, values + std::max(0, n), counters);
      std::string text;
      for (const auto& r : stats.race_reports) text += r + "\n";
      copy_out(text, reports, reports_len);
    }
  } catch (const std::exception& e) {
    error = std::string("msl emulator: ") + e.what();
  }
  if (error.empty()) return 0;
  copy_out(error, err, err_len);
  return 1;
}

// Names of the counters msl_emu_dispatch returns, newline separated. Returns
// the length of the whole list; writes at most len bytes (NUL-terminated).
MSL_EMU_API uint64_t msl_emu_counter_names(char* out, uint64_t len) {
  std::string names;
  for (const char* n : kCounterNames) names += std::string(n) + "\n";
  copy_out(names, out, len);
  return names.size();
}

// Host names of the kernels this library registered, newline separated.
// Same return convention as msl_emu_counter_names.
MSL_EMU_API uint64_t msl_emu_kernel_names(char* out, uint64_t len) {
  std::string names;
  for (const auto& n : msl::rt::kernel_names()) names += n + "\n";
  copy_out(names, out, len);
  return names.size();
}

}  // extern "C"
