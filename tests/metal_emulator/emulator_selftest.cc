// Self-test of the MSL emulator: layout and arithmetic of simdgroup
// operations, threadgroup memory and barriers, and that planted bugs
// (out-of-bounds write, missing barrier, uninitialised threadgroup memory,
// divergent simd op, absent optional buffer, threadgroup-memory races and
// out-of-bounds threadgroup accesses) are reported; the cost counters of
// kernels whose costs are known by construction, and sampling.
// msl_emulator_selftest() returns the number of failed checks and a log; it
// is exposed by the metal_emulated extension (and run by
// tests/test_metal_emulator.py); selftest_main.cc wraps it as a program.

#include <cmath>
#include <cstdarg>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "msl_emulator/runtime.h"

using msl::rt::BufferBinding;
using msl::rt::DispatchSpec;

static int failures = 0;
static std::string* g_log = nullptr;

static void emu_log(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
static void emu_log(const char* fmt, ...) {
  char buf[2048];
  va_list args;
  va_start(args, fmt);
  std::vsnprintf(buf, sizeof(buf), fmt, args);
  va_end(args);
  if (g_log) *g_log += buf;
}

#define CHECK(cond, ...)                                 \
  do {                                                   \
    if (!(cond)) {                                       \
      emu_log("FAIL %s:%d: ", __FILE__, __LINE__);          \
      emu_log(__VA_ARGS__);                                 \
      emu_log("\n");                                        \
      ++failures;                                        \
    }                                                    \
  } while (0)

static BufferBinding buf(int index, void* data, size_t size) {
  BufferBinding b;
  b.index = index;
  b.data = data;
  b.size = size;
  return b;
}

static uint16_t to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u += 0x7FFF + ((u >> 16) & 1);
  return uint16_t(u >> 16);
}

static msl::rt::ParallelFor threads() { return msl::rt::thread_parallel_for(2); }

static void test_mma(const char* kernel, int kind) {
  float a[64], b[64];
  for (int i = 0; i < 64; ++i) {
    a[i] = float((i * 7) % 13) - 6.0f;
    b[i] = float((i * 5) % 11) - 5.0f;
  }
  std::vector<unsigned char> abuf(64 * 4), bbuf(64 * 4);
  for (int i = 0; i < 64; ++i) {
    if (kind == 0) {
      std::memcpy(&abuf[i * 4], &a[i], 4);
      std::memcpy(&bbuf[i * 4], &b[i], 4);
    } else if (kind == 1) {
      uint16_t x = to_bf16(a[i]), y = to_bf16(b[i]);
      std::memcpy(&abuf[i * 2], &x, 2);
      std::memcpy(&bbuf[i * 2], &y, 2);
    } else {
      _Float16 x = (_Float16)a[i], y = (_Float16)b[i];
      std::memcpy(&abuf[i * 2], &x, 2);
      std::memcpy(&bbuf[i * 2], &y, 2);
    }
  }
  const size_t esize = kind == 0 ? 4 : 2;
  std::vector<float> c(128, -1.0f), lanes(64, -1.0f);
  DispatchSpec s;
  s.kernel = kernel;
  s.buffers = {buf(0, abuf.data(), 64 * esize), buf(1, bbuf.data(), 64 * esize),
               buf(2, c.data(), c.size() * 4), buf(3, lanes.data(), lanes.size() * 4)};
  s.grid = {1, 1, 1};
  s.threadgroup = {32, 1, 1};
  std::string err = msl::rt::run_dispatch(s, threads());
  CHECK(err.empty(), "%s: %s", kernel, err.c_str());
  for (int r = 0; r < 8; ++r) {
    for (int col = 0; col < 8; ++col) {
      float want = a[r * 8 + col];
      for (int k = 0; k < 8; ++k) want += a[r * 8 + k] * b[k * 8 + col];
      CHECK(c[r * 8 + col] == want, "%s C[%d][%d] = %g, want %g", kernel, r, col,
            c[r * 8 + col], want);
      CHECK(c[64 + r * 8 + col] == a[col * 8 + r], "%s A^T[%d][%d]", kernel, r, col);
    }
  }
  // Apple's per-lane layout: lane l holds row fm, columns fn and fn+1.
  for (int l = 0; l < 32; ++l) {
    const int qid = l / 4, fm = (qid & 4) + ((l / 2) % 4), fn = (qid & 2) * 2 + (l % 2) * 2;
    CHECK(lanes[2 * l] == a[fm * 8 + fn] && lanes[2 * l + 1] == a[fm * 8 + fn + 1],
          "%s lane %d layout", kernel, l);
  }
}

