// Self-test of the Metal stand-in: misuses of the Metal API, made through
// metal-cpp as a host would, must each be reported (a finding, a failed
// command buffer or an NSError), so that "no findings" after a test means
// something. Reached from Python as fatrain_metal_standin_selftest().

#include <Foundation/Foundation.hpp>
#include <Metal/Metal.hpp>

#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "objc_runtime.h"

// The built-in library's source text (library_source.S, NUL-terminated).
extern "C" const char fatrain_standin_library_source[];
// metal_standin.cc: limits that pipelines created later report.
extern "C" int fatrain_metal_standin_limit_pipelines(const char* prefix, unsigned long max_threads,
                                                     unsigned long execution_width);

namespace {

struct SelfTest {
  std::string log;
  int failures = 0;

  // Runs `misuse` and expects a finding that contains `phrase`.
  void expect_finding(const char* name, const char* phrase, const std::function<void()>& misuse) {
    standin::clear_findings();
    misuse();
    const std::vector<std::string> found = standin::findings();
    bool ok = false;
    for (const std::string& f : found) ok = ok || f.find(phrase) != std::string::npos;
    note(ok, name, found.empty() ? "no finding" : found.front());
  }

  void note(bool ok, const char* name, const std::string& detail) {
    failures += ok ? 0 : 1;
    log += std::string(ok ? "ok " : "FAILED ") + name + ": " + detail + "\n";
  }
};

// The message-send trampolines against the calling convention: more integer
// and floating-point arguments than registers, structs passed in memory (by
// reference on arm64), a double result (objc_msgSend_fpret on x86-64), a
// struct result returned through memory (objc_msgSend_stret on x86-64,
// through x8 on arm64), homogeneous float aggregates (in v0-v3 on arm64),
// bool and 8- and 16-bit arguments past the registers, and messages to nil.
double probe_arguments(void*, SEL, int64_t a, int64_t b, int64_t c, int64_t d, int64_t e,
                       double x0, double x1, double x2, double x3, double x4, double x5,
                       double x6, double x7, double x8, MTL::Size size, int32_t last) {
  return double(a + 2 * b + 3 * c + 4 * d + 5 * e) +
         (x0 + 2 * x1 + 3 * x2 + 4 * x3 + 5 * x4 + 6 * x5 + 7 * x6 + 8 * x7 + 9 * x8) +
         double(size.width * 100 + size.height * 10 + size.depth) + last * 1000.0;
}

MTL::Size probe_struct_result(void*, SEL, MTL::Size in, NS::UInteger add) {
  return MTL::Size(in.width + add, in.height + add, in.depth + add);
}

// MTL::ClearColor: four doubles, a homogeneous aggregate (v0-v3 on arm64).
MTL::ClearColor probe_hfa(void*, SEL, MTL::ClearColor in, float scale) {
  return MTL::ClearColor(in.red * scale, in.green * scale, in.blue * scale, in.alpha * scale);
}

// Eight integer registers taken, then small arguments on the stack (Apple's
// arm64 packs them at their own size, AAPCS64 in 8-byte slots: caller and
// implementation must agree, and the trampoline must leave the stack as is).
int64_t probe_small_arguments(void*, SEL, int64_t a, int64_t b, int64_t c, int64_t d, int64_t e,
                              int64_t f, bool flag, int8_t s8, uint16_t u16, bool flag2,
                              int32_t s32) {
  return a + b + c + d + e + f + (flag ? 1000 : 0) + s8 * 10000 + u16 * 100000 +
         (flag2 ? 7 : 0) + int64_t(s32) * 1000000000;
}

// metal-cpp's message send, as its wrappers use it (protected in NS::Object).
struct Send : NS::Object {
  using NS::Object::sendMessage;
};

void check_trampolines(SelfTest& t) {
  static const standin::MethodTable table(
      "ABIProbe",
      {{"probeArguments", standin::imp(&probe_arguments)},
       {"probeStructResult", standin::imp(&probe_struct_result)},
       {"probeHFA", standin::imp(&probe_hfa)},
       {"probeSmallArguments", standin::imp(&probe_small_arguments)}},
      &standin::root_methods());
  auto* probe = new standin::Object(&table);
  const double got = Send::sendMessage<double>(
      probe, standin::sel("probeArguments"), int64_t(1), int64_t(2), int64_t(3), int64_t(4),
      int64_t(5), 0.5, 1.5, 2.5, 3.5, 4.5, 5.5, 6.5, 7.5, 8.5, MTL::Size(7, 8, 9), int32_t(-3));
  const double want = probe_arguments(nullptr, nullptr, 1, 2, 3, 4, 5, 0.5, 1.5, 2.5, 3.5, 4.5,
                                      5.5, 6.5, 7.5, 8.5, MTL::Size(7, 8, 9), -3);
  t.note(got == want, "a double result of 14 arguments and a struct",
         std::to_string(got) + " (want " + std::to_string(want) + ")");
  const MTL::Size r = Send::sendMessage<MTL::Size>(probe, standin::sel("probeStructResult"),
                                                         MTL::Size(1, 2, 3), NS::UInteger(10));
  t.note(r.width == 11 && r.height == 12 && r.depth == 13, "a 24-byte struct result",
         std::to_string(r.width) + "," + std::to_string(r.height) + "," + std::to_string(r.depth));
  const MTL::ClearColor c = Send::sendMessage<MTL::ClearColor>(
      probe, standin::sel("probeHFA"), MTL::ClearColor(1, 2, 3, 4), 0.5f);
  t.note(c.red == 0.5 && c.green == 1 && c.blue == 1.5 && c.alpha == 2,
         "a homogeneous float aggregate argument and result",
         std::to_string(c.red) + "," + std::to_string(c.green) + "," + std::to_string(c.blue) +
             "," + std::to_string(c.alpha));
  const int64_t small = Send::sendMessage<int64_t>(
      probe, standin::sel("probeSmallArguments"), int64_t(1), int64_t(2), int64_t(3), int64_t(4),
      int64_t(5), int64_t(6), true, int8_t(-3), uint16_t(65535), true, int32_t(-2));
  const int64_t small_want = probe_small_arguments(nullptr, nullptr, 1, 2, 3, 4, 5, 6, true, -3,
                                                   65535, true, -2);
  t.note(small == small_want, "bool, 8- and 16-bit arguments on the stack",
         std::to_string(small) + " (want " + std::to_string(small_want) + ")");
  const double nil_double = Send::sendMessage<double>(nullptr, standin::sel("probeArguments"));
  const NS::UInteger nil_int = Send::sendMessage<NS::UInteger>(nullptr, standin::sel("length"));
  t.note(nil_double == 0.0 && nil_int == 0, "messages to nil return 0", "");
  probe->release();

  // NSProcessInfo through metal-cpp: a 24-byte struct result (stret) and a
  // 24-byte struct argument (passed in memory), against the default model's
  // macOS 14.5.0.
  NS::ProcessInfo* info = NS::ProcessInfo::processInfo();
  const NS::OperatingSystemVersion v = info->operatingSystemVersion();
  t.note(v.majorVersion == 14 && v.minorVersion == 5 && v.patchVersion == 0,
         "NSProcessInfo operatingSystemVersion",
         std::to_string(v.majorVersion) + "." + std::to_string(v.minorVersion) + "." +
             std::to_string(v.patchVersion));
  const bool at_least[] = {
      info->isOperatingSystemAtLeastVersion(NS::OperatingSystemVersion{14, 0, 0}),
      info->isOperatingSystemAtLeastVersion(NS::OperatingSystemVersion{14, 5, 0}),
      info->isOperatingSystemAtLeastVersion(NS::OperatingSystemVersion{13, 9, 9}),
      !info->isOperatingSystemAtLeastVersion(NS::OperatingSystemVersion{14, 5, 1}),
      !info->isOperatingSystemAtLeastVersion(NS::OperatingSystemVersion{14, 6, 0}),
      !info->isOperatingSystemAtLeastVersion(NS::OperatingSystemVersion{15, 0, 0})};
  std::string answers;
  for (bool ok : at_least) answers += ok ? "1" : "0";
  t.note(answers == "111111", "NSProcessInfo isOperatingSystemAtLeastVersion", answers);
}

}  // namespace

