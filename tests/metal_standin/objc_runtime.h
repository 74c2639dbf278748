// A minimal Objective-C runtime for Linux x86-64 and aarch64, enough for
// metal-cpp.
//
// metal-cpp reaches Metal only through the Objective-C runtime: it casts
// objc_msgSend (or, on x86-64, its _stret/_fpret forms) to a function of the
// method's exact C signature and calls it with (receiver, selector,
// arguments...); it names selectors with sel_registerName and classes with
// objc_lookUpClass. This runtime provides those entry points
// (objc_msgsend_x86_64.S, objc_msgsend_aarch64.S: a trampoline that looks up
// the implementation for (receiver, selector) and jumps to it with every
// argument register and the stack untouched), and the
// object model the Metal stand-in (metal_standin.cc) builds its classes on:
// reference counting, autorelease pools per thread, and bookkeeping that
// turns what would be undefined behaviour on a Mac into a recorded finding
// (a message to a deallocated object, an unknown selector, an object
// autoreleased with no pool in place).
#pragma once

#include <objc/runtime.h>  // the declarations metal-cpp sees (tests/metal_typecheck/stubs)

#include <atomic>
#include <initializer_list>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace standin {

using Imp = void (*)();

// Any function pointer as an implementation: the trampoline calls it with the
// caller's registers, so its C signature must be the one metal-cpp casts to.
template <class F>
Imp imp(F* f) {
  return reinterpret_cast<Imp>(f);
}

// The interned selector for an Objective-C selector name ("setBuffer:offset:atIndex:").
SEL sel(const char* name);
const char* sel_name(SEL s);

// The messages a kind of object answers (instance methods of a class, or the
// class methods of a class object); `parent` is searched next.
struct MethodTable {
  const char* class_name;
  std::unordered_map<SEL, Imp> methods;
  const MethodTable* parent;
  MethodTable(const char* name, std::initializer_list<std::pair<const char*, Imp>> list,
              const MethodTable* parent_table);
  Imp find(SEL s) const;
};

// retain, release, autorelease, retainCount: every object's.
const MethodTable& root_methods();

// An object. Released to zero, it frees what it holds (dealloc) but its
// header stays allocated as a zombie, so a later message to it is a finding
// rather than a use-after-free.
struct Object {
  const MethodTable* methods;
  std::atomic<long> refs{1};
  std::atomic<bool> zombie{false};
  bool immortal = false;  // class objects

  explicit Object(const MethodTable* table);
  virtual ~Object() = default;
  virtual void dealloc() {}

  const char* class_name() const { return methods->class_name; }
  void retain() { refs.fetch_add(1); }
  void release();
  Object* autorelease();
};

template <class T>
T* self_as(void* receiver) {
  return static_cast<T*>(reinterpret_cast<Object*>(receiver));
}

// Autorelease pools of the calling thread (NSAutoreleasePool).
void push_autorelease_pool(Object* pool);
void pop_autorelease_pool(Object* pool);

// Findings: what a Mac would abort on, or what would leak or crash there.
void record_finding(const std::string& what);
std::vector<std::string> findings();
void clear_findings();

// Objects alive now per class name, and created in all.
std::unordered_map<std::string, long> live_objects();

// Defined by the Metal stand-in: the class object objc_lookUpClass returns,
// or nullptr for a class the stand-in does not have.
Object* class_named(const char* name);

}  // namespace standin
