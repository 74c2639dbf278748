// The Objective-C runtime of the Metal stand-in. See objc_runtime.h.

#include "objc_runtime.h"

#include <cstdio>
#include <memory>
#include <mutex>
#include <set>
#include <vector>

namespace standin {

namespace {

struct Selectors {
  std::mutex mutex;
  std::set<std::string> names;  // node-based: the c_str() of an element never moves
};

Selectors& selectors() {
  static Selectors* s = new Selectors();  // lives as long as the process
  return *s;
}

struct Ledger {
  std::mutex mutex;
  std::vector<std::string> findings;
  std::unordered_map<std::string, long> live;
};

Ledger& ledger() {
  static Ledger* l = new Ledger();
  return *l;
}

void count_live(const char* class_name, long delta) {
  Ledger& l = ledger();
  std::lock_guard<std::mutex> lock(l.mutex);
  l.live[class_name] += delta;
}

// An autorelease pool frame: the objects autoreleased while it is innermost.
struct PoolFrame {
  Object* pool;
  std::vector<Object*> objects;
};
thread_local std::vector<PoolFrame> t_pools;

// What an unknown message or a message to a zombie returns: nil / 0.
uint64_t nil_result() { return 0; }

// Overwrites the argument registers the lookup may use (and a larger lookup,
// such as Apple's, does), so that a trampoline that fails to restore one of
// them fails the self-test instead of passing because this small lookup
// happened to leave the register alone.
__attribute__((noinline)) void scramble_argument_registers() {
#if defined(__aarch64__)
  __asm__ volatile(
      "movi v0.16b, #0xa5\n movi v1.16b, #0xa5\n movi v2.16b, #0xa5\n movi v3.16b, #0xa5\n"
      "movi v4.16b, #0xa5\n movi v5.16b, #0xa5\n movi v6.16b, #0xa5\n movi v7.16b, #0xa5\n"
      "mov x2, #0xa5a5\n mov x3, x2\n mov x4, x2\n mov x5, x2\n mov x6, x2\n mov x7, x2\n"
      "mov x8, x2\n"
      ::: "v0", "v1", "v2", "v3", "v4", "v5", "v6", "v7", "x2", "x3", "x4", "x5", "x6", "x7",
      "x8", "memory");
#elif defined(__x86_64__)
  __asm__ volatile(
      "pcmpeqd %%xmm0, %%xmm0\n movdqa %%xmm0, %%xmm1\n movdqa %%xmm0, %%xmm2\n"
      "movdqa %%xmm0, %%xmm3\n movdqa %%xmm0, %%xmm4\n movdqa %%xmm0, %%xmm5\n"
      "movdqa %%xmm0, %%xmm6\n movdqa %%xmm0, %%xmm7\n"
      "mov $0xa5a5, %%edx\n mov %%rdx, %%rcx\n mov %%rdx, %%r8\n mov %%rdx, %%r9\n"
      "mov %%rdx, %%rax\n"
      ::: "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "rdx", "rcx", "r8",
      "r9", "rax", "memory");
#endif
}

}  // namespace

SEL sel(const char* name) {
  Selectors& s = selectors();
  std::lock_guard<std::mutex> lock(s.mutex);
  return reinterpret_cast<SEL>(const_cast<char*>(s.names.insert(name).first->c_str()));
}

const char* sel_name(SEL s) { return reinterpret_cast<const char*>(s); }

MethodTable::MethodTable(const char* name, std::initializer_list<std::pair<const char*, Imp>> list,
                         const MethodTable* parent_table)
    : class_name(name), parent(parent_table) {
  for (const auto& [selector, implementation] : list) methods.emplace(sel(selector), implementation);
}

Imp MethodTable::find(SEL s) const {
  for (const MethodTable* t = this; t != nullptr; t = t->parent) {
    if (auto it = t->methods.find(s); it != t->methods.end()) return it->second;
  }
  return nullptr;
}

Object::Object(const MethodTable* table) : methods(table) { count_live(table->class_name, 1); }

void Object::release() {
  if (immortal) return;
  const long before = refs.fetch_sub(1);
  if (before == 1) {
    zombie.store(true);
    dealloc();
    count_live(class_name(), -1);
  } else if (before <= 0) {
    record_finding(std::string("over-release of a ") + class_name());
  }
}

Object* Object::autorelease() {
  if (t_pools.empty()) {
    record_finding(std::string("a ") + class_name() +
                   " was autoreleased with no pool in place (it leaks)");
  } else {
    t_pools.back().objects.push_back(this);
  }
  return this;
}

const MethodTable& root_methods() {
  static const MethodTable* table = new MethodTable(
      "NSObject",
      {
          {"retain", imp(+[](void* self, SEL) -> void* {
             self_as<Object>(self)->retain();
             return self;
           })},
          {"release", imp(+[](void* self, SEL) { self_as<Object>(self)->release(); })},
          {"autorelease",
           imp(+[](void* self, SEL) -> void* { return self_as<Object>(self)->autorelease(); })},
          // metal-cpp's sendMessageSafe asks before sending (supportsFamily:).
          {"respondsToSelector:", imp(+[](void* self, SEL, SEL s) -> bool {
             return self_as<Object>(self)->methods->find(s) != nullptr;
           })},
          {"methodSignatureForSelector:", imp(+[](void*, SEL, SEL) -> void* { return nullptr; })},
          {"retainCount", imp(+[](void* self, SEL) -> unsigned long {
             return static_cast<unsigned long>(self_as<Object>(self)->refs.load());
           })},
      },
      nullptr);
  return *table;
}

void push_autorelease_pool(Object* pool) { t_pools.push_back({pool, {}}); }

void pop_autorelease_pool(Object* pool) {
  bool found = false;
  for (const PoolFrame& f : t_pools) found = found || f.pool == pool;
  if (!found) {
    record_finding("an autorelease pool was drained on a thread that did not create it, or twice");
    return;
  }
  if (t_pools.back().pool != pool) {
    record_finding("an autorelease pool was drained while an inner pool was still in place");
  }
  // Inner pools first, as Foundation does.
  while (!t_pools.empty()) {
    PoolFrame frame = std::move(t_pools.back());
    t_pools.pop_back();
    for (Object* o : frame.objects) o->release();
    if (frame.pool == pool) break;
  }
}

void record_finding(const std::string& what) {
  Ledger& l = ledger();
  std::lock_guard<std::mutex> lock(l.mutex);
  if (l.findings.size() < 64) l.findings.push_back(what);
  std::fprintf(stderr, "metal stand-in: %s\n", what.c_str());
}

std::vector<std::string> findings() {
  Ledger& l = ledger();
  std::lock_guard<std::mutex> lock(l.mutex);
  return l.findings;
}

void clear_findings() {
  Ledger& l = ledger();
  std::lock_guard<std::mutex> lock(l.mutex);
  l.findings.clear();
}

std::unordered_map<std::string, long> live_objects() {
  Ledger& l = ledger();
  std::lock_guard<std::mutex> lock(l.mutex);
  return l.live;
}

}  // namespace standin

