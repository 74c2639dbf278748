// The macOS Metal host: executes a dispatch plan with metal-cpp. See executor.h.
//
// Plain C++17 over metal-cpp (no Objective-C++), so that the whole file
// type-checks on Linux against the real metal-cpp headers
// (tests/metal_typecheck/run.sh).

#define NS_PRIVATE_IMPLEMENTATION
#define MTL_PRIVATE_IMPLEMENTATION
#include <CoreFoundation/CoreFoundation.h>
#include <Foundation/Foundation.hpp>
#include <IOKit/IOKitLib.h>
#include <Metal/Metal.hpp>

#include "metal/host/executor.h"

#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <map>
#include <mutex>
#include <unordered_map>
#include <vector>

namespace fatrain::metal {

namespace mp = fatrain::metal_plan;

namespace {

// The kernels use bfloat, which needs Metal Shading Language 3.1; macOS 14 is
// the first release whose Metal compiles (and loads) MSL 3.1.
constexpr MTL::LanguageVersion kLanguageVersion = MTL::LanguageVersion3_1;
constexpr NS::Integer kFirstMacOS = 14;

std::string describe(const NS::Error* error) {
  if (error == nullptr) return "no error description";
  const NS::String* text = error->localizedDescription();
  return text != nullptr ? text->utf8String() : "no error description";
}

NS::String* ns_string(const std::string& s) {
  return NS::String::string(s.c_str(), NS::UTF8StringEncoding);
}

// Objects that metal-cpp returns autoreleased (strings, command buffers,
// encoders) are freed when this scope ends; XLA's threads have no pool of
// their own.
struct AutoreleaseScope {
  NS::AutoreleasePool* pool = NS::AutoreleasePool::alloc()->init();
  ~AutoreleaseScope() { pool->release(); }
};

// Reusable shared-storage buffers for operands that cannot be bound in place.
class StagingPool {
 public:
  MTL::Buffer* acquire(MTL::Device* device, NS::UInteger bytes) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      auto it = free_.lower_bound(bytes);
      if (it != free_.end() && it->first <= 2 * bytes + 65536) {
        MTL::Buffer* b = it->second;
        free_.erase(it);
        return b;
      }
    }
    return device->newBuffer(bytes, MTL::ResourceStorageModeShared);
  }
  void release(MTL::Buffer* b) {
    std::lock_guard<std::mutex> lock(mutex_);
    free_.emplace(b->length(), b);
    while (free_.size() > kMaxFree) {  // drop the smallest
      free_.begin()->second->release();
      free_.erase(free_.begin());
    }
  }

 private:
  static constexpr size_t kMaxFree = 32;
  std::mutex mutex_;
  std::multimap<NS::UInteger, MTL::Buffer*> free_;
};

struct State {
  std::mutex mutex;  // guards initialization and the pipeline cache
  bool initialized = false;
  std::string init_error;
  MTL::Device* device = nullptr;
  MTL::CommandQueue* queue = nullptr;
  MTL::Library* kernels = nullptr;  // the compiled kernel library
  int gpu_cores = -1;               // the device's core count; -1: not looked up yet
  std::unordered_map<std::string, MTL::ComputePipelineState*> pipelines;
  StagingPool staging;
};

State& state() {
  static State* s = new State();  // lives as long as the process
  return *s;
}

MTL::Device* system_device(State& s) {
  if (s.device == nullptr) s.device = MTL::CreateSystemDefaultDevice();
  return s.device;
}

