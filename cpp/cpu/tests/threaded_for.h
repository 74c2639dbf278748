// A simple multithreaded ParallelFor for the standalone CPU test and
// benchmarks: `threads` threads (the caller among them) claim items
// dynamically.
#pragma once

#include <atomic>
#include <cstdint>
#include <thread>
#include <vector>

#include "../attention_cpu.h"

struct ThreadedFor {
  int threads;
  static void run(void* self, int64_t count, void (*body)(void*, int64_t), void* ctx) {
    const int nt = static_cast<ThreadedFor*>(self)->threads;
    std::atomic<int64_t> next{0};
    auto work = [&]() {
      for (;;) {
        const int64_t i = next.fetch_add(1);
        if (i >= count) break;
        body(ctx, i);
      }
    };
    std::vector<std::thread> pool;
    for (int t = 1; t < nt; ++t) pool.emplace_back(work);
    work();
    for (auto& th : pool) th.join();
  }
  fatrain::cpu::ParallelFor pf() {
    fatrain::cpu::ParallelFor p;
    p.run = &ThreadedFor::run;
    p.self = this;
    p.num_threads = threads;
    return p;
  }
};