// ---------------------------------------------------------------------------
// The C entry points metal-cpp links against.
// ---------------------------------------------------------------------------
extern "C" {

// Called by the objc_msgSend trampolines with the receiver (never nil) and
// the selector; returns the implementation to jump to.
__attribute__((visibility("hidden"))) standin::Imp fatrain_objc_lookup(void* receiver, SEL s) {
  standin::scramble_argument_registers();
  auto* o = reinterpret_cast<standin::Object*>(receiver);
  if (o->zombie.load()) {
    standin::record_finding(std::string("message -") + standin::sel_name(s) +
                            " sent to a deallocated " + o->class_name());
    return standin::imp(&standin::nil_result);
  }
  if (standin::Imp f = o->methods->find(s)) return f;
  standin::record_finding(std::string("unrecognized selector -") + standin::sel_name(s) +
                          " sent to a " + o->class_name() +
                          " (the stand-in does not implement it)");
  return standin::imp(&standin::nil_result);
}

SEL sel_registerName(const char* name) { return standin::sel(name); }

id objc_lookUpClass(const char* name) { return reinterpret_cast<id>(standin::class_named(name)); }

Protocol* objc_getProtocol(const char*) { return nullptr; }

// The blocks runtime ABI that clang's -fblocks code refers to: metal-cpp's
// out-of-line functions that wrap a std::function in a block (device
// observers, completion handlers) reference these. The executor calls none
// of them; if anything does, it is a finding.
void* _NSConcreteStackBlock[32] = {};
void* _NSConcreteGlobalBlock[32] = {};

void _Block_object_assign(void*, const void*, int) {
  standin::record_finding("a block was copied (the stand-in has no blocks runtime)");
}

void _Block_object_dispose(const void*, int) {
  standin::record_finding("a block was disposed (the stand-in has no blocks runtime)");
}

}  // extern "C"