static void test_simd_and_barrier() {
  const int groups = 3, n = 128;
  std::vector<float> x(groups * n), out(groups * n * 5, 0.0f);
  for (int i = 0; i < groups * n; ++i) x[i] = float((i * 37) % 101) * 0.5f;
  uint32_t count = n;
  for (int negate = 0; negate < 2; ++negate) {
    DispatchSpec s;
    s.kernel = "emu_simd_and_barrier";
    s.constants = {{10, double(negate)}};
    BufferBinding bytes = buf(2, &count, 4);
    bytes.is_bytes = true;
    s.buffers = {buf(0, x.data(), x.size() * 4), buf(1, out.data(), out.size() * 4), bytes};
    s.grid = {groups, 1, 1};
    s.threadgroup = {n, 1, 1};
    std::string err = msl::rt::run_dispatch(s, threads());
    CHECK(err.empty(), "simd_and_barrier: %s", err.c_str());
    const float r = negate ? -1.0f : 1.0f;
    for (int g = 0; g < groups; ++g) {
      for (int t = 0; t < n; ++t) {
        const float* o = &out[(g * n + t) * 5];
        const int sg0 = g * n + (t / 32) * 32, lane = t % 32;
        float sum = 0, mx = -1e30f;
        for (int l = 0; l < 32; ++l) {
          sum += x[sg0 + l];
          mx = std::max(mx, x[sg0 + l]);
        }
        CHECK(o[0] == r * x[g * n + (t + 1) % n], "neighbour g%d t%d", g, t);
        CHECK(std::fabs(o[1] - r * sum) < 1e-3f, "simd_sum g%d t%d: %g vs %g", g, t, o[1], sum);
        CHECK(o[2] == r * mx, "simd_max g%d t%d", g, t);
        CHECK(o[3] == r * x[sg0 + (lane ^ 5)], "shuffle_xor g%d t%d", g, t);
        CHECK(o[4] == r * x[lane < 31 ? sg0 + lane + 1 : sg0 + lane], "shuffle_down g%d t%d", g, t);
      }
    }
  }
  // A function constant the kernel uses must be given a value.
  DispatchSpec s;
  s.kernel = "emu_simd_and_barrier";
  s.grid = {1, 1, 1};
  s.threadgroup = {n, 1, 1};
  std::string err = msl::rt::run_dispatch(s, threads());
  CHECK(err.find("function constant negate_out") != std::string::npos, "missing constant: %s",
        err.c_str());
}

static std::string run_bug(const char* kernel, int threads_x, std::vector<float>& out,
                           int groups = 1) {
  DispatchSpec s;
  s.kernel = kernel;
  s.buffers = {buf(0, out.data(), out.size() * 4)};
  s.grid = {uint32_t(groups), 1, 1};
  s.threadgroup = {uint32_t(threads_x), 1, 1};
  return msl::rt::run_dispatch(s, threads());
}

static void test_planted_bugs() {
  {
    std::vector<float> out(64);
    std::string err = run_bug("emu_bug_oob_write", 32, out, 2);
    emu_log("oob write -> %s\n", err.c_str());
    CHECK(err.find("out-of-bounds access to buffer(0) at byte offset 256") != std::string::npos &&
              err.find("emu_bug_oob_write") != std::string::npos,
          "oob write not reported: %s", err.c_str());
  }
  {
    std::vector<float> out(64);
    std::string err = run_bug("emu_bug_missing_barrier", 64, out);
    emu_log("missing barrier -> %s\n", err.c_str());
    CHECK(err.find("threadgroup_barrier reached by 32 of 64 threads") != std::string::npos,
          "missing barrier not reported: %s", err.c_str());
  }
  {
    std::vector<float> out(64, 0.0f);
    std::string err = run_bug("emu_bug_uninitialized_threadgroup", 64, out);
    CHECK(err.empty(), "uninitialized: %s", err.c_str());
    int nans = 0;
    for (float v : out) nans += std::isnan(v);
    emu_log("uninitialized threadgroup memory -> %d NaN outputs\n", nans);
    CHECK(nans == 32, "poison did not reach the output: %d NaNs", nans);
  }
  {
    std::vector<float> out(32);
    std::string err = run_bug("emu_bug_divergent_simd", 32, out);
    emu_log("divergent simd -> %s\n", err.c_str());
    CHECK(err.find("simd_sum") != std::string::npos && err.find("16 of 32 lanes") != std::string::npos,
          "divergent simd not reported: %s", err.c_str());
  }
  {
    std::vector<float> out(32);
    std::string err = run_bug("emu_bug_absent_optional", 32, out);
    emu_log("absent optional buffer -> %s\n", err.c_str());
    CHECK(err.find("unbound buffer") != std::string::npos, "absent optional: %s", err.c_str());
  }
  {
    std::vector<float> out(32);
    std::string err = run_bug("no_such_kernel", 32, out);
    CHECK(err.find("no kernel named") != std::string::npos, "unknown kernel: %s", err.c_str());
  }
}

