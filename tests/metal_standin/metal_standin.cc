// The Metal stand-in: the Foundation and Metal objects that jax_fatrain's
// Metal executor and its FFI handlers call through metal-cpp, with the MSL
// emulator as their GPU. Loaded in place of Apple's frameworks, it lets the
// tests run the Metal host code against the emulated kernels.
//
// * The device's buffers are host memory: newBufferWithLength allocates
//   (zero-filled, page aligned), newBufferWithBytesNoCopy wraps the caller's
//   memory and, as Metal does, accepts only a page-aligned pointer and length.
// * Its one kernel library holds the kernels of the packaged kernel source
//   (the text jax_fatrain._backends.metal passes to newLibraryWithSource);
//   newLibraryWithSource checks that it is given exactly that text.
// * Functions are specialised with function-constant values checked as Metal
//   checks them (every constant the kernel uses has a bool value); pipelines
//   hold the function and its constants.
// * An encoder records pipeline, buffer and setBytes bindings, threadgroup
//   memory lengths and dispatches; commit runs the dispatches in order on the
//   emulator. A fault in a kernel (out-of-bounds access, unbound buffer,
//   missing barrier, ...) becomes the command buffer's error, as a GPU fault
//   does in Metal.
// * What Metal's API validation would abort on (use of an encoder after
//   endEncoding, commit twice, a misaligned no-copy buffer, a threadgroup too
//   large for the pipeline, ...) is recorded as a finding and fails the
//   command buffer, so the executor's error path runs and tests see it.
// * A system model, chosen before first use, gives the device (Apple GPU
//   family, Metal 3 or none) and the macOS version NSProcessInfo reports;
//   newLibraryWithSource refuses a language version that macOS lacks.
// * The model's GPU core count is the "gpu-core-count" property of the
//   device's IORegistry entry, reached as on a Mac: the IOKit and
//   CoreFoundation calls the host makes (IORegistryEntryIDMatching with the
//   device's registryID, IOServiceGetMatchingService,
//   IORegistryEntryCreateCFProperty, CFNumberGetValue and the releases) are
//   implemented here over the model; a model without a core count has an
//   entry without the property. Lookups, live objects and misuse (an unknown
//   or released object, an unexpected key) are in the report.
// * Pipelines report maxTotalThreadsPerThreadgroup as the device's limit, or
//   less: the kernel's declared [[max_total_threads_per_threadgroup(N)]], or
//   a limit tests set per kernel (as Apple's compiler lowers it for kernels
//   with many registers); threadExecutionWidth is 32 unless a test sets it.
//
// The C functions at the end of this file (reached with ctypes) give a report
// of counters and findings, inject failures of newLibraryWithSource,
// pipeline creation and command execution, and set pipeline limits.

#include <CoreFoundation/CoreFoundation.h>
#include <Foundation/Foundation.hpp>
#include <IOKit/IOKitLib.h>
#include <Metal/Metal.hpp>

#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <set>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include "msl_emulator/runtime.h"
#include "objc_runtime.h"

// The kernel library's source text: the packaged kernel source.
extern "C" const char fatrain_standin_library_source[];
extern "C" const char fatrain_standin_library_source_end[];

