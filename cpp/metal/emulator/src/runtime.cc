// MSL emulator runtime: fiber scheduler, checked buffers, dispatch execution.
// See include/msl_emulator/runtime.h for the model.

#include "msl_emulator/runtime.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <map>
#include <memory>
#include <mutex>
#include <sstream>
#include <thread>

#if !defined(__x86_64__)
#include <ucontext.h>
#endif

namespace msl {
namespace rt {

// ---------------------------------------------------------------------------
// Kernel registry.
// ---------------------------------------------------------------------------
namespace {
std::map<std::string, const KernelEntry*>& registry() {
  static std::map<std::string, const KernelEntry*> r;
  return r;
}
std::mutex& registry_mutex() {
  static std::mutex m;
  return m;
}
}  // namespace

Registrar::Registrar(const KernelEntry* entries, int count) {
  std::lock_guard<std::mutex> lock(registry_mutex());
  for (int i = 0; i < count; ++i) registry()[entries[i].name] = &entries[i];
}

const KernelEntry* find_kernel(const std::string& name) {
  std::lock_guard<std::mutex> lock(registry_mutex());
  auto it = registry().find(name);
  return it == registry().end() ? nullptr : it->second;
}

std::vector<std::string> kernel_names() {
  std::lock_guard<std::mutex> lock(registry_mutex());
  std::vector<std::string> names;
  for (auto& kv : registry()) names.push_back(kv.first);
  return names;
}

void fail(const std::string& message) { throw KernelError(message); }

// ---------------------------------------------------------------------------
// Context switching.
// ---------------------------------------------------------------------------
#if defined(__x86_64__)
extern "C" void msl_emu_ctx_swap(void** save_sp, void* new_sp);
asm(R"(
.text
.p2align 4
.globl msl_emu_ctx_swap
.hidden msl_emu_ctx_swap
.type msl_emu_ctx_swap,@function
msl_emu_ctx_swap:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  subq $16, %rsp
  stmxcsr 8(%rsp)
  fnstcw (%rsp)
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  ldmxcsr 8(%rsp)
  fldcw (%rsp)
  addq $16, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
.size msl_emu_ctx_swap,.-msl_emu_ctx_swap
)");
#endif

namespace {

constexpr size_t kStackBytes = 512 * 1024;
constexpr size_t kThreadgroupMemoryLimit = 32 * 1024;

enum class FiberState { kRunnable, kWaitBarrier, kWaitSimd, kDone };

struct Group;

struct Fiber {
  // Saved context.
#if defined(__x86_64__)
  void* sp = nullptr;
#else
  ucontext_t uc;
#endif
  char* stack = nullptr;  // mmap'ed, guard page at the low end
  FiberState state = FiberState::kDone;
  SyncKind sync_kind = SyncKind::kSimdBarrier;
  const char* sync_what = "";
  // Builtins.
  Vec3u tid_in_tg{0, 0, 0};
  uint32_t index_in_tg = 0;
  uint32_t lane = 0;
  uint32_t simd_group = 0;
  // Per-thread counters.
  uint64_t simd_ops = 0;
  size_t tg_cursor = 0;
  Group* group = nullptr;
};

struct Dispatch;

// One threadgroup's execution state; reused by a worker for many threadgroups.
struct Group {
  const Dispatch* dispatch = nullptr;
  Vec3u tg_pos{0, 0, 0};
  std::vector<Fiber> fibers;
  std::vector<char> arena;  // threadgroup memory
  size_t static_tg_bytes = 0;
  // Simdgroup exchange: [simdgroup][parity][lane][kExchangeBytes].
  std::vector<char> exchange;
  std::string error;
#if defined(__x86_64__)
  void* scheduler_sp = nullptr;
#else
  ucontext_t scheduler_uc;
#endif
  std::vector<BufferInfo> infos;  // by buffer index
  std::vector<char> bytes_copy;   // setBytes data, copied per threadgroup
};

struct Dispatch {
  const KernelEntry* entry = nullptr;
  const DispatchSpec* spec = nullptr;
  uint32_t threads = 0;
  int max_index = -1;
};

thread_local Fiber* t_current = nullptr;

Fiber& cur() {
  if (t_current == nullptr) {
    throw std::logic_error("msl emulator: kernel builtin used outside a dispatch");
  }
  return *t_current;
}

void switch_to_scheduler(Fiber& f) {
#if defined(__x86_64__)
  msl_emu_ctx_swap(&f.sp, f.group->scheduler_sp);
#else
  swapcontext(&f.uc, &f.group->scheduler_uc);
#endif
}

void fiber_main() {
  Fiber& f = *t_current;
  try {
    f.group->dispatch->entry->run();
  } catch (const std::exception& e) {
    if (f.group->error.empty()) {
      std::ostringstream os;
      os << "kernel " << f.group->dispatch->entry->name << ", threadgroup ("
         << f.group->tg_pos.x << ", " << f.group->tg_pos.y << ", "
         << f.group->tg_pos.z << "), thread " << f.index_in_tg << " (simdgroup "
         << f.simd_group << ", lane " << f.lane << "): " << e.what();
      f.group->error = os.str();
    }
  }
  f.state = FiberState::kDone;
  switch_to_scheduler(f);
  std::abort();  // never resumed
}

#if !defined(__x86_64__)
void fiber_main_uc() { fiber_main(); }
#endif

char* allocate_stack() {
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  void* mem = mmap(nullptr, kStackBytes + page, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (mem == MAP_FAILED) throw std::runtime_error("msl emulator: cannot map a fiber stack");
  mprotect(mem, page, PROT_NONE);  // overflow faults instead of corrupting
  return static_cast<char*>(mem);
}

void start_fiber(Fiber& f) {
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  if (f.stack == nullptr) f.stack = allocate_stack();
#if defined(__x86_64__)
  uintptr_t top = reinterpret_cast<uintptr_t>(f.stack + page + kStackBytes) & ~uintptr_t(15);
  uint64_t* sp = reinterpret_cast<uint64_t*>(top);
  *--sp = 0;  // fake return address of fiber_main
  *--sp = reinterpret_cast<uint64_t>(&fiber_main);
  for (int i = 0; i < 6; ++i) *--sp = 0;  // rbp rbx r12 r13 r14 r15
  sp -= 2;
  uint32_t mxcsr;
  uint16_t fpucw;
  asm volatile("stmxcsr %0" : "=m"(mxcsr));
  asm volatile("fnstcw %0" : "=m"(fpucw));
  std::memcpy(reinterpret_cast<char*>(sp) + 8, &mxcsr, 4);
  std::memcpy(reinterpret_cast<char*>(sp), &fpucw, 2);
  f.sp = sp;
#else
  getcontext(&f.uc);
  f.uc.uc_stack.ss_sp = f.stack + page;
  f.uc.uc_stack.ss_size = kStackBytes;
  f.uc.uc_link = nullptr;
  makecontext(&f.uc, fiber_main_uc, 0);
#endif
  f.state = FiberState::kRunnable;
}

void resume(Group& g, Fiber& f) {
  t_current = &f;
#if defined(__x86_64__)
  msl_emu_ctx_swap(&g.scheduler_sp, f.sp);
#else
  swapcontext(&g.scheduler_uc, &f.uc);
#endif
  t_current = nullptr;
}

const char* kind_name(SyncKind k) {
  switch (k) {
    case SyncKind::kSimdReduce: return "simd reduction";
    case SyncKind::kSimdShuffle: return "simd shuffle";
    case SyncKind::kSimdMatrix: return "simdgroup_matrix operation";
    case SyncKind::kSimdBarrier: return "simdgroup_barrier";
  }
  return "?";
}

std::string where(const Group& g) {
  std::ostringstream os;
  os << "kernel " << g.dispatch->entry->name << ", threadgroup (" << g.tg_pos.x
     << ", " << g.tg_pos.y << ", " << g.tg_pos.z << ")";
  return os.str();
}

// Runs every thread of one threadgroup to completion (or the first error).
void run_group(Group& g) {
  const Dispatch& d = *g.dispatch;
  const DispatchSpec& s = *d.spec;
  const uint32_t n = d.threads;
  g.error.clear();
  // Threadgroup memory: poisoned (all-ones bytes are NaN in every float type).
  std::fill(g.arena.begin(), g.arena.end(), static_cast<char>(0xFF));
  std::fill(g.exchange.begin(), g.exchange.end(), static_cast<char>(0xFF));
  // setBytes data is per-encode constant memory; give each threadgroup a fresh
  // copy so a kernel writing through it cannot leak into later groups.
  {
    size_t off = 0;
    for (const auto& b : s.buffers) {
      if (!b.is_bytes) continue;
      std::memcpy(g.bytes_copy.data() + off, b.data, b.size);
      g.infos[b.index].base = g.bytes_copy.data() + off;
      off += (b.size + 15) & ~size_t(15);
    }
  }
  for (uint32_t i = 0; i < n; ++i) {
    Fiber& f = g.fibers[i];
    f.group = &g;
    f.index_in_tg = i;
    f.tid_in_tg = Vec3u{i % s.threadgroup.x, (i / s.threadgroup.x) % s.threadgroup.y,
                        i / (s.threadgroup.x * s.threadgroup.y)};
    f.lane = i % 32;
    f.simd_group = i / 32;
    f.simd_ops = 0;
    f.tg_cursor = s.threadgroup_memory_length;
    start_fiber(f);
  }
  const uint32_t num_sg = (n + 31) / 32;
  for (;;) {
    bool progressed = false;
    for (uint32_t i = 0; i < n; ++i) {
      Fiber& f = g.fibers[i];
      if (f.state != FiberState::kRunnable) continue;
      resume(g, f);
      progressed = true;
      if (!g.error.empty()) return;
    }
    // Barrier: every thread must be waiting at it.
    uint32_t at_barrier = 0, done = 0;
    for (uint32_t i = 0; i < n; ++i) {
      at_barrier += g.fibers[i].state == FiberState::kWaitBarrier;
      done += g.fibers[i].state == FiberState::kDone;
    }
    if (done == n) return;
    if (at_barrier > 0 && done > 0) {
      std::ostringstream os;
      os << where(g) << ": threadgroup_barrier reached by " << at_barrier << " of " << n
         << " threads while " << done
         << " threads already returned (a barrier must be reached by every thread of "
            "the threadgroup; on a GPU this hangs or corrupts memory)";
      g.error = os.str();
      return;
    }
    if (at_barrier == n) {
      for (uint32_t i = 0; i < n; ++i) g.fibers[i].state = FiberState::kRunnable;
      continue;
    }
    // Simdgroup operations: all lanes of the simdgroup must be waiting at one.
    for (uint32_t sg = 0; sg < num_sg; ++sg) {
      const uint32_t lo = sg * 32, hi = std::min(n, lo + 32);
      uint32_t waiting = 0, sg_done = 0, sg_barrier = 0;
      for (uint32_t i = lo; i < hi; ++i) {
        waiting += g.fibers[i].state == FiberState::kWaitSimd;
        sg_done += g.fibers[i].state == FiberState::kDone;
        sg_barrier += g.fibers[i].state == FiberState::kWaitBarrier;
      }
      if (waiting == 0) continue;
      const Fiber& first = [&]() -> const Fiber& {
        for (uint32_t i = lo; i < hi; ++i)
          if (g.fibers[i].state == FiberState::kWaitSimd) return g.fibers[i];
        return g.fibers[lo];
      }();
      if (sg_done > 0 || sg_barrier > 0) {
        std::ostringstream os;
        os << where(g) << ", simdgroup " << sg << ": " << kind_name(first.sync_kind)
           << " (" << first.sync_what << ") reached by " << waiting << " of "
           << (hi - lo) << " lanes while " << sg_done << " lanes returned and "
           << sg_barrier
           << " wait at a threadgroup_barrier (simdgroup operations need every lane)";
        g.error = os.str();
        return;
      }
      if (waiting == hi - lo) {
        for (uint32_t i = lo; i < hi; ++i) {
          const Fiber& f = g.fibers[i];
          if (f.sync_kind != first.sync_kind || f.simd_ops != first.simd_ops) {
            std::ostringstream os;
            os << where(g) << ", simdgroup " << sg << ": lanes diverged: lane " << first.lane
               << " is at " << kind_name(first.sync_kind) << " (" << first.sync_what
               << ", op #" << first.simd_ops << ") but lane " << f.lane << " is at "
               << kind_name(f.sync_kind) << " (" << f.sync_what << ", op #" << f.simd_ops
               << ")";
            g.error = os.str();
            return;
          }
        }
        for (uint32_t i = lo; i < hi; ++i) g.fibers[i].state = FiberState::kRunnable;
        progressed = true;
      }
    }
    if (!progressed) {
      std::ostringstream os;
      os << where(g) << ": deadlock: " << at_barrier << " threads wait at a "
         << "threadgroup_barrier while others wait at simdgroup operations";
      g.error = os.str();
      return;
    }
  }
}

std::string validate_and_prepare(const DispatchSpec& spec, Dispatch* d) {
  d->entry = find_kernel(spec.kernel);
  if (d->entry == nullptr) return "msl emulator: no kernel named '" + spec.kernel + "'";
  d->spec = &spec;
  const uint64_t threads =
      uint64_t(spec.threadgroup.x) * spec.threadgroup.y * spec.threadgroup.z;
  if (threads == 0 || threads > 1024) {
    return "kernel " + spec.kernel + ": threads per threadgroup must be 1..1024, got " +
           std::to_string(threads);
  }
  if (spec.grid.x == 0 || spec.grid.y == 0 || spec.grid.z == 0) {
    return "kernel " + spec.kernel + ": empty grid";
  }
  d->threads = static_cast<uint32_t>(threads);
  for (int i = 0; i < d->entry->used_constant_count; ++i) {
    const auto& c = d->entry->used_constants[i];
    bool found = false;
    for (const auto& v : spec.constants) found |= v.index == c.index;
    if (!found) {
      return "kernel " + spec.kernel + ": function constant " + c.name + " (index " +
             std::to_string(c.index) + ") is used by the kernel but has no value";
    }
  }
  for (const auto& b : spec.buffers) {
    if (b.index < 0 || b.index > 30) {
      return "kernel " + spec.kernel + ": buffer index " + std::to_string(b.index) +
             " out of range";
    }
    if (b.is_bytes && b.size > 4096) {
      return "kernel " + spec.kernel + ": setBytes data for buffer(" +
             std::to_string(b.index) + ") exceeds 4 KiB";
    }
    d->max_index = std::max(d->max_index, b.index);
  }
  if (spec.threadgroup_memory_length > kThreadgroupMemoryLimit) {
    return "kernel " + spec.kernel + ": threadgroup memory length exceeds 32 KiB";
  }
  return "";
}

struct Worker {
  std::unique_ptr<Group> group;
};

thread_local std::vector<Fiber>* t_fiber_cache = nullptr;

struct RunState {
  Dispatch dispatch;
  uint64_t total = 0;
  std::atomic<uint64_t> next{0};
  std::atomic<bool> failed{false};
  std::mutex mutex;
  std::string error;
};

void worker_body(void* context, int64_t) {
  auto& rs = *static_cast<RunState*>(context);
  const Dispatch& d = rs.dispatch;
  const DispatchSpec& s = *d.spec;
  Group g;
  g.dispatch = &d;
  // Reuse this OS thread's fiber stacks across dispatches.
  if (t_fiber_cache == nullptr) t_fiber_cache = new std::vector<Fiber>();
  std::vector<Fiber>& cache = *t_fiber_cache;
  if (cache.size() < d.threads) cache.resize(d.threads);
  g.fibers.swap(cache);
  g.arena.assign(kThreadgroupMemoryLimit, 0);
  g.exchange.assign(size_t((d.threads + 31) / 32) * 2 * 32 * kExchangeBytes, 0);
  g.infos.assign(size_t(d.max_index + 1), BufferInfo{});
  size_t bytes_total = 0;
  for (const auto& b : s.buffers) {
    BufferInfo& info = g.infos[b.index];
    info.kernel = d.entry->name;
    info.index = b.index;
    info.base = static_cast<char*>(b.data);
    info.size = b.size;
    if (b.is_bytes) bytes_total += (b.size + 15) & ~size_t(15);
  }
  g.bytes_copy.assign(bytes_total, 0);
  std::vector<ConstantValue> constants = s.constants;
  d.entry->set_constants(constants.data(), static_cast<int>(constants.size()));
  const uint64_t gx = s.grid.x, gy = s.grid.y;
  for (;;) {
    if (rs.failed.load()) break;
    const uint64_t i = rs.next.fetch_add(1);
    if (i >= rs.total) break;
    g.tg_pos = Vec3u{uint32_t(i % gx), uint32_t((i / gx) % gy), uint32_t(i / (gx * gy))};
    run_group(g);
    if (!g.error.empty()) {
      std::lock_guard<std::mutex> lock(rs.mutex);
      if (rs.error.empty()) rs.error = g.error;
      rs.failed = true;
      break;
    }
  }
  g.fibers.swap(cache);
}

void thread_run(void* self, int64_t count, void (*body)(void*, int64_t), void* context) {
  (void)self;
  std::vector<std::thread> threads;
  for (int64_t i = 1; i < count; ++i) threads.emplace_back(body, context, i);
  if (count > 0) body(context, 0);
  for (auto& t : threads) t.join();
}

}  // namespace

ParallelFor thread_parallel_for(int threads) {
  ParallelFor p;
  p.run = thread_run;
  p.num_threads = threads > 0 ? threads : std::max(1u, std::thread::hardware_concurrency());
  return p;
}

std::string run_dispatch(const DispatchSpec& spec, const ParallelFor& parallel) {
  RunState rs;
  std::string err = validate_and_prepare(spec, &rs.dispatch);
  if (!err.empty()) return err;
  rs.total = uint64_t(spec.grid.x) * spec.grid.y * spec.grid.z;
  int64_t workers = std::max<int64_t>(1, std::min<int64_t>(parallel.num_threads, rs.total));
  if (parallel.run == nullptr) workers = 1;
  if (workers == 1) {
    worker_body(&rs, 0);
  } else {
    parallel.run(parallel.self, workers, worker_body, &rs);
  }
  return rs.error;
}

// ---------------------------------------------------------------------------
// Kernel-side API.
// ---------------------------------------------------------------------------
void out_of_bounds(const BufferInfo* info, const void* address, size_t bytes) {
  std::ostringstream os;
  if (info == nullptr || info->base == nullptr) {
    os << "access through a pointer to an unbound buffer"
       << (info ? " (buffer(" + std::to_string(info->index) +
                      "), an optional parameter whose function constant is false)"
                : std::string());
  } else {
    const ptrdiff_t off = static_cast<const char*>(address) - info->base;
    os << "out-of-bounds access to buffer(" << info->index << ") at byte offset " << off
       << " (" << bytes << "-byte element; the buffer has " << info->size << " bytes)";
  }
  fail(os.str());
}

uint32_t builtin_scalar(Builtin b) {
  Fiber& f = cur();
  const DispatchSpec& s = *f.group->dispatch->spec;
  switch (b) {
    case Builtin::kThreadIndexInThreadgroup: return f.index_in_tg;
    case Builtin::kThreadIndexInSimdgroup: return f.lane;
    case Builtin::kSimdgroupIndexInThreadgroup: return f.simd_group;
    case Builtin::kThreadsPerSimdgroup: return 32;
    case Builtin::kSimdgroupsPerThreadgroup: return (f.group->dispatch->threads + 31) / 32;
    default: break;
  }
  Vec3u v = builtin_vec(b);
  (void)s;
  return v.x;
}

Vec3u builtin_vec(Builtin b) {
  Fiber& f = cur();
  const DispatchSpec& s = *f.group->dispatch->spec;
  const Vec3u tg = f.group->tg_pos;
  switch (b) {
    case Builtin::kThreadgroupPositionInGrid: return tg;
    case Builtin::kThreadPositionInThreadgroup: return f.tid_in_tg;
    case Builtin::kThreadPositionInGrid:
      return Vec3u{tg.x * s.threadgroup.x + f.tid_in_tg.x, tg.y * s.threadgroup.y + f.tid_in_tg.y,
                   tg.z * s.threadgroup.z + f.tid_in_tg.z};
    case Builtin::kThreadsPerThreadgroup:
      return Vec3u{s.threadgroup.x, s.threadgroup.y, s.threadgroup.z};
    case Builtin::kThreadgroupsPerGrid: return Vec3u{s.grid.x, s.grid.y, s.grid.z};
    case Builtin::kThreadsPerGrid:
      return Vec3u{s.grid.x * s.threadgroup.x, s.grid.y * s.threadgroup.y,
                   s.grid.z * s.threadgroup.z};
    default: {
      uint32_t v = builtin_scalar(b);
      return Vec3u{v, 0, 0};
    }
  }
}

const BufferInfo* buffer_info(int index, const char* param_name, bool optional_absent) {
  Fiber& f = cur();
  // An optional buffer whose function constant is false: any access fails.
  static const auto kAbsent = [] {
    std::vector<BufferInfo> v(31);
    for (int i = 0; i < 31; ++i) {
      v[i].kernel = "(optional buffer disabled by its function constant)";
      v[i].index = i;
    }
    return v;
  }();
  if (optional_absent) return &kAbsent[static_cast<size_t>(index) % 31];
  Group& g = *f.group;
  if (index < 0 || index >= static_cast<int>(g.infos.size()) ||
      g.infos[index].index != index) {
    fail(std::string("buffer(") + std::to_string(index) + ") for parameter '" + param_name +
         "' is not bound");
  }
  return &g.infos[index];
}

void* threadgroup_param(int index) {
  Fiber& f = cur();
  if (index != 0) fail("only [[threadgroup(0)]] is supported");
  if (f.group->dispatch->spec->threadgroup_memory_length == 0) {
    fail("[[threadgroup(0)]] parameter but the dispatch sets no threadgroup memory length");
  }
  return f.group->arena.data();
}

void* tg_alloc(size_t size, size_t align) {
  Fiber& f = cur();
  size_t off = (f.tg_cursor + align - 1) & ~(align - 1);
  if (off + size > kThreadgroupMemoryLimit) {
    fail("threadgroup memory exceeds 32 KiB (" + std::to_string(off + size) + " bytes)");
  }
  f.tg_cursor = off + size;
  return f.group->arena.data() + off;
}

uint32_t lane_id() { return cur().lane; }

char* simd_exchange_begin() {
  Fiber& f = cur();
  const size_t parity = f.simd_ops & 1;
  f.simd_ops++;
  return f.group->exchange.data() +
         ((size_t(f.simd_group) * 2 + parity) * 32 + f.lane) * kExchangeBytes;
}

const char* simd_exchange_peer(int lane) {
  Fiber& f = cur();
  const size_t parity = (f.simd_ops - 1) & 1;
  return f.group->exchange.data() +
         ((size_t(f.simd_group) * 2 + parity) * 32 + size_t(lane)) * kExchangeBytes;
}

void simd_sync(SyncKind kind, const char* what) {
  Fiber& f = cur();
  f.state = FiberState::kWaitSimd;
  f.sync_kind = kind;
  f.sync_what = what;
  switch_to_scheduler(f);
}

void threadgroup_barrier_sync() {
  Fiber& f = cur();
  f.state = FiberState::kWaitBarrier;
  switch_to_scheduler(f);
}

}  // namespace rt
}  // namespace msl