extern "C" __attribute__((visibility("default"))) const char* fatrain_metal_standin_selftest() {
  thread_local std::string out;
  SelfTest t;
  check_trampolines(t);
  NS::AutoreleasePool* pool = NS::AutoreleasePool::alloc()->init();
  MTL::Device* device = MTL::CreateSystemDefaultDevice();
  if (device == nullptr) {
    out = "FAILED no device\n";
    return out.c_str();
  }
  MTL::CommandQueue* queue = device->newCommandQueue();
  const uint32_t word = 0;

  t.expect_finding("commit twice", "already committed", [&] {
    MTL::CommandBuffer* cb = queue->commandBuffer();
    cb->commit();
    cb->commit();
  });

  t.expect_finding("encoder used after endEncoding", "after endEncoding", [&] {
    MTL::CommandBuffer* cb = queue->commandBuffer();
    MTL::ComputeCommandEncoder* enc = cb->computeCommandEncoder();
    enc->endEncoding();
    enc->setBytes(&word, sizeof word, 0);
    cb->commit();
    cb->waitUntilCompleted();
    t.note(cb->status() == MTL::CommandBufferStatusError, "  ... fails the command buffer",
           cb->error() != nullptr ? cb->error()->localizedDescription()->utf8String() : "no error");
  });

  t.expect_finding("commit before endEncoding", "had not called endEncoding", [&] {
    MTL::CommandBuffer* cb = queue->commandBuffer();
    cb->computeCommandEncoder();
    cb->commit();
  });

  t.expect_finding("wait on an uncommitted command buffer", "never committed",
                   [&] { queue->commandBuffer()->waitUntilCompleted(); });

  t.expect_finding("unaligned no-copy buffer", "page-aligned", [&] {
    std::vector<char> memory(3 * 65536);
    MTL::Buffer* b = device->newBuffer(memory.data() + 1, 65536, MTL::ResourceStorageModeShared,
                                       nullptr);
    t.note(b == nullptr, "  ... returns nil", b == nullptr ? "nil" : "a buffer");
  });

  t.expect_finding("setBytes over 4 KiB", "at most 4096 bytes", [&] {
    std::vector<char> big(8192);
    MTL::CommandBuffer* cb = queue->commandBuffer();
    MTL::ComputeCommandEncoder* enc = cb->computeCommandEncoder();
    enc->setBytes(big.data(), big.size(), 0);
    enc->endEncoding();
  });

  t.expect_finding("dispatch with no pipeline", "no compute pipeline state", [&] {
    MTL::CommandBuffer* cb = queue->commandBuffer();
    MTL::ComputeCommandEncoder* enc = cb->computeCommandEncoder();
    enc->dispatchThreadgroups(MTL::Size(1, 1, 1), MTL::Size(32, 1, 1));
    enc->endEncoding();
  });

  // A pipeline of the built-in library, for the dispatch checks below.
  NS::Error* error = nullptr;
  MTL::Library* library = nullptr;
  {
    MTL::CompileOptions* options = MTL::CompileOptions::alloc()->init();
    library = device->newLibrary(NS::String::string(fatrain_standin_library_source,
                                                    NS::UTF8StringEncoding),
                                 options, &error);
    options->release();
  }
  MTL::ComputePipelineState* pso = nullptr;
  if (library != nullptr) {
    MTL::FunctionConstantValues* values = MTL::FunctionConstantValues::alloc()->init();
    MTL::Function* missing = library->newFunction(
        NS::String::string("flash_attn_train_fwd_f32_d64", NS::UTF8StringEncoding), values, &error);
    const std::string text = error != nullptr ? error->localizedDescription()->utf8String() : "";
    t.note(missing == nullptr && text.find("with no value") != std::string::npos,
           "function constant without a value", text.empty() ? "no error" : text);
    MTL::Function* f = library->newFunction(
        NS::String::string("flash_attn_train_bwd_compute_d_f32", NS::UTF8StringEncoding), values,
        &error);
    values->release();
    if (f != nullptr) {
      pso = device->newComputePipelineState(f, &error);
      f->release();
    }
  }
  t.note(pso != nullptr, "a pipeline of the built-in library",
         pso != nullptr || error == nullptr ? "" : error->localizedDescription()->utf8String());
  if (pso != nullptr) {
    t.expect_finding("too many threads per threadgroup", "threads per threadgroup", [&] {
      MTL::CommandBuffer* cb = queue->commandBuffer();
      MTL::ComputeCommandEncoder* enc = cb->computeCommandEncoder();
      enc->setComputePipelineState(pso);
      enc->dispatchThreadgroups(MTL::Size(1, 1, 1), MTL::Size(32, 64, 1));
      enc->endEncoding();
    });
    // A pipeline whose limit is below the device's (as for a kernel with many
    // registers): a dispatch within the device's limit but over the pipeline's.
    fatrain_metal_standin_limit_pipelines("flash_attn_train_bwd_compute_d_f32", 64, 16);
    MTL::FunctionConstantValues* values = MTL::FunctionConstantValues::alloc()->init();
    MTL::Function* f = library->newFunction(
        NS::String::string("flash_attn_train_bwd_compute_d_f32", NS::UTF8StringEncoding), values,
        &error);
    values->release();
    MTL::ComputePipelineState* limited = f != nullptr ? device->newComputePipelineState(f, &error)
                                                      : nullptr;
    if (f != nullptr) f->release();
    fatrain_metal_standin_limit_pipelines(nullptr, 0, 0);
    // The unlimited pipeline reports the kernel's declared bound (compute-D:
    // max_total_threads_per_threadgroup(128)), below the device's 1024.
    t.note(limited != nullptr && limited->maxTotalThreadsPerThreadgroup() == 64 &&
               limited->threadExecutionWidth() == 16 && pso->maxTotalThreadsPerThreadgroup() == 128 &&
               pso->threadExecutionWidth() == 32,
           "pipeline limits set for a kernel", "");
    if (limited != nullptr) {
      t.expect_finding("more threads than the pipeline allows", "allows 1 to 64", [&] {
        MTL::CommandBuffer* cb = queue->commandBuffer();
        MTL::ComputeCommandEncoder* enc = cb->computeCommandEncoder();
        enc->setComputePipelineState(limited);
        enc->dispatchThreadgroups(MTL::Size(1, 1, 1), MTL::Size(32, 4, 1));
        enc->endEncoding();
      });
      limited->release();
    }
    t.expect_finding("shared buffer without a barrier", "with no memoryBarrier", [&] {
      MTL::Buffer* shared = device->newBuffer(4096, MTL::ResourceStorageModeShared);
      MTL::CommandBuffer* cb = queue->commandBuffer();
      MTL::ComputeCommandEncoder* enc = cb->computeCommandEncoder(MTL::DispatchTypeConcurrent);
      enc->setComputePipelineState(pso);
      enc->setBuffer(shared, 0, 13);
      enc->dispatchThreadgroups(MTL::Size(1, 1, 1), MTL::Size(32, 1, 1));
      enc->dispatchThreadgroups(MTL::Size(1, 1, 1), MTL::Size(32, 1, 1));
      enc->endEncoding();
      cb->commit();
      shared->release();
    });
    pso->release();
  }
  if (library != nullptr) library->release();

  t.expect_finding("message to a released object", "sent to a deallocated", [&] {
    MTL::CompileOptions* options = MTL::CompileOptions::alloc()->init();
    options->release();
    options->setFastMathEnabled(false);
  });

  t.expect_finding("unknown selector", "unrecognized selector", [&] {
    // maxThreadsPerThreadgroup returns MTL::Size (objc_msgSend_stret on x86-64).
    (void)device->maxThreadsPerThreadgroup();
  });

  t.expect_finding("autorelease with no pool", "no pool in place", [&] {
    std::thread([] { NS::String::string("leaked", NS::UTF8StringEncoding); }).join();
  });

  queue->release();
  pool->release();
  standin::clear_findings();
  out = "failures " + std::to_string(t.failures) + "\n" + t.log;
  return out.c_str();
}