// The "gpu-core-count" property of the device's IORegistry entry, or 0 when
// the entry, the property or a positive integer in it is missing. The entry
// is the one whose registry ID the MTLDevice reports: on Apple GPUs the AGX
// accelerator service, which carries the core count.
int lookup_gpu_core_count(const MTL::Device* device) {
  // IOServiceGetMatchingService consumes the matching dictionary.
  CFMutableDictionaryRef matching = IORegistryEntryIDMatching(device->registryID());
  if (matching == nullptr) return 0;
  const io_service_t entry = IOServiceGetMatchingService(MACH_PORT_NULL, matching);
  if (entry == IO_OBJECT_NULL) return 0;
  CFTypeRef value =
      IORegistryEntryCreateCFProperty(entry, CFSTR("gpu-core-count"), kCFAllocatorDefault, 0);
  IOObjectRelease(entry);
  if (value == nullptr) return 0;
  int64_t cores = 0;
  if (CFGetTypeID(value) != CFNumberGetTypeID() ||
      !CFNumberGetValue(static_cast<CFNumberRef>(value), kCFNumberSInt64Type, &cores)) {
    cores = 0;
  }
  CFRelease(value);
  return cores > 0 && cores <= 65535 ? int(cores) : 0;
}

// The pipeline for a kernel with its bool function constants, built once.
MTL::ComputePipelineState* pipeline(State& s, const mp::Dispatch& d, std::string* err) {
  std::string key = d.kernel;
  for (auto [index, value] : d.constants) key += "|" + std::to_string(index) + (value ? "=1" : "=0");
  std::lock_guard<std::mutex> lock(s.mutex);
  if (auto it = s.pipelines.find(key); it != s.pipelines.end()) return it->second;
  MTL::FunctionConstantValues* values = MTL::FunctionConstantValues::alloc()->init();
  for (auto [index, value] : d.constants) {
    const bool v = value;
    values->setConstantValue(&v, MTL::DataTypeBool, NS::UInteger(index));
  }
  NS::Error* error = nullptr;
  MTL::Function* function = s.kernels->newFunction(ns_string(d.kernel), values, &error);
  values->release();
  if (function == nullptr) {
    *err = "kernel " + d.kernel + " not found or not specialisable: " + describe(error);
    return nullptr;
  }
  MTL::ComputePipelineState* pso = s.device->newComputePipelineState(function, &error);
  function->release();
  if (pso == nullptr) {
    *err = "pipeline for " + d.kernel + " failed: " + describe(error);
    return nullptr;
  }
  s.pipelines.emplace(key, pso);
  return pso;
}

// "" when the pipeline can run dispatch `d` as planned, else why not: Metal
// refuses more threads per threadgroup than the pipeline's
// maxTotalThreadsPerThreadgroup (the compiler lowers it below the device's
// limit for a kernel with many registers, or to a kernel's declared
// [[max_total_threads_per_threadgroup]]); and the kernels' simdgroup code is
// written for the plan's 32-thread simdgroups (threadExecutionWidth).
std::string check_limits(const MTL::ComputePipelineState* pso, const mp::Dispatch& d) {
  const uint64_t threads = d.threads_per_threadgroup();
  const NS::UInteger allowed = pso->maxTotalThreadsPerThreadgroup();
  if (threads > allowed) {
    return "kernel " + d.kernel + " allows " + std::to_string(allowed) +
           " threads per threadgroup on this device (maxTotalThreadsPerThreadgroup), the plan "
           "asks for " + std::to_string(threads);
  }
  const NS::UInteger width = pso->threadExecutionWidth();
  if (width != mp::kSimdgroupWidth) {
    return "kernel " + d.kernel + " runs " + std::to_string(width) +
           " threads per SIMD group on this device (threadExecutionWidth), the kernels are "
           "written for " + std::to_string(mp::kSimdgroupWidth);
  }
  return "";
}

// Buffers bound for one execution; returned to the pool or released at the end.
struct Staged {
  MTL::Buffer* buffer;
  void* host;
  size_t bytes;
  bool output;
};
struct CallBuffers {
  State& s;
  std::vector<MTL::Buffer*> wrapped;  // no-copy views of host memory
  std::vector<MTL::Buffer*> pooled;   // staging and scratch
  std::vector<Staged> staged;
  explicit CallBuffers(State& st) : s(st) {}
  ~CallBuffers() {
    for (MTL::Buffer* b : wrapped) b->release();
    for (MTL::Buffer* b : pooled) s.staging.release(b);
  }
};