namespace standin {
namespace {

constexpr NS::UInteger kMaxThreadsPerThreadgroup = 1024;
constexpr NS::UInteger kMaxThreadgroupMemory = 32768;
constexpr NS::UInteger kMaxBufferIndex = 31;  // buffer argument table entries
constexpr NS::UInteger kMaxSetBytes = 4096;

size_t page_size() {
  static const size_t page = size_t(sysconf(_SC_PAGESIZE));
  return page;
}

// ---------------------------------------------------------------------------
// Counters, injected failures and the device model, under one mutex.
// ---------------------------------------------------------------------------
#define STANDIN_COUNTERS(X)                                                               \
  X(devices) X(libraries_from_source) X(libraries_from_file) X(library_failures)          \
  X(functions) X(function_failures) X(pipelines) X(pipeline_failures) X(command_buffers)  \
  X(commits) X(dispatches) X(failed_command_buffers) X(buffers_allocated)                  \
  X(buffers_no_copy) X(buffers_no_copy_rejected) X(bindings_allocated) X(bindings_no_copy) \
  X(set_bytes) X(barriers) X(registry_lookups)

struct Counters {
#define STANDIN_FIELD(name) long name = 0;
  STANDIN_COUNTERS(STANDIN_FIELD)
#undef STANDIN_FIELD
};

struct Fault {
  int remaining = 0;  // the next `remaining` operations of this kind fail
  std::string message;
};

// What a system model is: its GPU (Apple family, Metal 3; no device when
// apple_family is 0), the GPU's core count in the IORegistry (0: no
// "gpu-core-count" property) and its macOS version.
struct SystemModel {
  const char* name;
  int apple_family;
  bool metal3;
  int gpu_cores;
  NS::Integer macos[3];
};

constexpr SystemModel kSystemModels[] = {
    {"apple8", 8, true, 10, {14, 5, 0}},          // a 10-core M2 on macOS 14.5
    {"apple8_macos13", 8, true, 10, {13, 6, 7}},  // the same GPU on macOS 13.6.7: no MSL 3.1
    {"apple6", 6, false, 0, {14, 5, 0}},          // too old a GPU for the kernels
    {"none", 0, false, 0, {14, 5, 0}},            // no Metal device
    {"m1", 7, true, 8, {14, 5, 0}},               // an 8-core M1
    {"m2_max", 8, true, 38, {14, 5, 0}},          // a 38-core M2 Max
    {"m4_max", 9, true, 40, {15, 1, 0}},          // a 40-core M4 Max
    {"apple8_no_core_count", 8, true, 0, {14, 5, 0}},  // an entry without gpu-core-count
};

// The registry ID of the device's IORegistry entry (MTLDevice.registryID).
constexpr uint64_t kDeviceRegistryID = 0x100000a2c;

const SystemModel* find_model(const std::string& name) {
  for (const SystemModel& m : kSystemModels) {
    if (name == m.name) return &m;
  }
  return nullptr;
}

// The newest Metal Shading Language a macOS release compiles: 3.1 from macOS
// 14, 3.0 on macOS 13.
MTL::LanguageVersion newest_language_version(NS::Integer macos_major) {
  return macos_major >= 14 ? MTL::LanguageVersion3_1 : MTL::LanguageVersion3_0;
}

// Limits that pipelines of kernels whose names start with `prefix` report
// (0: the default).
struct PipelineLimit {
  std::string prefix;
  NS::UInteger max_threads = 0;
  NS::UInteger execution_width = 0;
};

struct Global {
  std::mutex mutex;
  Counters counters;
  Fault library, pipeline, execution;
  const SystemModel* model = &kSystemModels[0];
  bool model_chosen = false;  // MTLCreateSystemDefaultDevice or NSProcessInfo has been used
  std::vector<PipelineLimit> pipeline_limits;
  std::vector<std::string> pipeline_keys;   // every pipeline created, in order
  std::vector<uintptr_t> no_copy_addresses; // memory wrapped by no-copy buffers, in order
  long language_version = -1;               // of the last newLibraryWithSource
  int fast_math = -1;                       // of the last newLibraryWithSource: 1, 0 or -1
  // Every dispatch run since the last reset: kernel and grid.
  std::vector<std::pair<std::string, MTL::Size>> dispatch_log;
  // IOKit objects and CoreFoundation objects of the IORegistry model alive now.
  std::map<std::string, long> registry_live;
};

Global& global() {
  static Global* g = new Global();
  return *g;
}

#define COUNT(name)                                          \
  do {                                                       \
    std::lock_guard<std::mutex> lock_(global().mutex);       \
    ++global().counters.name;                                \
  } while (0)

// Consumes one injected failure of this kind: its message, or "".
std::string take_fault(Fault Global::*which) {
  Global& g = global();
  std::lock_guard<std::mutex> lock(g.mutex);
  Fault& f = g.*which;
  if (f.remaining <= 0) return "";
  --f.remaining;
  return f.message;
}

// ---------------------------------------------------------------------------
// Foundation: NSString, NSError, NSAutoreleasePool.
// ---------------------------------------------------------------------------
const MethodTable& string_methods();

struct String : Object {
  std::string text;
  explicit String(std::string t) : Object(&string_methods()), text(std::move(t)) {}
};

const MethodTable& string_methods() {
  static const MethodTable* t = new MethodTable(
      "NSString",
      {
          {"UTF8String",
           imp(+[](void* self, SEL) -> const char* { return self_as<String>(self)->text.c_str(); })},
          {"length", imp(+[](void* self, SEL) -> NS::UInteger {
             return self_as<String>(self)->text.size();
           })},
      },
      &root_methods());
  return *t;
}

const MethodTable& error_methods();

struct Error : Object {
  String* domain;
  NS::Integer code;
  String* description;
  Error(const char* d, NS::Integer c, const std::string& text)
      : Object(&error_methods()), domain(new String(d)), code(c), description(new String(text)) {}
  void dealloc() override {
    domain->release();
    description->release();
  }
};

const MethodTable& error_methods() {
  static const MethodTable* t = new MethodTable(
      "NSError",
      {
          {"localizedDescription",
           imp(+[](void* self, SEL) -> String* { return self_as<Error>(self)->description; })},
          {"domain", imp(+[](void* self, SEL) -> String* { return self_as<Error>(self)->domain; })},
          {"code", imp(+[](void* self, SEL) -> NS::Integer { return self_as<Error>(self)->code; })},
      },
      &root_methods());
  return *t;
}

// An NSError** out-parameter receives an autoreleased error, as in Cocoa.
void set_error(NS::Error** out, const char* domain, NS::Integer code, const std::string& text) {
  if (out == nullptr) return;
  auto* e = new Error(domain, code, text);
  e->autorelease();
  *out = reinterpret_cast<NS::Error*>(e);
}

const MethodTable& pool_methods();

struct AutoreleasePool : Object {
  bool pushed = false;
  AutoreleasePool() : Object(&pool_methods()) {}
};

void drain_pool(void* self, SEL) {
  auto* pool = self_as<AutoreleasePool>(self);
  if (pool->pushed) {
    pool->pushed = false;
    pop_autorelease_pool(pool);
  }
  pool->release();
}

const MethodTable& pool_methods() {
  static const MethodTable* t = new MethodTable(
      "NSAutoreleasePool",
      {
          {"init", imp(+[](void* self, SEL) -> void* {
             auto* pool = self_as<AutoreleasePool>(self);
             pool->pushed = true;
             push_autorelease_pool(pool);
             return self;
           })},
          {"release", imp(&drain_pool)},
          {"drain", imp(&drain_pool)},
      },
      &root_methods());
  return *t;
}

// ---------------------------------------------------------------------------
// Metal objects.
// ---------------------------------------------------------------------------
const MethodTable& buffer_methods();

struct Buffer : Object {
  char* data;
  NS::UInteger bytes;
  bool owned;  // newBufferWithLength (else a no-copy view of the caller's memory)
  Buffer(char* d, NS::UInteger n, bool own) : Object(&buffer_methods()), data(d), bytes(n), owned(own) {}
  void dealloc() override {
    if (owned) std::free(data);
    data = nullptr;
  }
};

const MethodTable& buffer_methods() {
  static const MethodTable* t = new MethodTable(
      "MTLBuffer",
      {
          {"contents", imp(+[](void* self, SEL) -> void* { return self_as<Buffer>(self)->data; })},
          {"length",
           imp(+[](void* self, SEL) -> NS::UInteger { return self_as<Buffer>(self)->bytes; })},
          {"didModifyRange:", imp(+[](void*, SEL, NS::Range) {})},
      },
      &root_methods());
  return *t;
}

const MethodTable& compile_options_methods();

struct CompileOptions : Object {
  MTL::LanguageVersion language_version = MTL::LanguageVersion3_1;
  bool fast_math = true;  // Metal's default
  CompileOptions() : Object(&compile_options_methods()) {}
};

const MethodTable& compile_options_methods() {
  static const MethodTable* t = new MethodTable(
      "MTLCompileOptions",
      {
          {"init", imp(+[](void* self, SEL) -> void* { return self; })},
          {"setLanguageVersion:", imp(+[](void* self, SEL, MTL::LanguageVersion v) {
             self_as<CompileOptions>(self)->language_version = v;
           })},
          {"languageVersion", imp(+[](void* self, SEL) -> MTL::LanguageVersion {
             return self_as<CompileOptions>(self)->language_version;
           })},
          {"setFastMathEnabled:", imp(+[](void* self, SEL, bool on) {
             self_as<CompileOptions>(self)->fast_math = on;
           })},
          {"fastMathEnabled",
           imp(+[](void* self, SEL) -> bool { return self_as<CompileOptions>(self)->fast_math; })},
      },
      &root_methods());
  return *t;
}

const MethodTable& constant_values_methods();

struct ConstantValue {
  MTL::DataType type;
  bool value;
};

struct FunctionConstantValues : Object {
  std::map<NS::UInteger, ConstantValue> values;
  FunctionConstantValues() : Object(&constant_values_methods()) {}
};

const MethodTable& constant_values_methods() {
  static const MethodTable* t = new MethodTable(
      "MTLFunctionConstantValues",
      {
          {"init", imp(+[](void* self, SEL) -> void* { return self; })},
          {"setConstantValue:type:atIndex:",
           imp(+[](void* self, SEL, const void* value, MTL::DataType type, NS::UInteger index) {
             // The kernels declare only bool constants; a value of another
             // type is kept and rejected when a function is specialised.
             const bool v = type == MTL::DataTypeBool ? *static_cast<const bool*>(value) : false;
             self_as<FunctionConstantValues>(self)->values[index] = {type, v};
           })},
          {"reset", imp(+[](void* self, SEL) { self_as<FunctionConstantValues>(self)->values.clear(); })},
      },
      &root_methods());
  return *t;
}

const MethodTable& function_methods();

struct Function : Object {
  const msl::rt::KernelEntry* kernel;
  std::vector<std::pair<int, bool>> constants;  // every constant the kernel uses
  String* name;
  Function(const msl::rt::KernelEntry* k, std::vector<std::pair<int, bool>> c)
      : Object(&function_methods()), kernel(k), constants(std::move(c)), name(new String(k->name)) {}
  void dealloc() override { name->release(); }
};

const MethodTable& function_methods() {
  static const MethodTable* t = new MethodTable(
      "MTLFunction",
      {
          {"name", imp(+[](void* self, SEL) -> String* { return self_as<Function>(self)->name; })},
      },
      &root_methods());
  return *t;
}

const MethodTable& library_methods();

struct Library : Object {
  Library() : Object(&library_methods()) {}
};

// newFunctionWithName:constantValues:error: as Metal checks it: the name must
// be a kernel of the library, and every function constant the kernel uses
// must have a value of its declared type (bool for all of ours).
Function* new_function(void*, SEL, const String* name, const FunctionConstantValues* values,
                       NS::Error** error) {
  const std::string kernel_name = name != nullptr ? name->text : "";
  const msl::rt::KernelEntry* kernel = msl::rt::find_kernel(kernel_name);
  if (kernel == nullptr) {
    COUNT(function_failures);
    set_error(error, "MTLLibraryErrorDomain", MTL::LibraryErrorFunctionNotFound,
              "Function " + kernel_name + " was not found in the library");
    return nullptr;
  }
  std::vector<std::pair<int, bool>> constants;
  for (int i = 0; i < kernel->used_constant_count; ++i) {
    const msl::rt::FunctionConstantDecl& decl = kernel->used_constants[i];
    const auto it = values != nullptr ? values->values.find(NS::UInteger(decl.index))
                                      : std::map<NS::UInteger, ConstantValue>::const_iterator();
    if (values == nullptr || it == values->values.end()) {
      COUNT(function_failures);
      set_error(error, "MTLLibraryErrorDomain", MTL::LibraryErrorFunctionNotFound,
                "Function " + kernel_name + " has a function constant '" + decl.name +
                    "' (index " + std::to_string(decl.index) + ") with no value");
      return nullptr;
    }
    if (it->second.type != MTL::DataTypeBool) {
      COUNT(function_failures);
      set_error(error, "MTLLibraryErrorDomain", MTL::LibraryErrorFunctionNotFound,
                "Function " + kernel_name + ": function constant '" + decl.name + "' (index " +
                    std::to_string(decl.index) + ") is bool, its value has MTLDataType " +
                    std::to_string(NS::UInteger(it->second.type)));
      return nullptr;
    }
    constants.emplace_back(decl.index, it->second.value);
  }
  COUNT(functions);
  return new Function(kernel, std::move(constants));
}

const MethodTable& library_methods() {
  static const MethodTable* t = new MethodTable(
      "MTLLibrary",
      {
          {"newFunctionWithName:constantValues:error:", imp(&new_function)},
          {"newFunctionWithName:", imp(+[](void* self, SEL s, const String* name) -> Function* {
             return new_function(self, s, name, nullptr, nullptr);
           })},
      },
      &root_methods());
  return *t;
}

const MethodTable& pipeline_methods();

struct ComputePipelineState : Object {
  std::string kernel;
  std::vector<std::pair<int, bool>> constants;
  NS::UInteger max_threads;      // maxTotalThreadsPerThreadgroup
  NS::UInteger execution_width;  // threadExecutionWidth
  ComputePipelineState(std::string k, std::vector<std::pair<int, bool>> c, NS::UInteger max,
                       NS::UInteger width)
      : Object(&pipeline_methods()), kernel(std::move(k)), constants(std::move(c)),
        max_threads(max), execution_width(width) {}
};

const MethodTable& pipeline_methods() {
  static const MethodTable* t = new MethodTable(
      "MTLComputePipelineState",
      {
          {"maxTotalThreadsPerThreadgroup", imp(+[](void* self, SEL) -> NS::UInteger {
             return self_as<ComputePipelineState>(self)->max_threads;
           })},
          {"threadExecutionWidth", imp(+[](void* self, SEL) -> NS::UInteger {
             return self_as<ComputePipelineState>(self)->execution_width;
           })},
          {"staticThreadgroupMemoryLength", imp(+[](void*, SEL) -> NS::UInteger { return 0; })},
      },
      &root_methods());
  return *t;
}

// ---------------------------------------------------------------------------
// Command buffers and compute encoders.
// ---------------------------------------------------------------------------
struct Binding {
  Buffer* buffer = nullptr;  // retained by the command buffer
  NS::UInteger offset = 0;
  std::vector<uint8_t> bytes;  // setBytes data, copied at encode time
  bool is_bytes = false;
};

struct RecordedDispatch {
  ComputePipelineState* pipeline;
  std::map<NS::UInteger, Binding> bindings;
  std::map<NS::UInteger, NS::UInteger> threadgroup_memory;
  MTL::Size grid, threadgroup;
};

const MethodTable& command_buffer_methods();
struct ComputeCommandEncoder;

struct CommandBuffer : Object {
  MTL::CommandBufferStatus status = MTL::CommandBufferStatusNotEnqueued;
  Error* error = nullptr;
  ComputeCommandEncoder* active_encoder = nullptr;
  std::vector<RecordedDispatch> dispatches;
  std::vector<Object*> retained;  // resources bound, released when the work completes
  std::string validation_error;   // the first API misuse while encoding