static std::string run_with(const char* kernel, uint32_t threads_x, uint32_t groups,
                            std::vector<BufferBinding> buffers, msl::rt::DispatchStats* stats,
                            size_t tg_memory = 0, msl::rt::Sampling sample = {}) {
  DispatchSpec s;
  s.kernel = kernel;
  s.buffers = std::move(buffers);
  s.grid = {groups, 1, 1};
  s.threadgroup = {threads_x, 1, 1};
  s.threadgroup_memory_length = tg_memory;
  s.sample = sample;
  return msl::rt::run_dispatch(s, threads(), stats);
}

static BufferBinding bytes_of(int index, uint32_t* value) {
  BufferBinding b = buf(index, value, 4);
  b.is_bytes = true;
  return b;
}

static void test_race_detector() {
  {
    std::vector<float> out(64);
    std::string err = run_with("emu_race_missing_barrier", 64, 1, {buf(0, out.data(), 256)}, nullptr);
    emu_log("missing barrier between write and read -> %s\n", err.c_str());
    CHECK(err.find("race on threadgroup memory `partial` bytes [128, 132) of 256: read by thread 0 "
                   "(simdgroup 0, lane 0) and write by thread 32 (simdgroup 1, lane 0) with no "
                   "threadgroup_barrier(mem_flags::mem_threadgroup) between them") != std::string::npos,
          "missing-barrier race not reported: %s", err.c_str());
  }
  // Without a barrier lane 0 reads slot 1 before lane 1 writes it; with
  // simdgroup_barrier(mem_none) all lanes write first (a fiber switch), and
  // the barrier orders no memory.
  const char* want_simd[4] = {
      "race on threadgroup memory `slots` bytes [4, 8) of 128: read by thread 0 (simdgroup 0, "
      "lane 0) and write by thread 1 (simdgroup 0, lane 1) of the same simdgroup with no "
      "simdgroup_barrier(mem_flags::mem_threadgroup) or threadgroup_barrier between them",
      nullptr,
      "race on threadgroup memory `slots` bytes [4, 8) of 128: write by thread 1 (simdgroup 0, "
      "lane 1) and read by thread 0 (simdgroup 0, lane 0) of the same simdgroup with no "
      "simdgroup_barrier(mem_flags::mem_threadgroup) or threadgroup_barrier between them",
      nullptr};
  for (uint32_t mode = 0; mode < 4; ++mode) {
    std::vector<float> out(32, -1.0f);
    uint32_t m = mode;
    std::string err =
        run_with("emu_simd_exchange", 32, 1, {buf(0, out.data(), 128), bytes_of(1, &m)}, nullptr);
    const bool racy = mode == 0 || mode == 2;
    if (mode == 0) emu_log("simdgroup exchange without simdgroup_barrier -> %s\n", err.c_str());
    if (racy) {
      CHECK(err.find(want_simd[mode]) != std::string::npos, "simd race (mode %u) not reported: %s", mode,
            err.c_str());
    } else {
      CHECK(err.empty(), "simd exchange mode %u: %s", mode, err.c_str());
      for (int l = 0; l < 32; ++l) CHECK(out[l] == float(l ^ 1) * 2.0f, "exchange lane %d", l);
    }
  }
  {
    // Counting instead of failing: the dispatch completes and reports.
    std::vector<float> out(64);
    msl::rt::DispatchStats st;
    std::string err = run_with("emu_race_missing_barrier", 64, 2, {buf(0, out.data(), 256)}, &st);
    CHECK(err.empty(), "counted race: %s", err.c_str());
    // Each of threads 32..63 races twice (its write to a slot thread t - 32
    // read, its read of the slot thread t - 32 wrote), in both threadgroups.
    CHECK(st.races == 128, "races counted: %llu", (unsigned long long)st.races);
    CHECK(!st.race_reports.empty() &&
              st.race_reports[0].find("emu_race_missing_barrier") != std::string::npos &&
              st.race_reports[0].find("race on threadgroup memory `partial`") != std::string::npos,
          "race report: %s", st.race_reports.empty() ? "" : st.race_reports[0].c_str());
  }
  {
    std::vector<float> out(128);
    std::string err = run_with("emu_bug_tg_out_of_bounds", 128, 1, {buf(0, out.data(), 512)}, nullptr);
    emu_log("threadgroup tile overrun -> %s\n", err.c_str());
    CHECK(err.find("out-of-bounds threadgroup memory write of 4 bytes: byte offset 512 of `tile` "
                   "(512 bytes)") != std::string::npos &&
              err.find("thread 96 (simdgroup 3, lane 0)") != std::string::npos,
          "threadgroup overrun not reported: %s", err.c_str());
  }
}

