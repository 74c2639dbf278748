// MSL emulator runtime: fiber scheduler, checked buffers, dispatch execution.
// See include/msl_emulator/runtime.h for the model.

#include "msl_emulator/runtime.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <map>
#include <memory>
#include <mutex>
#include <sstream>
#include <thread>
#include <unordered_map>

// Built with AddressSanitizer: the fiber stacks' shadow is reset before reuse.
#if defined(__SANITIZE_ADDRESS__)
#define MSL_EMU_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define MSL_EMU_ASAN 1
#endif
#endif
#if defined(MSL_EMU_ASAN)
#include <sanitizer/asan_interface.h>
#endif

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

std::atomic<int> g_counting_dispatches{0};

namespace {

constexpr size_t kStackBytes = 512 * 1024;
constexpr size_t kThreadgroupMemoryLimit = 32 * 1024;
// Threadgroup variables are laid out in the emulator's arena with a red zone
// before each, so that an access running off a variable hits no other
// variable and is reported. Offsets the kernel can observe (within one
// variable) and the byte count against the 32 KiB limit are unaffected.
constexpr size_t kRedZone = 256;
constexpr size_t kMaxThreadgroupVariables = 64;
constexpr size_t kArenaBytes = kThreadgroupMemoryLimit + kRedZone * (kMaxThreadgroupVariables + 1);
constexpr size_t kGranule = 16;  // threadgroup variables start at 16-byte boundaries

// One device access of one lane, kept until the simdgroup's next
// synchronisation, when the lanes' accesses are grouped into instructions.
struct DeviceAccess {
  const void* site;   // return address of the hook: the access site
  uint64_t offset;    // (buffer index << 48) | byte offset in the buffer
  uint32_t bytes;
  uint32_t group;     // instruction group serial (InstrGroup), 0: none
  bool store;
};

// Race-detector state of one threadgroup-memory byte within the current
// barrier interval (`epoch`): its last writer and up to two readers, each as
// an access word (thread index + 1) | (its simdgroup's count of ordering
// simdgroup_barriers) << 16; 0 = none.
struct Shadow {
  uint32_t epoch;
  uint32_t writer, reader1, reader2;
};
static_assert(sizeof(Shadow) == 16, "Shadow is 16 bytes");

struct TgVariable {
  const char* name;
  size_t offset;  // in the arena
  size_t size;
};

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
  bool sync_orders_tg = false;  // the barrier being waited at has mem_threadgroup
  // Builtins.
  Vec3u tid_in_tg{0, 0, 0};
  uint32_t index_in_tg = 0;
  uint32_t lane = 0;
  uint32_t simd_group = 0;
  // Per-thread counters.
  uint64_t simd_ops = 0;
  size_t tg_cursor = 0;  // threadgroup bytes allocated (what counts against 32 KiB)
  size_t tg_arena = 0;   // arena offset of the next allocation (with red zones)
  Group* group = nullptr;
  // The group's threadgroup-memory tables, here for tg_access's fast path.
  uintptr_t tg_base = 0;
  size_t tg_size = 0;
  const uint32_t* tg_granule_end = nullptr;
  Shadow* tg_shadow = nullptr;
  // Counting: this lane's device accesses since its simdgroup last synchronised.
  std::vector<DeviceAccess> device_log;
  uint32_t instr_groups = 0;  // InstrGroups begun since then
  uint32_t instr_group = 0;   // the open one's serial, 0: none
  int instr_group_depth = 0;
};

struct Dispatch;