  CommandBuffer() : Object(&command_buffer_methods()) {}
  void misuse(const std::string& what) {
    record_finding("Metal API validation: " + what);
    if (validation_error.empty()) validation_error = what;
  }
  void release_resources() {
    for (Object* o : retained) o->release();
    retained.clear();
    dispatches.clear();
  }
  void fail(NS::Integer code, const std::string& text) {
    status = MTL::CommandBufferStatusError;
    error = new Error("MTLCommandBufferErrorDomain", code, text);
    COUNT(failed_command_buffers);
  }
  void run();
  void dealloc() override {
    release_resources();
    if (error != nullptr) error->release();
  }
};

const MethodTable& encoder_methods();

struct ComputeCommandEncoder : Object {
  CommandBuffer* command_buffer;  // retained
  bool concurrent;
  bool ended = false;
  ComputePipelineState* pipeline = nullptr;
  std::map<NS::UInteger, Binding> bindings;
  std::map<NS::UInteger, NS::UInteger> threadgroup_memory;
  std::set<Buffer*> since_barrier;  // buffers bound by dispatches since the last barrier

  ComputeCommandEncoder(CommandBuffer* cb, bool is_concurrent)
      : Object(&encoder_methods()), command_buffer(cb), concurrent(is_concurrent) {
    cb->retain();
  }
  // False (and a finding) once encoding has ended.
  bool encoding(const char* call) {
    if (!ended) return true;
    command_buffer->misuse(std::string(call) + " called on a compute command encoder after endEncoding");
    return false;
  }
  void dealloc() override { command_buffer->release(); }
};

void CommandBuffer::run() {
  if (!validation_error.empty()) {
    fail(MTL::CommandBufferErrorInternal, "Metal API validation failed: " + validation_error);
    return;
  }
  if (std::string injected = take_fault(&Global::execution); !injected.empty()) {
    fail(MTL::CommandBufferErrorInternal, injected);
    return;
  }
  static const msl::rt::ParallelFor parallel = msl::rt::thread_parallel_for(0);
  for (const RecordedDispatch& d : dispatches) {
    msl::rt::DispatchSpec spec;
    spec.kernel = d.pipeline->kernel;
    for (auto [index, value] : d.pipeline->constants) spec.constants.push_back({index, value ? 1.0 : 0.0});
    for (const auto& [index, b] : d.bindings) {
      msl::rt::BufferBinding bb;
      bb.index = int(index);
      if (b.is_bytes) {
        bb.is_bytes = true;
        bb.data = const_cast<uint8_t*>(b.bytes.data());
        bb.size = b.bytes.size();
      } else {
        bb.data = b.buffer->data + b.offset;
        bb.size = b.buffer->bytes - b.offset;
      }
      spec.buffers.push_back(bb);
    }
    for (const auto& [index, length] : d.threadgroup_memory) {
      if (index == 0) spec.threadgroup_memory_length = length;
    }
    spec.grid = {uint32_t(d.grid.width), uint32_t(d.grid.height), uint32_t(d.grid.depth)};
    spec.threadgroup = {uint32_t(d.threadgroup.width), uint32_t(d.threadgroup.height),
                        uint32_t(d.threadgroup.depth)};
    COUNT(dispatches);
    {
      std::lock_guard<std::mutex> lock(global().mutex);
      global().dispatch_log.push_back({d.pipeline->kernel, d.grid});
    }
    const std::string err = msl::rt::run_dispatch(spec, parallel);
    if (!err.empty()) {
      fail(MTL::CommandBufferErrorPageFault,
           "Execution of the command buffer was aborted due to an error during execution. "
           "(MSL emulator: " + err + ")");
      return;
    }
  }
  status = MTL::CommandBufferStatusCompleted;
}

const MethodTable& command_buffer_methods();

ComputeCommandEncoder* new_encoder(void* self, bool concurrent) {
  auto* cb = self_as<CommandBuffer>(self);
  if (cb->status != MTL::CommandBufferStatusNotEnqueued) {
    cb->misuse("computeCommandEncoder called on a command buffer that was already committed");
  }
  if (cb->active_encoder != nullptr && !cb->active_encoder->ended) {
    cb->misuse("a new encoder was created while the previous one had not called endEncoding");
  }
  auto* enc = new ComputeCommandEncoder(cb, concurrent);
  cb->active_encoder = enc;
  enc->autorelease();
  return enc;
}

const MethodTable& command_buffer_methods() {
  static const MethodTable* t = new MethodTable(
      "MTLCommandBuffer",
      {
          {"computeCommandEncoder",
           imp(+[](void* self, SEL) -> ComputeCommandEncoder* { return new_encoder(self, false); })},
          {"computeCommandEncoderWithDispatchType:",
           imp(+[](void* self, SEL, MTL::DispatchType type) -> ComputeCommandEncoder* {
             return new_encoder(self, type == MTL::DispatchTypeConcurrent);
           })},
          {"commit", imp(+[](void* self, SEL) {
             auto* cb = self_as<CommandBuffer>(self);
             if (cb->status != MTL::CommandBufferStatusNotEnqueued) {
               cb->misuse("commit called on a command buffer that was already committed");
               return;  // the first commit's result stands
             }
             if (cb->active_encoder != nullptr && !cb->active_encoder->ended) {
               cb->misuse("commit called while a command encoder had not called endEncoding");
             }
             COUNT(commits);
             cb->status = MTL::CommandBufferStatusCommitted;
             cb->run();
             cb->release_resources();
           })},
          {"waitUntilCompleted", imp(+[](void* self, SEL) {
             auto* cb = self_as<CommandBuffer>(self);
             if (cb->status == MTL::CommandBufferStatusNotEnqueued) {
               // Metal never returns from this wait.
               record_finding("Metal API: waitUntilCompleted on a command buffer that was never "
                              "committed (it would wait forever)");
             }
           })},
          {"status", imp(+[](void* self, SEL) -> MTL::CommandBufferStatus {
             return self_as<CommandBuffer>(self)->status;
           })},
          {"error", imp(+[](void* self, SEL) -> Error* { return self_as<CommandBuffer>(self)->error; })},
      },
      &root_methods());
  return *t;
}

const MethodTable& encoder_methods() {
  static const MethodTable* t = new MethodTable(
      "MTLComputeCommandEncoder",
      {
          {"setComputePipelineState:", imp(+[](void* self, SEL, ComputePipelineState* pso) {
             auto* enc = self_as<ComputeCommandEncoder>(self);
             if (!enc->encoding("setComputePipelineState")) return;
             if (pso != nullptr) {
               pso->retain();
               enc->command_buffer->retained.push_back(pso);
             }
             enc->pipeline = pso;
           })},
          {"setBuffer:offset:atIndex:",
           imp(+[](void* self, SEL, Buffer* buffer, NS::UInteger offset, NS::UInteger index) {
             auto* enc = self_as<ComputeCommandEncoder>(self);
             if (!enc->encoding("setBuffer")) return;
             if (index >= kMaxBufferIndex) {
               enc->command_buffer->misuse("setBuffer index " + std::to_string(index) +
                                           " is beyond the buffer argument table (31 entries)");
               return;
             }
             if (buffer == nullptr) {
               enc->bindings.erase(index);
               return;
             }
             if (offset > buffer->bytes) {
               enc->command_buffer->misuse("setBuffer offset " + std::to_string(offset) +
                                           " is beyond the buffer's length " +
                                           std::to_string(buffer->bytes));
               return;
             }
             buffer->retain();
             enc->command_buffer->retained.push_back(buffer);
             Binding b;
             b.buffer = buffer;
             b.offset = offset;
             enc->bindings[index] = std::move(b);
             if (buffer->owned) {
               COUNT(bindings_allocated);
             } else {
               COUNT(bindings_no_copy);
             }
           })},
          {"setBytes:length:atIndex:",
           imp(+[](void* self, SEL, const void* bytes, NS::UInteger length, NS::UInteger index) {
             auto* enc = self_as<ComputeCommandEncoder>(self);
             if (!enc->encoding("setBytes")) return;
             if (index >= kMaxBufferIndex || length > kMaxSetBytes || bytes == nullptr) {
               enc->command_buffer->misuse("setBytes at index " + std::to_string(index) + " with " +
                                           std::to_string(length) +
                                           " bytes (at most 4096 bytes, index below 31)");
               return;
             }
             Binding b;
             b.is_bytes = true;
             const auto* p = static_cast<const uint8_t*>(bytes);
             b.bytes.assign(p, p + length);
             enc->bindings[index] = std::move(b);
             COUNT(set_bytes);
           })},
          {"setThreadgroupMemoryLength:atIndex:",
           imp(+[](void* self, SEL, NS::UInteger length, NS::UInteger index) {
             auto* enc = self_as<ComputeCommandEncoder>(self);
             if (!enc->encoding("setThreadgroupMemoryLength")) return;
             if (length % 16 != 0 || length > kMaxThreadgroupMemory) {
               enc->command_buffer->misuse("setThreadgroupMemoryLength " + std::to_string(length) +
                                           " (must be a multiple of 16, at most 32768)");
               return;
             }
             enc->threadgroup_memory[index] = length;
           })},
          {"memoryBarrierWithScope:", imp(+[](void* self, SEL, MTL::BarrierScope scope) {
             auto* enc = self_as<ComputeCommandEncoder>(self);
             if (!enc->encoding("memoryBarrierWithScope")) return;
             COUNT(barriers);
             if (scope & MTL::BarrierScopeBuffers) enc->since_barrier.clear();
           })},
          {"dispatchThreadgroups:threadsPerThreadgroup:",
           imp(+[](void* self, SEL, MTL::Size grid, MTL::Size threadgroup) {
             auto* enc = self_as<ComputeCommandEncoder>(self);
             if (!enc->encoding("dispatchThreadgroups")) return;
             CommandBuffer* cb = enc->command_buffer;
             if (enc->pipeline == nullptr) {
               cb->misuse("dispatchThreadgroups with no compute pipeline state set");
               return;
             }
             const NS::UInteger threads = threadgroup.width * threadgroup.height * threadgroup.depth;
             if (threads == 0 || threads > enc->pipeline->max_threads) {
               cb->misuse("dispatchThreadgroups with " + std::to_string(threads) +
                          " threads per threadgroup; the pipeline of " + enc->pipeline->kernel +
                          " allows 1 to " + std::to_string(enc->pipeline->max_threads));
               return;
             }
             if (grid.width == 0 || grid.height == 0 || grid.depth == 0) {
               cb->misuse("dispatchThreadgroups with an empty grid");
               return;
             }
             // In a concurrent encoder, dispatches between barriers may overlap
             // on the GPU: one that binds a buffer an earlier one bound needs a
             // memoryBarrier in between.
             for (const auto& [index, b] : enc->bindings) {
               if (b.is_bytes) continue;
               if (enc->concurrent && enc->since_barrier.count(b.buffer) != 0) {
                 cb->misuse("dispatch of " + enc->pipeline->kernel + " binds at buffer(" +
                            std::to_string(index) +
                            ") a buffer an earlier dispatch of this concurrent encoder bound, "
                            "with no memoryBarrier between them");
               }
             }
             for (const auto& [index, b] : enc->bindings) {
               if (!b.is_bytes) enc->since_barrier.insert(b.buffer);
             }
             cb->dispatches.push_back({enc->pipeline, enc->bindings, enc->threadgroup_memory, grid,
                                       threadgroup});
           })},
          {"endEncoding", imp(+[](void* self, SEL) {
             auto* enc = self_as<ComputeCommandEncoder>(self);
             if (!enc->encoding("endEncoding")) return;
             enc->ended = true;
           })},
      },
      &root_methods());
  return *t;
}

const MethodTable& queue_methods();

struct CommandQueue : Object {
  CommandQueue() : Object(&queue_methods()) {}
};

const MethodTable& queue_methods() {
  static const MethodTable* t = new MethodTable(
      "MTLCommandQueue",
      {
          {"commandBuffer", imp(+[](void*, SEL) -> CommandBuffer* {
             COUNT(command_buffers);
             auto* cb = new CommandBuffer();
             cb->autorelease();
             return cb;
           })},
      },
      &root_methods());
  return *t;
}

// ---------------------------------------------------------------------------
// The device.
// ---------------------------------------------------------------------------
const MethodTable& device_methods();

struct Device : Object {
  String* name;
  const SystemModel* model;
  explicit Device(const SystemModel* m)
      : Object(&device_methods()),
        name(new String(std::string("Metal stand-in (MSL emulator, ") + m->name + ")")),
        model(m) {}
};

// The first line where `given` differs from the library's source, or "".
std::string source_difference(const std::string& given) {
  const std::string_view expected(fatrain_standin_library_source,
                                  size_t(fatrain_standin_library_source_end -
                                         fatrain_standin_library_source));
  if (given == expected) return "";
  size_t line = 1, at = 0;
  const size_t n = std::min(given.size(), expected.size());
  while (at < n && given[at] == expected[at]) {
    if (given[at] == '\n') ++line;
    ++at;
  }
  auto line_at = [&](std::string_view s) {
    const size_t begin = s.rfind('\n', at == 0 ? 0 : at - 1);
    const size_t from = begin == std::string_view::npos || at == 0 ? 0 : begin + 1;
    return std::string(s.substr(from, std::min<size_t>(s.find('\n', from) - from, 120)));
  };
  return "the source differs from the stand-in's kernel library source at line " +
         std::to_string(line) + ": got '" + line_at(given) + "', expected '" + line_at(expected) +
         "' (" + std::to_string(given.size()) + " bytes given, " +
         std::to_string(expected.size()) + " expected)";
}

Buffer* new_allocated_buffer(NS::UInteger length) {
  void* p = nullptr;
  if (length == 0 || posix_memalign(&p, page_size(), length) != 0) return nullptr;
  std::memset(p, 0, length);  // Metal zero-fills a new buffer
  COUNT(buffers_allocated);
  return new Buffer(static_cast<char*>(p), length, true);
}

const MethodTable& device_methods() {
  static const MethodTable* t = new MethodTable(
      "MTLDevice",
      {
          {"name", imp(+[](void* self, SEL) -> String* { return self_as<Device>(self)->name; })},
          {"supportsFamily:", imp(+[](void* self, SEL, MTL::GPUFamily family) -> bool {
             const SystemModel* m = self_as<Device>(self)->model;
             if (family >= MTL::GPUFamilyApple1 && family <= MTL::GPUFamilyApple9) {
               return family - MTL::GPUFamilyApple1 + 1 <= m->apple_family;
             }
             if (family == MTL::GPUFamilyMetal3) return m->metal3;
             return family == MTL::GPUFamilyMac2 || family == MTL::GPUFamilyCommon1 ||
                    family == MTL::GPUFamilyCommon2 || family == MTL::GPUFamilyCommon3;
           })},
          {"hasUnifiedMemory", imp(+[](void*, SEL) -> bool { return true; })},
          {"registryID", imp(+[](void*, SEL) -> uint64_t { return kDeviceRegistryID; })},
          {"maxThreadgroupMemoryLength", imp(+[](void*, SEL) -> NS::UInteger { return kMaxThreadgroupMemory; })},
          {"newCommandQueue", imp(+[](void*, SEL) -> CommandQueue* { return new CommandQueue(); })},
          {"newLibraryWithSource:options:error:",
           imp(+[](void* self, SEL, const String* source, const CompileOptions* options,
                   NS::Error** error) -> Library* {
             {
               Global& g = global();
               std::lock_guard<std::mutex> lock(g.mutex);
               g.language_version = options != nullptr ? long(options->language_version) : -1;
               g.fast_math = options != nullptr ? int(options->fast_math) : 1;
             }
             std::string why = take_fault(&Global::library);
             const SystemModel* m = self_as<Device>(self)->model;
             const MTL::LanguageVersion newest = newest_language_version(m->macos[0]);
             if (why.empty() && options != nullptr && options->language_version > newest) {
               why = "MTLLanguageVersion " + std::to_string(long(options->language_version) >> 16) +
                     "." + std::to_string(long(options->language_version) & 0xffff) +
                     " is not supported on macOS " + std::to_string(m->macos[0]) + "." +
                     std::to_string(m->macos[1]) + " (the stand-in's " + m->name + " model)";
             }
             if (why.empty()) why = source_difference(source != nullptr ? source->text : "");
             if (!why.empty()) {
               COUNT(library_failures);
               set_error(error, "MTLLibraryErrorDomain", MTL::LibraryErrorCompileFailure, why);
               return nullptr;
             }
             COUNT(libraries_from_source);
             return new Library();
           })},
          {"newLibraryWithFile:error:",
           imp(+[](void*, SEL, const String* path, NS::Error** error) -> Library* {
             COUNT(libraries_from_file);
             COUNT(library_failures);
             set_error(error, "MTLLibraryErrorDomain", MTL::LibraryErrorFileNotFound,
                       "the Metal stand-in loads no metallib (" +
                           (path != nullptr ? path->text : std::string("nil")) +
                           "); its one library comes from newLibraryWithSource");
             return nullptr;
           })},
          {"newComputePipelineStateWithFunction:error:",
           imp(+[](void*, SEL, const Function* function, NS::Error** error) -> ComputePipelineState* {
             if (function == nullptr) {
               record_finding("Metal API validation: newComputePipelineStateWithFunction with a nil function");
               return nullptr;
             }
             if (std::string injected = take_fault(&Global::pipeline); !injected.empty()) {
               COUNT(pipeline_failures);
               set_error(error, "CompilerError", 2, injected);
               return nullptr;
             }
             std::string key = function->kernel->name;
             for (auto [index, value] : function->constants) {
               key += "|" + std::to_string(index) + (value ? "=1" : "=0");
             }
             // The device's limit, lowered to the kernel's declared one and
             // to a limit a test set for this kernel.
             NS::UInteger max_threads = kMaxThreadsPerThreadgroup;
             if (function->kernel->declared_max_threads) {
               max_threads = std::min<NS::UInteger>(max_threads, function->kernel->max_threads);
             }
             NS::UInteger width = 32;
             {
               Global& g = global();
               std::lock_guard<std::mutex> lock(g.mutex);
               ++g.counters.pipelines;
               g.pipeline_keys.push_back(key);
               for (const PipelineLimit& l : g.pipeline_limits) {
                 if (std::string_view(function->kernel->name).rfind(l.prefix, 0) != 0) continue;
                 if (l.max_threads != 0) max_threads = std::min(max_threads, l.max_threads);
                 if (l.execution_width != 0) width = l.execution_width;
               }
             }
             return new ComputePipelineState(function->kernel->name, function->constants,
                                             max_threads, width);
           })},
          {"newBufferWithLength:options:",
           imp(+[](void*, SEL, NS::UInteger length, MTL::ResourceOptions) -> Buffer* {
             return new_allocated_buffer(length);
           })},
          {"newBufferWithBytes:length:options:",
           imp(+[](void*, SEL, const void* bytes, NS::UInteger length, MTL::ResourceOptions) -> Buffer* {
             Buffer* b = new_allocated_buffer(length);
             if (b != nullptr) std::memcpy(b->data, bytes, length);
             return b;
           })},
          {"newBufferWithBytesNoCopy:length:options:deallocator:",
           imp(+[](void*, SEL, void* pointer, NS::UInteger length, MTL::ResourceOptions,
                   void* deallocator) -> Buffer* {
             const size_t page = page_size();
             if (reinterpret_cast<uintptr_t>(pointer) % page != 0 || length == 0 ||
                 length % page != 0) {
               COUNT(buffers_no_copy_rejected);
               record_finding("Metal API validation: newBufferWithBytesNoCopy needs a page-aligned "
                              "pointer and length, got " + std::to_string(length) + " bytes at " +
                              std::to_string(reinterpret_cast<uintptr_t>(pointer) % page) +
                              " past a page boundary");
               return nullptr;
             }
             if (deallocator != nullptr) {
               record_finding("newBufferWithBytesNoCopy with a deallocator block: the stand-in "
                              "cannot call blocks");
             }
             {
               Global& g = global();
               std::lock_guard<std::mutex> lock(g.mutex);
               ++g.counters.buffers_no_copy;
               if (g.no_copy_addresses.size() < 4096) {
                 g.no_copy_addresses.push_back(reinterpret_cast<uintptr_t>(pointer));
               }
             }
             return new Buffer(static_cast<char*>(pointer), length, false);
           })},
      },
      &root_methods());
  return *t;
}

// ---------------------------------------------------------------------------
// NSProcessInfo: the macOS version of the system model.
// ---------------------------------------------------------------------------
// The system model, fixed from its first use on.
const SystemModel* chosen_model() {
  Global& g = global();
  std::lock_guard<std::mutex> lock(g.mutex);
  g.model_chosen = true;
  return g.model;
}

NS::OperatingSystemVersion macos_version() {
  const SystemModel* m = chosen_model();
  return NS::OperatingSystemVersion{m->macos[0], m->macos[1], m->macos[2]};
}

const MethodTable& process_info_methods();

struct ProcessInfo : Object {
  ProcessInfo() : Object(&process_info_methods()) { immortal = true; }
};

const MethodTable& process_info_methods() {
  static const MethodTable* t = new MethodTable(
      "NSProcessInfo",
      {
          // A 24-byte struct result: objc_msgSend_stret.
          {"operatingSystemVersion",
           imp(+[](void*, SEL) -> NS::OperatingSystemVersion { return macos_version(); })},
          // A 24-byte struct argument, passed in memory.
          {"isOperatingSystemAtLeastVersion:",
           imp(+[](void*, SEL, NS::OperatingSystemVersion want) -> bool {
             const NS::OperatingSystemVersion v = macos_version();
             if (v.majorVersion != want.majorVersion) return v.majorVersion > want.majorVersion;
             if (v.minorVersion != want.minorVersion) return v.minorVersion > want.minorVersion;
             return v.patchVersion >= want.patchVersion;
           })},
      },
      &root_methods());
  return *t;
}

// ---------------------------------------------------------------------------
// Class objects (what objc_lookUpClass returns).
// ---------------------------------------------------------------------------
struct ClassObject : Object {
  explicit ClassObject(const MethodTable* class_methods) : Object(class_methods) { immortal = true; }
};

template <class T>
void* alloc_instance(void*, SEL) {
  return new T();
}

}  // namespace

Object* class_named(const char* name) {
  static const auto* classes = new std::map<std::string, Object*>{
      {"NSAutoreleasePool",
       new ClassObject(new MethodTable("NSAutoreleasePool class",
                                       {{"alloc", imp(&alloc_instance<AutoreleasePool>)}},
                                       &root_methods()))},
      {"NSString",
       new ClassObject(new MethodTable(
           "NSString class",
           {{"stringWithCString:encoding:",
             imp(+[](void*, SEL, const char* text, NS::StringEncoding encoding) -> String* {
               if (encoding != NS::UTF8StringEncoding && encoding != NS::ASCIIStringEncoding) {
                 record_finding("stringWithCString:encoding: with an encoding the stand-in lacks");
               }
               auto* s = new String(text != nullptr ? text : "");
               s->autorelease();
               return s;
             })}},
           &root_methods()))},
      {"NSProcessInfo",
       new ClassObject(new MethodTable(
           "NSProcessInfo class",
           {{"processInfo", imp(+[](void*, SEL) -> ProcessInfo* {
              static ProcessInfo* info = new ProcessInfo();  // the process's one instance
              return info;
            })}},
           &root_methods()))},
      {"MTLCompileOptions",
       new ClassObject(new MethodTable("MTLCompileOptions class",
                                       {{"alloc", imp(&alloc_instance<CompileOptions>)}},
                                       &root_methods()))},
      {"MTLFunctionConstantValues",
       new ClassObject(new MethodTable("MTLFunctionConstantValues class",
                                       {{"alloc", imp(&alloc_instance<FunctionConstantValues>)}},
                                       &root_methods()))},
  };
  const auto it = classes->find(name);
  return it != classes->end() ? it->second : nullptr;
}

}  // namespace standin

