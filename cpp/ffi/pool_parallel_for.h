// Running independent work items on XLA's intra-op thread pool
// (ffi::ThreadPool, from the FFI context), shared by the CPU handlers and the
// MSL emulator's handlers.
//
// The calling thread takes part and items are claimed from a shared counter,
// so a call finishes even if the pool never runs our tasks (e.g. when the
// caller itself is the pool's only thread); helpers that start late find
// nothing left and return at once.
#pragma once

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>

#include "xla/ffi/api/ffi.h"

namespace fatrain::ffi_glue {

struct PoolRun {
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> finished{0};
  int64_t count = 0;
  void (*body)(void*, int64_t) = nullptr;
  void* context = nullptr;
  std::mutex mutex;
  std::condition_variable all_done;

  void Work() {
    for (int64_t i; (i = next.fetch_add(1)) < count;) {
      body(context, i);
      if (finished.fetch_add(1) + 1 == count) {
        std::lock_guard<std::mutex> lock(mutex);
        all_done.notify_all();
      }
    }
  }
};

// Signature of the kernels' ParallelFor::run; `self` is an ffi::ThreadPool*.
inline void RunOnPool(void* self, int64_t count, void (*body)(void*, int64_t),
                      void* context) {
  if (count <= 0) return;
  auto* pool = static_cast<xla::ffi::ThreadPool*>(self);
  auto run = std::make_shared<PoolRun>();
  run->count = count;
  run->body = body;
  run->context = context;
  const int64_t helpers = std::min<int64_t>(pool->num_threads(), count) - 1;
  for (int64_t h = 0; h < helpers; ++h) {
    pool->Schedule([run] { run->Work(); });
  }
  run->Work();
  std::unique_lock<std::mutex> lock(run->mutex);
  run->all_done.wait(lock, [&] { return run->finished.load() == count; });
}

}  // namespace fatrain::ffi_glue