bool page_aligned(const void* p, size_t bytes) {
  static const size_t page = size_t(sysconf(_SC_PAGESIZE));
  return reinterpret_cast<uintptr_t>(p) % page == 0 && bytes % page == 0 && bytes > 0;
}

MTL::Buffer* bind_host(State& s, void* host, size_t bytes, bool output, bool poison,
                       CallBuffers* call) {
  if (poison && output) std::memset(host, 0xFF, bytes);
  if (page_aligned(host, bytes)) {
    MTL::Buffer* b = s.device->newBuffer(host, bytes, MTL::ResourceStorageModeShared, nullptr);
    if (b != nullptr) {
      call->wrapped.push_back(b);
      return b;
    }
  }
  MTL::Buffer* b = s.staging.acquire(s.device, bytes);
  if (b == nullptr) return nullptr;
  call->pooled.push_back(b);
  call->staged.push_back({b, host, bytes, output});
  if (!output) {
    std::memcpy(b->contents(), host, bytes);
  } else if (poison) {
    std::memset(b->contents(), 0xFF, bytes);
  }
  return b;
}

}  // namespace

std::string device_name() {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  AutoreleaseScope arp;
  MTL::Device* device = system_device(s);
  return device != nullptr ? device->name()->utf8String() : "";
}

int gpu_core_count() {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  if (s.gpu_cores < 0) {
    AutoreleaseScope arp;
    const MTL::Device* device = system_device(s);
    s.gpu_cores = device != nullptr ? lookup_gpu_core_count(device) : 0;
  }
  return s.gpu_cores;
}

std::string unsupported_reason() {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  AutoreleaseScope arp;
  MTL::Device* device = system_device(s);
  if (device == nullptr) return "no Metal device (MTLCreateSystemDefaultDevice returned nil)";
  // simdgroup_matrix and bfloat need an Apple7 (M1) or newer GPU with Metal 3;
  // virtual machines' paravirtual devices are below that.
  if (!device->supportsFamily(MTL::GPUFamilyApple7) || !device->supportsFamily(MTL::GPUFamilyMetal3)) {
    return std::string("the Metal device '") + device->name()->utf8String() +
           "' is not an Apple7+ (M1 or newer) GPU with Metal 3";
  }
  // The Metal 3 family does not imply MSL 3.1: on macOS 13 compiling the
  // library would fail.
  NS::ProcessInfo* process = NS::ProcessInfo::processInfo();
  if (!process->isOperatingSystemAtLeastVersion(NS::OperatingSystemVersion{kFirstMacOS, 0, 0})) {
    const NS::OperatingSystemVersion v = process->operatingSystemVersion();
    return "macOS " + std::to_string(kFirstMacOS) +
           " or newer is needed for Metal Shading Language 3.1 (the kernels' bfloat); found "
           "macOS " + std::to_string(v.majorVersion) + "." + std::to_string(v.minorVersion) +
           "." + std::to_string(v.patchVersion);
  }
  return "";
}

std::string initialize(const std::string& source, const std::string& metallib_path) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  if (s.initialized) return s.init_error;
  s.initialized = true;
  AutoreleaseScope arp;
  if (system_device(s) == nullptr) {
    return s.init_error = "no Metal device (MTLCreateSystemDefaultDevice returned nil)";
  }
  s.queue = s.device->newCommandQueue();
  if (s.queue == nullptr) return s.init_error = "could not create a Metal command queue";
  NS::Error* error = nullptr;
  if (!metallib_path.empty()) {
    s.kernels = s.device->newLibrary(ns_string(metallib_path), &error);
  }
  if (s.kernels == nullptr) {
    MTL::CompileOptions* options = MTL::CompileOptions::alloc()->init();
    options->setLanguageVersion(kLanguageVersion);
    // The kernels rely on IEEE infinities (fully masked rows: L = -inf).
    options->setFastMathEnabled(false);
    error = nullptr;
    s.kernels = s.device->newLibrary(ns_string(source), options, &error);
    options->release();
  }
  if (s.kernels == nullptr) {
    return s.init_error = "compiling the Metal kernels failed: " + describe(error);
  }
  return s.init_error = "";
}