// ---------------------------------------------------------------------------
// Metal's C entry point, and the stand-in's control functions for tests.
// ---------------------------------------------------------------------------
namespace {

std::string json_string(const std::string& s) {
  std::string out = "\"";
  for (unsigned char c : s) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += char(c);
    } else if (c < 0x20) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\u%04x", c);
      out += buf;
    } else {
      out += char(c);
    }
  }
  return out + "\"";
}

}  // namespace

#define STANDIN_API extern "C" __attribute__((visibility("default")))

STANDIN_API MTL::Device* MTLCreateSystemDefaultDevice() {
  using namespace standin;
  static Device* device = [] () -> Device* {
    const SystemModel* model = chosen_model();
    if (model->apple_family == 0) return nullptr;
    COUNT(devices);
    auto* d = new Device(model);
    d->immortal = true;  // the system's device outlives every reference
    return d;
  }();
  return reinterpret_cast<MTL::Device*>(device);
}

// Device observation, which metal-cpp's out-of-line code references: the
// stand-in has one device and never notifies.
STANDIN_API NS::Array* MTLCopyAllDevicesWithObserver(NS::Object**, MTL::DeviceNotificationHandlerBlock) {
  standin::record_finding("MTLCopyAllDevicesWithObserver: the stand-in has no device observers");
  return nullptr;
}