static void test_tg_staging() {
  std::vector<float> x(512), out(513, -1.0f);
  float sum = 0.0f;
  for (int i = 0; i < 512; ++i) {
    x[i] = float((i * 13) % 29) - 14.0f;  // exact in half
    sum += 2.0f * x[i];
  }
  msl::rt::DispatchStats st;
  std::string err = run_with("emu_tg_staging", 64, 1,
                             {buf(0, x.data(), x.size() * 4), buf(1, out.data(), out.size() * 4)},
                             &st, 2048);
  CHECK(err.empty(), "tg staging: %s", err.c_str());
  for (int sg = 0; sg < 2; ++sg) {
    for (int blk = 0; blk < 4; ++blk) {
      for (int r = 0; r < 8; ++r) {
        for (int c = 0; c < 8; ++c) {
          const float want = 2.0f * x[(sg * 8 + c) * 32 + blk * 8 + r];
          const float got = out[sg * 256 + blk * 64 + r * 8 + c];
          CHECK(got == want, "staging sg%d blk%d (%d,%d): %g vs %g", sg, blk, r, c, got, want);
        }
      }
    }
  }
  CHECK(out[512] == sum, "staging sum %g vs %g", out[512], sum);
  // Counters, from the kernel's source (see emulator_test_kernels.metal).
  CHECK(st.races == 0, "staging races: %llu", (unsigned long long)st.races);
  CHECK(st.tg_bytes_written == 6148 && st.tg_bytes_read == 7172, "tg bytes: w %llu r %llu",
        (unsigned long long)st.tg_bytes_written, (unsigned long long)st.tg_bytes_read);
  CHECK(st.peak_tg_bytes == 3076, "peak tg: %llu", (unsigned long long)st.peak_tg_bytes);
  CHECK(st.barriers == 3 && st.simd_barriers == 2, "barriers %llu simd %llu",
        (unsigned long long)st.barriers, (unsigned long long)st.simd_barriers);
  CHECK(st.device_bytes_read == 2048 && st.device_bytes_written == 2052, "device bytes r %llu w %llu",
        (unsigned long long)st.device_bytes_read, (unsigned long long)st.device_bytes_written);
  CHECK(st.device_load_instrs == 16 && st.device_store_instrs == 17, "instrs ld %llu st %llu",
        (unsigned long long)st.device_load_instrs, (unsigned long long)st.device_store_instrs);
  CHECK(st.device_lines64 == 256 + 33 && st.device_lines128 == 128 + 17, "lines %llu %llu",
        (unsigned long long)st.device_lines64, (unsigned long long)st.device_lines128);
  CHECK(st.simdgroup_mma == 0 && st.threadgroups_executed == 1 && st.threadgroups_total == 1 &&
            st.threads_per_threadgroup == 64 && st.sampled_fraction == 1.0,
        "staging launch counters");
}

