// Self-test of the MSL emulator: layout and arithmetic of simdgroup
// operations, threadgroup memory and barriers, and that planted bugs
// (out-of-bounds write, missing barrier, uninitialised threadgroup memory,
// divergent simd op, absent optional buffer) are reported.
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

int msl_emulator_selftest(std::string* log) {
  g_log = log;
  failures = 0;
  test_mma("emu_mma_f32", 0);
  test_mma("emu_mma_bf16", 1);
  test_mma("emu_mma_f16", 2);
  test_simd_and_barrier();
  test_planted_bugs();
  if (failures) {
    emu_log("%d check(s) failed\n", failures);
  } else {
    emu_log("emulator self-test passed\n");
  }
  g_log = nullptr;
  return failures;
}