STANDIN_API void MTLRemoveDeviceObserver(const NS::Object*) {
  standin::record_finding("MTLRemoveDeviceObserver: the stand-in has no device observers");
}

// ---------------------------------------------------------------------------
// The IORegistry, as far as the host's GPU core-count lookup reaches it: one
// entry (the device's, registry ID kDeviceRegistryID) whose "gpu-core-count"
// property is the model's core count (absent when 0). CoreFoundation objects
// carry a type and a reference count; io_object_t handles are numbers.
// ---------------------------------------------------------------------------
enum : CFTypeID { kCFStringTypeID = 7, kCFDictionaryTypeID = 18, kCFNumberTypeID = 22 };

struct __CFAllocator {};
struct __CFString {
  CFTypeID type = kCFStringTypeID;
  long refs = 1;
  std::string text;
};
struct __CFDictionary {
  CFTypeID type = kCFDictionaryTypeID;
  long refs = 1;
  uint64_t registry_id = 0;  // the IORegistryEntryIDMatching dictionary's one key
};
struct __CFNumber {
  CFTypeID type = kCFNumberTypeID;
  long refs = 1;
  int64_t value = 0;
};

namespace standin {
namespace {

// A CoreFoundation object's type and reference count (the first members of each).
struct CFHeader {
  CFTypeID type;
  long refs;
};

const char* cf_kind(CFTypeID type) {
  switch (type) {
    case kCFStringTypeID: return "CFString";
    case kCFDictionaryTypeID: return "CFDictionary";
    case kCFNumberTypeID: return "CFNumber";
  }
  return "?";
}

// Live CoreFoundation objects and io_object_t handles (handle -> references).
struct Registry {
  std::set<const void*> cf;
  std::map<io_object_t, long> objects;
  io_object_t next_handle = 0x2503;
};

Registry& registry() {
  static Registry* r = new Registry();
  return *r;
}

void registry_count(const char* kind, long delta) {
  std::lock_guard<std::mutex> lock(global().mutex);
  global().registry_live[kind] += delta;
}

template <class T>
T* new_cf() {
  T* obj = new T();
  {
    std::lock_guard<std::mutex> lock(global().mutex);
    registry().cf.insert(obj);
  }
  registry_count(cf_kind(obj->type), 1);
  return obj;
}

// `cf` as a live CoreFoundation object of `type` (any type when 0), or null
// and a finding.
const CFHeader* live_cf(const void* cf, CFTypeID type, const char* call) {
  bool live;
  {
    std::lock_guard<std::mutex> lock(global().mutex);
    live = cf != nullptr && registry().cf.count(cf) != 0;
  }
  if (!live) {
    record_finding(std::string(call) + ": not a live CoreFoundation object");
    return nullptr;
  }
  const CFHeader* h = static_cast<const CFHeader*>(cf);
  if (type != 0 && h->type != type) {
    record_finding(std::string(call) + ": a " + cf_kind(h->type) + " where a " + cf_kind(type) +
                   " is expected");
    return nullptr;
  }
  return h;
}

void release_cf(const void* cf, const char* call) {
  const CFHeader* h = live_cf(cf, 0, call);
  if (h == nullptr) return;
  if (h->type == kCFStringTypeID) return;  // constant strings (CFSTR) are never freed
  auto* mut = const_cast<CFHeader*>(h);
  if (--mut->refs > 0) return;
  {
    std::lock_guard<std::mutex> lock(global().mutex);
    registry().cf.erase(cf);
  }
  registry_count(cf_kind(h->type), -1);
  if (h->type == kCFDictionaryTypeID) delete static_cast<const __CFDictionary*>(cf);
  if (h->type == kCFNumberTypeID) delete static_cast<const __CFNumber*>(cf);
}

}  // namespace
}  // namespace standin