static void test_counters_and_sampling() {
  const uint32_t groups = 4;
  for (uint32_t stride : {1u, 32u}) {
    std::vector<float> x(size_t(groups) * 64 * stride, 1.0f), out(groups * 64, 0.0f);
    uint32_t st_bytes = stride;
    auto bufs = [&] {
      return std::vector<BufferBinding>{buf(0, x.data(), x.size() * 4),
                                        buf(1, out.data(), out.size() * 4), bytes_of(2, &st_bytes)};
    };
    msl::rt::DispatchStats full;
    std::string err = run_with("emu_count_accesses", 64, groups, bufs(), &full);
    CHECK(err.empty(), "count accesses: %s", err.c_str());
    // Per simdgroup: one load of 32 floats, stride apart; one contiguous
    // 128-byte store; two MMAs. The setBytes stride is not device traffic.
    const uint64_t sgs = groups * 2;
    const uint64_t load_lines64 = stride == 1 ? 2 : 32, load_lines128 = stride == 1 ? 1 : 32;
    CHECK(full.simdgroup_mma == 2 * sgs, "mma %llu", (unsigned long long)full.simdgroup_mma);
    CHECK(full.device_bytes_read == sgs * 128 && full.device_bytes_written == sgs * 128,
          "bytes r %llu w %llu", (unsigned long long)full.device_bytes_read,
          (unsigned long long)full.device_bytes_written);
    CHECK(full.device_load_instrs == sgs && full.device_store_instrs == sgs, "instrs %llu %llu",
          (unsigned long long)full.device_load_instrs, (unsigned long long)full.device_store_instrs);
    CHECK(full.device_lines64 == sgs * (load_lines64 + 2) &&
              full.device_lines128 == sgs * (load_lines128 + 1),
          "stride %u lines %llu %llu", stride, (unsigned long long)full.device_lines64,
          (unsigned long long)full.device_lines128);
    CHECK(full.tg_bytes_read == 0 && full.barriers == 0 && full.peak_tg_bytes == 0 &&
              full.threadgroups_executed == groups && full.sampled_fraction == 1.0,
          "count accesses launch counters");
    // Sampling: every threadgroup costs the same, so the scaled sample equals
    // the full run; only half the outputs are written.
    for (int how = 0; how < 2; ++how) {
      msl::rt::Sampling sample;
      if (how == 0) sample.max_threadgroups = 2;
      else sample.fraction = 0.5;
      std::fill(out.begin(), out.end(), -7.0f);
      msl::rt::DispatchStats part;
      err = run_with("emu_count_accesses", 64, groups, bufs(), &part, 0, sample);
      CHECK(err.empty(), "sampled: %s", err.c_str());
      CHECK(part.threadgroups_executed == 2 && part.threadgroups_total == groups &&
                part.sampled_fraction == 0.5,
            "sampled launch: %llu of %llu", (unsigned long long)part.threadgroups_executed,
            (unsigned long long)part.threadgroups_total);
#define SAME(name) \
  CHECK(part.name == full.name, "sampled " #name ": %llu vs %llu", \
        (unsigned long long)part.name, (unsigned long long)full.name);
      SAME(simdgroup_mma) SAME(device_bytes_read) SAME(device_bytes_written)
      SAME(device_load_instrs) SAME(device_store_instrs) SAME(device_lines64)
      SAME(device_lines128)
#undef SAME
      // Threadgroups 0 and 3 (the centres of the strata [0, 2) and [2, 4),
      // alternately below and above) ran.
      for (uint32_t g = 0; g < groups; ++g) {
        CHECK((out[g * 64] != -7.0f) == (g == 0 || g == 3), "sampled group %u ran: %d", g,
              int(out[g * 64] != -7.0f));
      }
    }
  }
}

int msl_emulator_selftest(std::string* log) {
  g_log = log;
  failures = 0;
  test_mma("emu_mma_f32", 0);
  test_mma("emu_mma_bf16", 1);
  test_mma("emu_mma_f16", 2);
  test_simd_and_barrier();
  test_planted_bugs();
  test_race_detector();
  test_tg_staging();
  test_counters_and_sampling();
  if (failures) {
    emu_log("%d check(s) failed\n", failures);
  } else {
    emu_log("emulator self-test passed\n");
  }
  g_log = nullptr;
  return failures;
}