// One threadgroup's execution state; reused by a worker for many threadgroups.
struct Group {
  const Dispatch* dispatch = nullptr;
  Vec3u tg_pos{0, 0, 0};
  std::vector<Fiber> fibers;
  std::vector<char> arena;  // threadgroup memory (kArenaBytes)
  // Threadgroup variables of the running threadgroup, and which one owns each
  // 16-byte granule of the arena (index + 1; 0: red zone or unallocated).
  std::vector<TgVariable> variables;
  std::vector<uint16_t> granule_owner;
  std::vector<uint32_t> granule_end;  // end offset of the owner (0: none)
  // Race detector: one Shadow per arena byte; `epoch` numbers barrier
  // intervals (unique over this worker's threadgroups, so the shadow needs no
  // clearing); simd_epoch counts each simdgroup's ordering simdgroup_barriers.
  std::vector<Shadow> shadow;
  uint32_t epoch = 0;
  std::vector<uint16_t> simd_epoch;
  bool races_fatal = true;
  // Counting (DispatchStats requested).
  bool counting = false;
  DispatchStats stats;  // this worker's threadgroups, unscaled
  std::vector<std::pair<std::pair<const void*, uint64_t>, uint64_t>> instr_lines;  // scratch
  std::vector<uint64_t> interval_lines;  // scratch: (line128 << 1) | store
  std::vector<uint64_t> tg_line_log;     // this threadgroup's 128-byte lines (tg_lines)
  std::unordered_map<const void*, uint32_t> site_counts;                          // scratch
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
  bool counting = false;
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
#if defined(MSL_EMU_ASAN)
  // A finished fiber never returns from fiber_main, so the red zones of the
  // frames it left on this stack stay poisoned; the new fiber starts on a
  // clean stack, as it would on a fresh mapping.
  ASAN_UNPOISON_MEMORY_REGION(f.stack + page, kStackBytes);
#endif
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

std::string thread_where(const Group& g, uint32_t index_in_tg) {
  std::ostringstream os;
  os << "thread " << index_in_tg << " (simdgroup " << index_in_tg / 32 << ", lane "
     << index_in_tg % 32 << ")";
  return os.str();
}

// Starts a new barrier interval: every byte's race-detector state is stale.
void new_epoch(Group& g) {
  if (++g.epoch == 0) {  // wrapped: stale states could look current
    std::fill(g.shadow.begin(), g.shadow.end(), Shadow{});
    g.epoch = 1;
  }
}

void register_variable(Group& g, const char* name, size_t offset, size_t size) {
  if (size == 0) return;
  g.variables.push_back(TgVariable{name, offset, size});
  const uint16_t id = static_cast<uint16_t>(g.variables.size());
  for (size_t q = offset / kGranule; q <= (offset + size - 1) / kGranule; ++q) {
    g.granule_owner[q] = id;
    g.granule_end[q] = static_cast<uint32_t>(offset + size);
  }
}

// Groups the device accesses the lanes of each simdgroup made since their
// last synchronisation into simdgroup-wide instructions, and counts the
// distinct 64- and 128-byte lines each instruction touches. An instruction is
// the k-th execution of one access site by the lanes (or one InstrGroup).
// Also counts the distinct 128-byte lines of the whole interval.
void flush_device_accesses(Group& g) {
  const uint32_t n = g.dispatch->threads;
  auto& lines = g.instr_lines;
  auto& merged = g.interval_lines;
  for (uint32_t lo = 0; lo < n; lo += 32) {
    const uint32_t hi = std::min(n, lo + 32);
    lines.clear();
    merged.clear();
    for (uint32_t i = lo; i < hi; ++i) {
      Fiber& f = g.fibers[i];
      f.instr_groups = 0;
      if (f.device_log.empty()) continue;
      g.site_counts.clear();
      for (const DeviceAccess& a : f.device_log) {
        // Key: (site, occurrence << 2 | is_group << 1 | store).
        const uint64_t k = a.group != 0 ? a.group : g.site_counts[a.site]++;
        const std::pair<const void*, uint64_t> key{a.site,
                                                   (k << 2) | (a.group != 0 ? 2u : 0u) | a.store};
        for (uint64_t l = a.offset >> 6; l <= (a.offset + a.bytes - 1) >> 6; ++l) {
          lines.push_back({key, l});
        }
        for (uint64_t l = a.offset >> 7; l <= (a.offset + a.bytes - 1) >> 7; ++l) {
          merged.push_back((l << 1) | uint64_t(a.store));
          g.tg_line_log.push_back(l);
        }
      }
      f.device_log.clear();
    }
    if (lines.empty()) continue;
    std::sort(merged.begin(), merged.end());
    g.stats.device_lines128_merged +=
        uint64_t(std::unique(merged.begin(), merged.end()) - merged.begin());
    std::sort(lines.begin(), lines.end());
    for (size_t i = 0; i < lines.size();) {
      uint64_t l64 = 0, l128 = 0, prev64 = ~uint64_t(0), prev128 = ~uint64_t(0);
      size_t j = i;
      for (; j < lines.size() && lines[j].first == lines[i].first; ++j) {
        if (lines[j].second != prev64) ++l64, prev64 = lines[j].second;
        if ((lines[j].second >> 1) != prev128) ++l128, prev128 = lines[j].second >> 1;
      }
      if (lines[i].first.second & 1) {
        ++g.stats.device_store_instrs;
      } else {
        ++g.stats.device_load_instrs;
      }
      g.stats.device_lines64 += l64;
      g.stats.device_lines128 += l128;
      i = j;
    }
  }
}

// Runs every thread of one threadgroup to completion (or the first error).
void run_group(Group& g) {
  const Dispatch& d = *g.dispatch;
  const DispatchSpec& s = *d.spec;
  const uint32_t n = d.threads;
  g.error.clear();
  g.tg_line_log.clear();
  // Threadgroup memory: poisoned (all-ones bytes are NaN in every float type).
  std::fill(g.arena.begin(), g.arena.end(), static_cast<char>(0xFF));
  new_epoch(g);
  std::fill(g.simd_epoch.begin(), g.simd_epoch.end(), uint16_t(0));
  g.variables.clear();
  std::fill(g.granule_owner.begin(), g.granule_owner.end(), uint16_t(0));
  std::fill(g.granule_end.begin(), g.granule_end.end(), 0u);
  register_variable(g, "[[threadgroup(0)]] memory", kRedZone, s.threadgroup_memory_length);
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
    f.tg_arena = kRedZone + s.threadgroup_memory_length;
    f.tg_base = reinterpret_cast<uintptr_t>(g.arena.data());
    f.tg_size = g.arena.size();
    f.tg_granule_end = g.granule_end.data();
    f.tg_shadow = g.shadow.data();
    f.device_log.clear();
    f.instr_groups = f.instr_group = 0;
    f.instr_group_depth = 0;
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
    if (g.counting) flush_device_accesses(g);
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
      bool orders_tg = false;
      for (uint32_t i = 0; i < n; ++i) {
        g.fibers[i].state = FiberState::kRunnable;
        orders_tg |= g.fibers[i].sync_orders_tg;
      }
      if (orders_tg) new_epoch(g);
      if (g.counting) ++g.stats.barriers;
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
        if (first.sync_kind == SyncKind::kSimdBarrier) {
          if (first.sync_orders_tg) ++g.simd_epoch[sg];
          if (g.counting) ++g.stats.simd_barriers;
        } else if (g.counting && first.sync_kind == SyncKind::kSimdShuffle) {
          ++g.stats.simd_shuffles;
        } else if (g.counting && first.sync_kind == SyncKind::kSimdReduce) {
          ++g.stats.simd_reductions;
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
  if (d->entry->declared_max_threads && threads > d->entry->max_threads) {
    return "kernel " + spec.kernel + ": " + std::to_string(threads) +
           " threads per threadgroup exceed the kernel's max_total_threads_per_threadgroup(" +
           std::to_string(d->entry->max_threads) + ")";
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
  if (!(spec.sample.fraction > 0.0)) {
    return "kernel " + spec.kernel + ": the sampled fraction of threadgroups must be positive";
  }
  return "";
}

// Index of the representative of stratum i when [0, n) is cut into k equal
// strata: its centre, or for an even-sized stratum alternately the element
// below and above the centre, so that a linear trend (causal work along the
// query tiles) averages out.
uint64_t stratum_pick(uint64_t i, uint64_t k, uint64_t n) {
  const uint64_t a = i * n / k, size = (i + 1) * n / k - a;
  return a + (size - 1) / 2 + (size % 2 == 0 && i % 2 == 1 ? 1 : 0);
}

// The linear indices (x + gx * (y + gy * z)) of a sample's threadgroups:
// round(fraction * total) of them (at most max_threadgroups if set, at least
// one), one per stratum of x and, for each x, one per stratum of the (y, z)
// pairs, rotated by the x stratum so that different x see different heads
// and batches. Empty: run all.
std::vector<uint64_t> sample_threadgroups(const Size3& grid, const Sampling& sample) {
  const uint64_t gx = grid.x, rest = uint64_t(grid.y) * grid.z, total = gx * rest;
  uint64_t n = static_cast<uint64_t>(std::llround(std::min(1.0, sample.fraction) * double(total)));
  n = std::max<uint64_t>(n, 1);
  if (sample.max_threadgroups != 0) n = std::min(n, sample.max_threadgroups);
  if (n >= total) return {};
  std::vector<uint64_t> order;
  order.reserve(n);
  const uint64_t sx = std::min(gx, n);
  for (uint64_t i = 0; i < sx; ++i) {
    const uint64_t x = stratum_pick(i, sx, gx);
    const uint64_t m = n / sx + (i < n % sx ? 1 : 0);
    for (uint64_t j = 0; j < m; ++j) {
      order.push_back(x + gx * ((stratum_pick(j, m, rest) + i) % rest));
    }
  }
  return order;
}

struct Worker {
  std::unique_ptr<Group> group;
};

// This OS thread's fiber stacks, reused across dispatches and unmapped when
// the thread exits: thread_parallel_for starts new threads for every
// dispatch, and stacks left mapped would exhaust the process' memory maps
// (two per stack) after a few hundred dispatches.
struct FiberCache {
  std::vector<Fiber> fibers;
  ~FiberCache() {
    const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
    for (Fiber& f : fibers) {
      if (f.stack == nullptr) continue;
#if defined(MSL_EMU_ASAN)
      // The red zones left on the stack would outlive the mapping: memory
      // mapped later at these addresses (by an allocator ASan does not see)
      // would read as poisoned.
      ASAN_UNPOISON_MEMORY_REGION(f.stack + page, kStackBytes);
#endif
      munmap(f.stack, kStackBytes + page);
    }
  }
};
thread_local FiberCache t_fiber_cache;

struct RunState {
  Dispatch dispatch;
  uint64_t total = 0;             // threadgroups to run
  std::vector<uint64_t> order;    // their linear indices when sampled
  std::atomic<uint64_t> next{0};
  std::atomic<bool> failed{false};
  std::mutex mutex;
  std::string error;
  DispatchStats stats;  // merged from the workers (unscaled)
};

void merge_stats(DispatchStats& into, const DispatchStats& from) {
  const uint64_t peak = std::max(into.peak_tg_bytes, from.peak_tg_bytes);  // a max, not a sum
#define MSL_EMU_ADD_COUNTER(name) into.name += from.name;
  MSL_EMU_DISPATCH_COUNTERS(MSL_EMU_ADD_COUNTER)
#undef MSL_EMU_ADD_COUNTER
  into.peak_tg_bytes = peak;
  for (int b = 0; b < kMaxBufferIndex; ++b) into.tg_lines_by_buffer[b] += from.tg_lines_by_buffer[b];
  for (const auto& r : from.race_reports) {
    if (into.race_reports.size() < kMaxRaceReports) into.race_reports.push_back(r);
  }
}

void init_group(Group& g, const Dispatch& d, std::vector<Fiber>& cache);

// The distinct lines (buffer index in the high bits) the threadgroup that just
// ran touched, sorted; clears the log.
std::vector<uint64_t> take_threadgroup_lines(Group& g) {
  std::vector<uint64_t> lines;
  lines.swap(g.tg_line_log);
  std::sort(lines.begin(), lines.end());
  lines.erase(std::unique(lines.begin(), lines.end()), lines.end());
  return lines;
}

// Line l of take_threadgroup_lines belongs to buffer l >> kLineBufferShift
// (DeviceAccess::offset keeps the buffer index from bit 48, lines are 128 bytes).
constexpr int kLineBufferShift = 48 - 7;

void count_threadgroup_lines(Group& g) {
  const std::vector<uint64_t> lines = take_threadgroup_lines(g);
  g.stats.tg_lines += lines.size();
  for (uint64_t l : lines) {
    const uint64_t b = l >> kLineBufferShift;
    if (b < uint64_t(kMaxBufferIndex)) ++g.stats.tg_lines_by_buffer[b];
  }
}

void worker_body(void* context, int64_t) {
  auto& rs = *static_cast<RunState*>(context);
  const Dispatch& d = rs.dispatch;
  const DispatchSpec& s = *d.spec;
  Group g;
  // Reuse this OS thread's fiber stacks across dispatches.
  std::vector<Fiber>& cache = t_fiber_cache.fibers;
  init_group(g, d, cache);
  const uint64_t gx = s.grid.x, gy = s.grid.y;
  for (;;) {
    if (rs.failed.load()) break;
    const uint64_t next = rs.next.fetch_add(1);
    if (next >= rs.total) break;
    const uint64_t i = rs.order.empty() ? next : rs.order[next];
    g.tg_pos = Vec3u{uint32_t(i % gx), uint32_t((i / gx) % gy), uint32_t(i / (gx * gy))};
    run_group(g);
    if (!g.error.empty()) {
      std::lock_guard<std::mutex> lock(rs.mutex);
      if (rs.error.empty()) rs.error = g.error;
      rs.failed = true;
      break;
    }
    if (g.counting) {
      ++g.stats.threadgroups_executed;
      for (uint32_t t = 0; t < d.threads; ++t) {
        g.stats.peak_tg_bytes = std::max<uint64_t>(g.stats.peak_tg_bytes, g.fibers[t].tg_cursor);
      }
      count_threadgroup_lines(g);
    }
  }
  g.fibers.swap(cache);
  if (g.counting) {
    std::lock_guard<std::mutex> lock(rs.mutex);
    merge_stats(rs.stats, g.stats);
  }
}

// Sets up a Group to run threadgroups of dispatch d, with the fibers of `cache`
// (swapped back by the caller).
void init_group(Group& g, const Dispatch& d, std::vector<Fiber>& cache) {
  const DispatchSpec& s = *d.spec;
  g.dispatch = &d;
  if (cache.size() < d.threads) cache.resize(d.threads);
  g.fibers.swap(cache);
  g.arena.assign(kArenaBytes, 0);
  g.granule_owner.assign(kArenaBytes / kGranule, 0);
  g.granule_end.assign(kArenaBytes / kGranule, 0);
  g.shadow.assign(kArenaBytes, Shadow{});
  g.simd_epoch.assign((d.threads + 31) / 32, 0);
  g.counting = d.counting;
  g.races_fatal = !d.counting;
  g.exchange.assign(size_t((d.threads + 31) / 32) * 2 * 32 * kExchangeBytes, 0);
  g.infos.assign(size_t(d.max_index + 1), BufferInfo{});
  size_t bytes_total = 0;
  for (const auto& b : s.buffers) {
    BufferInfo& info = g.infos[b.index];
    info.kernel = d.entry->name;
    info.index = b.index;
    info.base = static_cast<char*>(b.data);
    info.size = b.size;
    info.is_bytes = b.is_bytes;
    if (b.is_bytes) bytes_total += (b.size + 15) & ~size_t(15);
  }
  g.bytes_copy.assign(bytes_total, 0);
  std::vector<ConstantValue> constants = s.constants;
  d.entry->set_constants(constants.data(), static_cast<int>(constants.size()));
}

// The lines one threadgroup at `pos` touches (take_threadgroup_lines), run
// apart from the dispatch's sample with its counters discarded; empty if it
// fails.
std::vector<uint64_t> probe_lines(const Dispatch& d, Vec3u pos) {
  Group g;
  std::vector<Fiber>& cache = t_fiber_cache.fibers;
  init_group(g, d, cache);
  g.tg_pos = pos;
  run_group(g);
  std::vector<uint64_t> lines = take_threadgroup_lines(g);
  g.fibers.swap(cache);
  if (!g.error.empty()) lines.clear();
  return lines;
}

// Per buffer index, the fraction of `b`'s lines that `a` does not touch.
std::vector<double> new_fraction(const std::vector<uint64_t>& a, const std::vector<uint64_t>& b) {
  std::vector<uint64_t> total(kMaxBufferIndex, 0), fresh(kMaxBufferIndex, 0);
  size_t i = 0;
  for (uint64_t l : b) {
    while (i < a.size() && a[i] < l) ++i;
    const uint64_t buf = std::min<uint64_t>(l >> kLineBufferShift, kMaxBufferIndex - 1);
    ++total[buf];
    if (i == a.size() || a[i] != l) ++fresh[buf];
  }
  std::vector<double> f(kMaxBufferIndex, 0.0);
  for (int k = 0; k < kMaxBufferIndex; ++k) f[k] = total[k] ? double(fresh[k]) / double(total[k]) : 0.0;
  return f;
}

// The working-set counters tg_lines_new_x/_y/_xy: how much of its neighbours'
// device lines a threadgroup shares, measured on a probe threadgroup in the
// middle of grid x and row 0, its x neighbour and its y neighbour (z when the
// grid has one row), per buffer, and applied to each buffer's tg_lines. The
// probes run after the dispatch on copies of nothing: device buffers are
// saved before and restored after them, so the dispatch's results stand.
void probe_neighbours(const Dispatch& d, DispatchStats& stats) {
  const DispatchSpec& s = *d.spec;
  std::vector<std::vector<char>> saved;
  for (const auto& b : s.buffers) {
    saved.emplace_back();
    if (!b.is_bytes && b.data != nullptr) {
      saved.back().assign(static_cast<char*>(b.data), static_cast<char*>(b.data) + b.size);
    }
  }
  const uint32_t rx = s.grid.x >= 2 ? std::min(s.grid.x / 2, s.grid.x - 2) : 0;
  const Vec3u ref{rx, 0, 0};
  const std::vector<uint64_t> a = probe_lines(d, ref);
  std::vector<double> fx(kMaxBufferIndex, 0.0), fy(kMaxBufferIndex, 0.0);
  if (s.grid.x >= 2) fx = new_fraction(a, probe_lines(d, Vec3u{rx + 1, 0, 0}));
  if (s.grid.y >= 2) {
    fy = new_fraction(a, probe_lines(d, Vec3u{rx, 1, 0}));
  } else if (s.grid.z >= 2) {
    fy = new_fraction(a, probe_lines(d, Vec3u{rx, 0, 1}));
  }
  for (size_t i = 0; i < s.buffers.size(); ++i) {
    if (!saved[i].empty()) std::memcpy(s.buffers[i].data, saved[i].data(), saved[i].size());
  }
  double nx = 0, ny = 0, nxy = 0;
  for (int b = 0; b < kMaxBufferIndex; ++b) {
    const double lines = double(stats.tg_lines_by_buffer[b]);
    nx += lines * fx[b];
    ny += lines * fy[b];
    nxy += lines * fx[b] * fy[b];
  }
  stats.tg_lines_new_x = uint64_t(std::llround(nx));
  stats.tg_lines_new_y = uint64_t(std::llround(ny));
  stats.tg_lines_new_xy = uint64_t(std::llround(nxy));
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

std::string run_dispatch(const DispatchSpec& spec, const ParallelFor& parallel,
                         DispatchStats* stats) {
  RunState rs;
  std::string err = validate_and_prepare(spec, &rs.dispatch);
  if (!err.empty()) return err;
  const uint64_t grid_total = uint64_t(spec.grid.x) * spec.grid.y * spec.grid.z;
  if (!spec.sample.all()) rs.order = sample_threadgroups(spec.grid, spec.sample);
  rs.total = rs.order.empty() ? grid_total : rs.order.size();
  rs.dispatch.counting = stats != nullptr;
  struct CountingScope {  // the inline hooks call into the runtime while this lives
    bool on;
    explicit CountingScope(bool on_) : on(on_) {
      if (on) g_counting_dispatches.fetch_add(1);
    }
    ~CountingScope() {
      if (on) g_counting_dispatches.fetch_sub(1);
    }
  } counting_scope(stats != nullptr);
  int64_t workers = std::max<int64_t>(1, std::min<int64_t>(parallel.num_threads, rs.total));
  if (parallel.run == nullptr) workers = 1;
  if (workers == 1) {
    worker_body(&rs, 0);
  } else {
    parallel.run(parallel.self, workers, worker_body, &rs);
  }
  if (stats != nullptr) {
    *stats = std::move(rs.stats);
    if (rs.error.empty()) probe_neighbours(rs.dispatch, *stats);
    const uint64_t executed = stats->threadgroups_executed;
    stats->threadgroups_total = grid_total;
    stats->threads_per_threadgroup = rs.dispatch.threads;
    stats->sampled_fraction = double(executed) / double(grid_total);
    if (executed != 0 && executed != grid_total) {
      // Scale the sums to the whole grid.
      const double f = double(grid_total) / double(executed);
      const uint64_t peak = stats->peak_tg_bytes, races = stats->races;
#define MSL_EMU_SCALE_COUNTER(name) \
  stats->name = static_cast<uint64_t>(std::llround(double(stats->name) * f));
      MSL_EMU_DISPATCH_COUNTERS(MSL_EMU_SCALE_COUNTER)
#undef MSL_EMU_SCALE_COUNTER
      stats->peak_tg_bytes = peak;
      stats->races = races;
      stats->threadgroups_executed = executed;
      stats->threadgroups_total = grid_total;
      stats->threads_per_threadgroup = rs.dispatch.threads;
    }
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
  Group& g = *f.group;
  // An optional parameter whose function constant is false stays readable if
  // the host bound setBytes data there anyway: Apple's compiler removes reads
  // whose results are unused (MLX's GEMM reads its unused epilogue
  // parameters that way), the emulator executes them.
  const bool bound_bytes = index >= 0 && index < static_cast<int>(g.infos.size()) &&
                           g.infos[index].index == index && g.infos[index].is_bytes;
  if (optional_absent && !bound_bytes) return &kAbsent[static_cast<size_t>(index) % 31];
  if (index < 0 || index >= static_cast<int>(g.infos.size()) ||
      g.infos[index].index != index) {
    fail(std::string("buffer(") + std::to_string(index) + ") for parameter '" + param_name +
         "' is not bound");
  }
  return &g.infos[index];
}

void* threadgroup_param(int index, const char* name) {
  Fiber& f = cur();
  Group& g = *f.group;
  if (index != 0) fail("only [[threadgroup(0)]] is supported");
  if (g.dispatch->spec->threadgroup_memory_length == 0) {
    fail("[[threadgroup(0)]] parameter but the dispatch sets no threadgroup memory length");
  }
  if (!g.variables.empty() && g.variables[0].offset == kRedZone) g.variables[0].name = name;
  return g.arena.data() + kRedZone;
}

void* tg_alloc(size_t size, size_t align, const char* name) {
  Fiber& f = cur();
  Group& g = *f.group;
  align = std::max(align, kGranule);
  const size_t off = (f.tg_cursor + align - 1) & ~(align - 1);
  if (off + size > kThreadgroupMemoryLimit) {
    fail("threadgroup memory exceeds 32 KiB (" + std::to_string(off + size) + " bytes)");
  }
  f.tg_cursor = off + size;
  const size_t at = (f.tg_arena + kRedZone + align - 1) & ~(align - 1);
  if (at + size + kRedZone > g.arena.size()) {
    fail("more than " + std::to_string(kMaxThreadgroupVariables) +
         " threadgroup variables (an emulator limit)");
  }
  f.tg_arena = at + size;
  // Every thread runs the declaration; the first registers the variable.
  if (size > 0 && g.granule_owner[at / kGranule] == 0) register_variable(g, name, at, size);
  return g.arena.data() + at;
}

namespace {

[[noreturn]] void tg_out_of_bounds(const Group& g, size_t off, uint32_t bytes, bool write) {
  std::ostringstream os;
  os << "out-of-bounds threadgroup memory " << (write ? "write" : "read") << " of " << bytes
     << " bytes: ";
  const TgVariable* before = nullptr;
  const TgVariable* after = nullptr;
  for (const auto& v : g.variables) {
    if (v.offset <= off && (before == nullptr || v.offset > before->offset)) before = &v;
    if (v.offset > off && (after == nullptr || v.offset < after->offset)) after = &v;
  }
  if (before != nullptr && off < before->offset + before->size + kRedZone / 2) {
    os << "byte offset " << off - before->offset << " of `" << before->name << "` ("
       << before->size << " bytes)";
  } else if (after != nullptr) {
    os << after->offset - off << " bytes before `" << after->name << "` (" << after->size
       << " bytes)";
  } else {
    os << "outside every threadgroup variable";
  }
  fail(os.str());
}

MSL_EMU_INLINE bool same_shadow(const Shadow& a, const Shadow& b) {
  return a.epoch == b.epoch && a.writer == b.writer && a.reader1 == b.reader1 &&
         a.reader2 == b.reader2;
}

// One access's effect on one byte's state. An earlier access conflicts if it
// is another thread's, in another simdgroup or in the same simdgroup with no
// ordering simdgroup_barrier since (equal access-word high halves), and one
// of the two is a write; step() returns its access word (0: none) and
// records the access.
struct RaceCheck {
  uint32_t epoch;
  uint32_t me;    // this access's word
  uint32_t id;    // thread index + 1
  uint32_t simdgroup;
  bool write;
  MSL_EMU_INLINE bool conflicts(uint32_t other) const {
    const uint32_t other_id = other & 0xFFFFu;
    return other_id != 0 && other_id != id &&
           ((other_id - 1) / 32 != simdgroup || (other >> 16) == (me >> 16));
  }
  MSL_EMU_INLINE uint32_t step(Shadow& sh) const {
    if (sh.epoch != epoch) sh = Shadow{epoch, 0, 0, 0};
    uint32_t other = 0;
    if (conflicts(sh.writer)) {
      other = sh.writer;
    } else if (write && conflicts(sh.reader1)) {
      other = sh.reader1;
    } else if (write && conflicts(sh.reader2)) {
      other = sh.reader2;
    }
    if (write) {
      sh.writer = me;
      sh.reader1 = sh.reader2 = 0;
    } else if (sh.reader1 == 0 || (sh.reader1 & 0xFFFFu) == id) {
      sh.reader1 = me;
    } else if (sh.reader2 == 0 || (sh.reader2 & 0xFFFFu) == id) {
      sh.reader2 = me;
    }
    return other;
  }
};

__attribute__((noinline, cold)) void report_race(Group& g, const Fiber& f, size_t off,
                                                  uint32_t bytes, bool write, uint32_t other,
                                                  bool other_write) {
  const TgVariable& v = g.variables[g.granule_owner[off / kGranule] - 1];
  const uint32_t other_thread = (other & 0xFFFFu) - 1u;
  const bool same_simdgroup = other_thread / 32 == f.simd_group;
  std::ostringstream os;
  os << "race on threadgroup memory `" << v.name << "` bytes [" << off - v.offset << ", "
     << off - v.offset + bytes << ") of " << v.size << ": " << (other_write ? "write" : "read")
     << " by " << thread_where(g, other_thread) << " and " << (write ? "write" : "read")
     << " by " << thread_where(g, f.index_in_tg);
  if (same_simdgroup) {
    os << " of the same simdgroup with no simdgroup_barrier(mem_flags::mem_threadgroup) or "
          "threadgroup_barrier between them";
  } else {
    os << " with no threadgroup_barrier(mem_flags::mem_threadgroup) between them";
  }
  if (g.races_fatal) fail(os.str());
  ++g.stats.races;
  if (g.stats.race_reports.size() < kMaxRaceReports) {
    g.stats.race_reports.push_back(where(g) + ", " + thread_where(g, f.index_in_tg) + ": " +
                                   os.str());
  }
}

}  // namespace

void tg_access(const void* address, uint32_t bytes, bool write) {
  Fiber* fp = t_current;
  if (fp == nullptr) return;
  Fiber& f = *fp;
  const size_t off = reinterpret_cast<uintptr_t>(address) - f.tg_base;
  if (off >= f.tg_size) return;  // a copy outside threadgroup memory
  Group& g = *f.group;
  // Inside one variable: it owns the granule and the access ends by its end
  // (variables are separated by red zones, so it cannot start before it).
  if (off + bytes > f.tg_granule_end[off / kGranule]) tg_out_of_bounds(g, off, bytes, write);
  if (g.counting) (write ? g.stats.tg_bytes_written : g.stats.tg_bytes_read) += bytes;
  // Race check against the other threads' accesses since the last barrier.
  // An element is usually accessed as a whole, so its bytes share one state:
  // then the state is updated once and stored to every byte.
  const uint32_t id = f.index_in_tg + 1;
  const RaceCheck rc{g.epoch, id | uint32_t(g.simd_epoch[f.simd_group]) << 16, id, f.simd_group,
                     write};
  Shadow* sh = f.tg_shadow + off;
  bool uniform = true;
  for (uint32_t b = 1; b < bytes && uniform; ++b) uniform = same_shadow(sh[b], sh[0]);
  if (__builtin_expect(uniform, 1)) {
    Shadow next = sh[0];
    const uint32_t other = rc.step(next);
    if (__builtin_expect(other == 0, 1)) {
      if (!same_shadow(next, sh[0])) {
        for (uint32_t b = 0; b < bytes; ++b) sh[b] = next;
      }
      return;
    }
  }
  // Bytes in different states, or a race: byte by byte, one report per access.
  bool reported = false;
  for (uint32_t b = 0; b < bytes; ++b) {
    const Shadow before = sh[b];
    const uint32_t other = rc.step(sh[b]);
    if (other != 0 && !reported) {
      reported = true;
      sh[b] = before;  // report_race throws unless counting: leave the state as it was
      report_race(g, f, off, bytes, write, other, other == before.writer);
      rc.step(sh[b]);
    }
  }
}

void count_device_access(const BufferInfo* info, const void* address, uint32_t bytes,
                         bool store) {
  Fiber* fp = t_current;
  if (fp == nullptr || !fp->group->counting || info->is_bytes) return;
  Fiber& f = *fp;
  const void* site = f.instr_group != 0 ? nullptr : __builtin_return_address(0);
  const uint64_t off = uint64_t(static_cast<const char*>(address) - info->base);
  f.device_log.push_back(
      DeviceAccess{site, (uint64_t(info->index) << 48) | off, bytes, f.instr_group, store});
  (store ? f.group->stats.device_bytes_written : f.group->stats.device_bytes_read) += bytes;
}

void instr_group_begin() {
  Fiber& f = cur();
  if (f.instr_group_depth++ == 0) f.instr_group = ++f.instr_groups;
}

void instr_group_end() {
  Fiber& f = cur();
  if (--f.instr_group_depth == 0) f.instr_group = 0;
}

void count_transcendental() {
  Fiber* f = t_current;
  if (f != nullptr && f->group->counting) ++f->group->stats.transcendentals;
}

void count_bfloat_conversion() {
  Fiber* f = t_current;
  if (f != nullptr && f->group->counting) ++f->group->stats.bfloat_conversions;
}

void count_mma() {
  Fiber* f = t_current;
  if (f != nullptr && f->group->counting && f->lane == 0) ++f->group->stats.simdgroup_mma;
}

uint32_t lane_id() { return cur().lane; }

char* simd_exchange_begin() {
  Fiber& f = cur();
  const size_t parity = f.simd_ops & 1;
  f.simd_ops++;
  return f.group->exchange.data() +
         ((size_t(f.simd_group) * 2 + parity) * 32 + f.lane) * kExchangeBytes;
}

const char* simd_exchange_peers() {
  Fiber& f = cur();
  const size_t parity = (f.simd_ops - 1) & 1;
  return f.group->exchange.data() + (size_t(f.simd_group) * 2 + parity) * 32 * kExchangeBytes;
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
  f.sync_orders_tg = false;
  switch_to_scheduler(f);
}

void simd_barrier_sync(bool orders_threadgroup_memory) {
  simd_exchange_begin();
  Fiber& f = cur();
  f.state = FiberState::kWaitSimd;
  f.sync_kind = SyncKind::kSimdBarrier;
  f.sync_what = "simdgroup_barrier";
  f.sync_orders_tg = orders_threadgroup_memory;
  switch_to_scheduler(f);
}

void threadgroup_barrier_sync(bool orders_threadgroup_memory) {
  Fiber& f = cur();
  f.state = FiberState::kWaitBarrier;
  f.sync_orders_tg = orders_threadgroup_memory;
  switch_to_scheduler(f);
}

}  // namespace rt
}  // namespace msl