STANDIN_API const CFAllocatorRef kCFAllocatorDefault = nullptr;

STANDIN_API CFStringRef __CFStringMakeConstantString(const char* text) {
  using namespace standin;
  static std::mutex mutex;
  static std::map<std::string, __CFString*>* strings = new std::map<std::string, __CFString*>();
  std::lock_guard<std::mutex> lock(mutex);
  __CFString*& s = (*strings)[text];
  if (s == nullptr) {
    s = new __CFString();
    s->text = text;
    std::lock_guard<std::mutex> g(global().mutex);
    registry().cf.insert(s);
  }
  return s;
}

STANDIN_API CFTypeID CFGetTypeID(CFTypeRef cf) {
  const standin::CFHeader* h = standin::live_cf(cf, 0, "CFGetTypeID");
  return h != nullptr ? h->type : 0;
}

STANDIN_API CFTypeID CFNumberGetTypeID(void) { return kCFNumberTypeID; }

STANDIN_API Boolean CFNumberGetValue(CFNumberRef number, CFNumberType type, void* out) {
  using namespace standin;
  if (live_cf(number, kCFNumberTypeID, "CFNumberGetValue") == nullptr || out == nullptr) return 0;
  const int64_t v = number->value;
  if (type == kCFNumberSInt64Type) {
    std::memcpy(out, &v, sizeof(v));
    return 1;
  }
  if (type == kCFNumberSInt32Type) {
    const int32_t w = int32_t(v);
    std::memcpy(out, &w, sizeof(w));
    return int64_t(w) == v;
  }
  record_finding("CFNumberGetValue: the stand-in models only kCFNumberSInt32Type and "
                 "kCFNumberSInt64Type");
  return 0;
}