std::string execute(const mp::Problem& problem, const mp::Plan& plan,
                    const mp::RoleBuffers& memory, bool poison_outputs) {
  State& s = state();
  {
    std::lock_guard<std::mutex> lock(s.mutex);
    if (!s.initialized) return "the Metal executor is not initialized";
    if (!s.init_error.empty()) return s.init_error;
  }
  AutoreleaseScope arp;

  // Pipelines first: nothing is encoded when one of them fails.
  std::vector<MTL::ComputePipelineState*> pipelines;
  for (const mp::Dispatch& d : plan.dispatches) {
    std::string err;
    MTL::ComputePipelineState* pso = pipeline(s, d, &err);
    if (pso == nullptr) return err;
    if (std::string e = check_limits(pso, d); !e.empty()) return e;
    pipelines.push_back(pso);
  }

  // A Metal buffer per role: the plan's scratch, then the caller's operands.
  CallBuffers call(s);
  MTL::Buffer* role_buffer[mp::RoleBuffers::kRoles] = {};
  for (const mp::Scratch& sc : plan.scratch) {
    MTL::Buffer* b = s.staging.acquire(s.device, sc.bytes);
    if (b == nullptr) return "could not allocate " + std::to_string(sc.bytes) + " bytes of scratch";
    call.pooled.push_back(b);
    role_buffer[int(sc.role)] = b;
  }
  for (const mp::Dispatch& d : plan.dispatches) {
    for (const mp::Binding& b : d.bindings) {
      const int r = int(b.role);
      if (b.is_bytes || role_buffer[r] != nullptr) continue;
      if (memory.data[r] == nullptr) {
        return "kernel " + d.kernel + ": no memory for " + mp::role_name(b.role) + " (buffer(" +
               std::to_string(b.index) + "))";
      }
      const uint64_t need = mp::required_bytes(problem, b.role);
      if (memory.size[r] < need) {
        return std::string("metal: ") + mp::role_name(b.role) +
               " buffer too small: expected at least " + std::to_string(need) + " bytes, got " +
               std::to_string(memory.size[r]);
      }
      role_buffer[r] = bind_host(s, memory.data[r], memory.size[r], memory.output[r],
                                 poison_outputs, &call);
      if (role_buffer[r] == nullptr) {
        return "could not allocate a " + std::to_string(memory.size[r]) + "-byte staging buffer";
      }
    }
  }

  // One command buffer; a barrier between dispatches (each depends on the previous).
  MTL::CommandBuffer* cb = s.queue->commandBuffer();
  MTL::ComputeCommandEncoder* enc = cb->computeCommandEncoder(MTL::DispatchTypeConcurrent);
  for (size_t i = 0; i < plan.dispatches.size(); ++i) {
    const mp::Dispatch& d = plan.dispatches[i];
    if (i > 0) enc->memoryBarrier(MTL::BarrierScopeBuffers);
    enc->setComputePipelineState(pipelines[i]);
    for (const mp::Binding& b : d.bindings) {
      if (b.is_bytes) {
        enc->setBytes(b.bytes.data(), b.bytes.size(), NS::UInteger(b.index));
      } else {
        enc->setBuffer(role_buffer[int(b.role)], 0, NS::UInteger(b.index));
      }
    }
    if (d.threadgroup_memory_length > 0) enc->setThreadgroupMemoryLength(d.threadgroup_memory_length, 0);
    enc->dispatchThreadgroups(MTL::Size(d.grid[0], d.grid[1], d.grid[2]),
                              MTL::Size(d.threadgroup[0], d.threadgroup[1], d.threadgroup[2]));
  }
  enc->endEncoding();
  cb->commit();
  cb->waitUntilCompleted();
  if (cb->status() != MTL::CommandBufferStatusCompleted) {
    return "the Metal command buffer failed: " + describe(cb->error());
  }
  for (const Staged& st : call.staged) {
    if (st.output) std::memcpy(st.host, st.buffer->contents(), st.bytes);
  }
  return "";
}

}  // namespace fatrain::metal