STANDIN_API void CFRelease(CFTypeRef cf) { standin::release_cf(cf, "CFRelease"); }

STANDIN_API CFMutableDictionaryRef IORegistryEntryIDMatching(uint64_t id) {
  using namespace standin;
  COUNT(registry_lookups);
  __CFDictionary* d = new_cf<__CFDictionary>();
  d->registry_id = id;
  return d;
}

// Consumes one reference of `matching`, as IOKit does.
STANDIN_API io_service_t IOServiceGetMatchingService(mach_port_t main_port,
                                                     CFDictionaryRef matching) {
  using namespace standin;
  if (main_port != MACH_PORT_NULL) {
    record_finding("IOServiceGetMatchingService: the stand-in has only the default main port");
  }
  if (live_cf(matching, kCFDictionaryTypeID, "IOServiceGetMatchingService") == nullptr) {
    return IO_OBJECT_NULL;
  }
  const uint64_t id = matching->registry_id;
  release_cf(matching, "IOServiceGetMatchingService");
  // The entry exists when the device does and the ID is its registry ID.
  if (chosen_model()->apple_family == 0 || id != kDeviceRegistryID) return IO_OBJECT_NULL;
  io_service_t handle;
  {
    std::lock_guard<std::mutex> lock(global().mutex);
    handle = registry().next_handle++;
    registry().objects[handle] = 1;
  }
  registry_count("io_service", 1);
  return handle;
}

STANDIN_API CFTypeRef IORegistryEntryCreateCFProperty(io_registry_entry_t entry, CFStringRef key,
                                                      CFAllocatorRef, IOOptionBits options) {
  using namespace standin;
  bool live;
  {
    std::lock_guard<std::mutex> lock(global().mutex);
    live = registry().objects.count(entry) != 0;
  }
  if (!live) {
    record_finding("IORegistryEntryCreateCFProperty: not a live registry entry");
    return nullptr;
  }
  if (live_cf(key, kCFStringTypeID, "IORegistryEntryCreateCFProperty") == nullptr) return nullptr;
  if (options != 0) {
    record_finding("IORegistryEntryCreateCFProperty: options must be 0");
  }
  const int cores = chosen_model()->gpu_cores;
  if (key->text != "gpu-core-count" || cores <= 0) return nullptr;  // no such property
  __CFNumber* n = new_cf<__CFNumber>();
  n->value = cores;
  return n;
}

STANDIN_API kern_return_t IOObjectRelease(io_object_t object) {
  using namespace standin;
  bool released = false, freed = false;
  {
    std::lock_guard<std::mutex> lock(global().mutex);
    auto it = registry().objects.find(object);
    if (it != registry().objects.end()) {
      released = true;
      if (--it->second == 0) {
        registry().objects.erase(it);
        freed = true;
      }
    }
  }
  if (!released) {
    record_finding("IOObjectRelease: not a live io_object_t");
    return 4;  // KERN_INVALID_ARGUMENT
  }
  if (freed) registry_count("io_service", -1);
  return 0;
}

// A JSON object with the keys counters, live_objects, findings, pipelines,
// no_copy_addresses, dispatches (kernel and grid of every dispatch run since
// the last reset), registry_live (IORegistry model objects alive, by kind),
// language_version and fast_math. The last two describe
// the last newLibraryWithSource call: its language version and whether it
// enabled fast math (1 or 0), each -1 before any call. Valid until the next
// call on this thread.
STANDIN_API const char* fatrain_metal_standin_report() {
  using namespace standin;
  thread_local std::string out;
  Global& g = global();
  std::ostringstream s;
  {
    std::lock_guard<std::mutex> lock(g.mutex);
    s << "{\"counters\": {";
    const char* sep = "";
#define STANDIN_JSON(name)                                  \
    s << sep << "\"" #name "\": " << g.counters.name;      \
    sep = ", ";
    STANDIN_COUNTERS(STANDIN_JSON)
#undef STANDIN_JSON
    s << "}, \"pipelines\": [";
    for (size_t i = 0; i < g.pipeline_keys.size(); ++i) {
      s << (i ? ", " : "") << json_string(g.pipeline_keys[i]);
    }
    s << "], \"no_copy_addresses\": [";
    for (size_t i = 0; i < g.no_copy_addresses.size(); ++i) {
      s << (i ? ", " : "") << g.no_copy_addresses[i];
    }
    s << "], \"dispatches\": [";
    for (size_t i = 0; i < g.dispatch_log.size(); ++i) {
      const MTL::Size& grid = g.dispatch_log[i].second;
      s << (i ? ", " : "") << "{\"kernel\": " << json_string(g.dispatch_log[i].first)
        << ", \"grid\": [" << grid.width << ", " << grid.height << ", " << grid.depth << "]}";
    }
    s << "], \"registry_live\": {";
    const char* rsep = "";
    for (const auto& [kind, count] : g.registry_live) {
      s << rsep << json_string(kind) << ": " << count;
      rsep = ", ";
    }
    s << "}, \"language_version\": " << g.language_version << ", \"fast_math\": " << g.fast_math;
  }
  s << ", \"live_objects\": {";
  const char* sep = "";
  for (const auto& [name, count] : live_objects()) {
    s << sep << json_string(name) << ": " << count;
    sep = ", ";
  }
  s << "}, \"findings\": [";
  sep = "";
  for (const std::string& f : findings()) {
    s << sep << json_string(f);
    sep = ", ";
  }
  s << "]}";
  out = s.str();
  return out.c_str();
}

// Clears counters, pipeline list and findings (objects stay as they are).
STANDIN_API void fatrain_metal_standin_reset() {
  using namespace standin;
  Global& g = global();
  {
    std::lock_guard<std::mutex> lock(g.mutex);
    g.counters = Counters();
    g.pipeline_keys.clear();
    g.no_copy_addresses.clear();
    g.dispatch_log.clear();
  }
  clear_findings();
}

// The next `times` operations of kind `what` fail with `message`: "library"
// (newLibraryWithSource), "pipeline" (newComputePipelineStateWithFunction) or
// "execution" (a committed command buffer ends with an error). Returns 0, or
// -1 for an unknown kind.
STANDIN_API int fatrain_metal_standin_fail(const char* what, const char* message, int times) {
  using namespace standin;
  Global& g = global();
  std::lock_guard<std::mutex> lock(g.mutex);
  Fault* f = nullptr;
  const std::string kind = what != nullptr ? what : "";
  if (kind == "library") f = &g.library;
  if (kind == "pipeline") f = &g.pipeline;
  if (kind == "execution") f = &g.execution;
  if (f == nullptr) return -1;
  f->remaining = times;
  f->message = message != nullptr ? message : "";
  return 0;
}

// The system model, chosen before MTLCreateSystemDefaultDevice or
// NSProcessInfo is first used: "apple8" (default; a 10-core Apple8-family
// GPU with Metal 3 on macOS 14.5), "apple8_macos13" (the same on macOS
// 13.6.7, which has no MSL 3.1), "apple6" (too old a GPU for the kernels),
// "none" (no device), "m1" (8 cores), "m2_max" (38 cores), "m4_max" (40
// cores) or "apple8_no_core_count" (an IORegistry entry without
// gpu-core-count). Returns 0, -1 when unknown or too late.
STANDIN_API int fatrain_metal_standin_set_device(const char* model) {
  using namespace standin;
  const SystemModel* m = find_model(model != nullptr ? model : "");
  if (m == nullptr) return -1;
  Global& g = global();
  std::lock_guard<std::mutex> lock(g.mutex);
  if (g.model_chosen) return -1;
  g.model = m;
  return 0;
}

// Pipelines created from now on for kernels whose names start with `prefix`
// report at most `max_threads` as maxTotalThreadsPerThreadgroup and
// `execution_width` as threadExecutionWidth (0: leave as is); a null prefix
// removes every limit set so far. Returns 0.
STANDIN_API int fatrain_metal_standin_limit_pipelines(const char* prefix, unsigned long max_threads,
                                                      unsigned long execution_width) {
  using namespace standin;
  Global& g = global();
  std::lock_guard<std::mutex> lock(g.mutex);
  if (prefix == nullptr) {
    g.pipeline_limits.clear();
  } else {
    g.pipeline_limits.push_back({prefix, max_threads, execution_width});
  }
  return 0;
}
