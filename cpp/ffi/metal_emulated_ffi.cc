// XLA FFI handlers of the `metal_emulated` implementation (cpu platform): the
// Metal backend's dispatch plan (cpp/metal/plan) executed by the MSL emulator
// (cpp/metal/emulator), which runs the unmodified jax_fatrain/metal/*.metal
// kernels on the CPU. A test tool: it checks the Metal kernels off-Mac, slowly.
//
// Operand conventions are those of the cpu target (jax_fatrain/_backends/_ffi.py); the
// mapping of XLA buffers onto the plan is shared with the macOS host
// (cpp/ffi/metal_ffi_common.h).
//
// Profiling (jax_fatrain/emulator/profile.py): while recording is on, every call
// runs its dispatches with cost counters (optionally on a sample of each
// dispatch's threadgroups) and appends one record per dispatch to a
// process-wide log; profile_stop() returns them.

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <type_traits>
#include <vector>

#include "metal_ffi_common.h"
#include "pool_parallel_for.h"
#include "metal/plan/plan.h"
#include "msl_emulator/plan_executor.h"
#include "msl_emulator/runtime.h"
#include "nanobind/nanobind.h"
#include "nanobind/stl/string.h"
#include "nanobind/stl/vector.h"
#include "xla/ffi/api/ffi.h"

// tests/metal_emulator/emulator_selftest.cc
int msl_emulator_selftest(std::string* log);

namespace ffi = xla::ffi;
namespace nb = nanobind;
namespace mp = fatrain::metal_plan;

namespace {

using fatrain::metal_ffi::Attributes;
constexpr const char* kWho = "jax_fatrain metal_emulated";

msl::rt::ParallelFor MakeParallel(ffi::ThreadPool& pool) {
  msl::rt::ParallelFor p;
  if (pool.num_threads() <= 1) return p;
  p.run = fatrain::ffi_glue::RunOnPool;
  p.self = &pool;
  p.num_threads = pool.num_threads();
  return p;
}

// The process-wide profiling log.
struct ProfiledDispatch {
  uint64_t call;       // FFI call number since recording started
  const char* target;  // "forward" or "backward"
  msl::emu::DispatchRecord record;
};
struct ProfileLog {
  std::mutex mutex;
  bool recording = false;
  msl::rt::Sampling sample;
  uint64_t calls = 0;
  std::vector<ProfiledDispatch> dispatches;
};
ProfileLog& profile_log() {
  static ProfileLog log;
  return log;
}

// The core count of the GPU the emulator stands for, which the backward plan
// sizes its splits by (0: not known, the plan's default; set_gpu_cores).
std::atomic<int>& emulated_gpu_cores() {
  static std::atomic<int> cores{0};
  return cores;
}

ffi::Error Run(const char* target, const mp::Problem& p, const mp::Plan& plan,
               const mp::RoleBuffers& roles, ffi::ThreadPool& pool) {
  fatrain::metal_ffi::PoisonHostOutputs(roles);
  msl::emu::RoleMemory m;
  static_assert(sizeof(m.data) / sizeof(m.data[0]) == mp::RoleBuffers::kRoles &&
                    sizeof(m.size) / sizeof(m.size[0]) == mp::RoleBuffers::kRoles,
                "RoleMemory must hold every role of RoleBuffers");
  for (int r = 0; r < mp::RoleBuffers::kRoles; ++r) {
    m.data[r] = roles.data[r];
    m.size[r] = roles.size[r];
  }
  bool recording;
  msl::rt::Sampling sample;
  uint64_t call = 0;
  {
    ProfileLog& log = profile_log();
    std::lock_guard<std::mutex> lock(log.mutex);
    recording = log.recording;
    sample = log.sample;
    if (recording) call = log.calls++;
  }
  if (!recording) {
    return fatrain::metal_ffi::Status(kWho, msl::emu::execute_plan(p, plan, m, MakeParallel(pool)));
  }
  std::vector<msl::emu::DispatchRecord> records;
  std::string err = msl::emu::execute_plan(p, plan, m, MakeParallel(pool), &records, sample);
  {
    ProfileLog& log = profile_log();
    std::lock_guard<std::mutex> lock(log.mutex);
    if (log.recording) {
      for (auto& r : records) log.dispatches.push_back({call, target, std::move(r)});
    }
  }
  return fatrain::metal_ffi::Status(kWho, err);
}

nb::dict RecordDict(const ProfiledDispatch& d) {
  const msl::emu::DispatchRecord& r = d.record;
  const msl::rt::DispatchStats& s = r.stats;
  nb::dict out;
  out["kernel"] = r.kernel;
  out["grid"] = nb::make_tuple(r.grid[0], r.grid[1], r.grid[2]);
  out["threadgroup"] = nb::make_tuple(r.threadgroup[0], r.threadgroup[1], r.threadgroup[2]);
  out["threadgroup_memory_length"] = r.threadgroup_memory_length;
#define FATRAIN_COUNTER_ITEM(name) out[#name] = s.name;
  MSL_EMU_DISPATCH_COUNTERS(FATRAIN_COUNTER_ITEM)
#undef FATRAIN_COUNTER_ITEM
  out["race_reports"] = s.race_reports;
  out["sampled_fraction"] = s.sampled_fraction;
  out["call"] = d.call;
  out["target"] = d.target;
  return out;
}

ffi::Error ForwardImpl(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                       ffi::AnyBuffer bias, ffi::AnyBuffer mask, ffi::Buffer<ffi::S32> q_lengths,
                       ffi::Buffer<ffi::S32> kv_lengths, ffi::Buffer<ffi::S32> q_segment_ids,
                       ffi::Buffer<ffi::S32> kv_segment_ids, ffi::Result<ffi::AnyBuffer> o,
                       ffi::Result<ffi::AnyBuffer> lse, Attributes attrs) {
  mp::Problem p;
  mp::Plan plan;
  mp::RoleBuffers roles;
  if (auto e = fatrain::metal_ffi::PrepareForward(kWho, attrs, q, k, v, bias, mask, q_lengths,
                                                  kv_lengths, q_segment_ids, kv_segment_ids,
                                                  *o, *lse, &p, &plan, &roles);
      e.failure()) {
    return e;
  }
  return Run("forward", p, plan, roles, pool);
}

ffi::Error BackwardImpl(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                        ffi::AnyBuffer bias, ffi::AnyBuffer mask, ffi::Buffer<ffi::S32> q_lengths,
                        ffi::Buffer<ffi::S32> kv_lengths, ffi::Buffer<ffi::S32> q_segment_ids,
                        ffi::Buffer<ffi::S32> kv_segment_ids, ffi::AnyBuffer o, ffi::AnyBuffer lse,
                        ffi::AnyBuffer d_o, ffi::Result<ffi::AnyBuffer> dq,
                        ffi::Result<ffi::AnyBuffer> dk, ffi::Result<ffi::AnyBuffer> dv,
                        Attributes attrs) {
  mp::Problem p;
  mp::Plan plan;
  mp::RoleBuffers roles;
  if (auto e = fatrain::metal_ffi::PrepareBackward(kWho, attrs, q, k, v, bias, mask, q_lengths,
                                                   kv_lengths, q_segment_ids, kv_segment_ids,
                                                   o, lse, d_o, *dq, *dk, *dv, &p,
                                                   &plan, &roles, emulated_gpu_cores().load());
      e.failure()) {
    return e;
  }
  return Run("backward", p, plan, roles, pool);
}

}  // namespace

static auto BindInputs() {
  return fatrain::metal_ffi::AddInputs(ffi::Ffi::Bind().Ctx<ffi::ThreadPool>());
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(FatrainMetalEmulatedForward, ForwardImpl,
                              BindInputs()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attrs<Attributes>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(FatrainMetalEmulatedBackward, BackwardImpl,
                              BindInputs()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attrs<Attributes>());

template <typename T>
static nb::capsule Capsule(T* fn) {
  static_assert(std::is_invocable_r_v<XLA_FFI_Error*, T, XLA_FFI_CallFrame*>);
  return nb::capsule(reinterpret_cast<void*>(fn));
}

NB_MODULE(_metal_emulated_ffi, m) {
  m.doc() = "jax_fatrain's Metal kernels run by the MSL emulator (a test tool).";
  m.def("registrations", []() {
    nb::dict t;
    t["jax_fatrain_metal_emulated_forward"] = Capsule(FatrainMetalEmulatedForward);
    t["jax_fatrain_metal_emulated_backward"] = Capsule(FatrainMetalEmulatedBackward);
    return t;
  });
  m.def("kernel_names", []() { return msl::rt::kernel_names(); },
        "Kernels compiled into the emulator.");
  m.def("selftest", []() {
    std::string log;
    const int failures = msl_emulator_selftest(&log);
    return nb::make_tuple(failures, log);
  }, "Runs the emulator's self-test (layouts, planted bugs): (failures, log).");
  m.def("planned_kernel_names", []() { return mp::all_kernel_names(); },
        "Every kernel name the dispatch plan can ask for.");
  m.def("profile_start", [](double fraction, uint64_t max_threadgroups) {
    if (!(fraction > 0.0 && fraction <= 1.0)) {
      throw nb::value_error("the sampled fraction must be in (0, 1]");
    }
    ProfileLog& log = profile_log();
    std::lock_guard<std::mutex> lock(log.mutex);
    if (log.recording) throw std::runtime_error("metal_emulated profiling is already recording");
    log.recording = true;
    log.sample.fraction = fraction;
    log.sample.max_threadgroups = max_threadgroups;
    log.calls = 0;
    log.dispatches.clear();
  }, nb::arg("fraction") = 1.0, nb::arg("max_threadgroups") = 0,
        "Starts recording the cost counters of every metal_emulated dispatch.");
  m.def("profile_stop", []() {
    std::vector<ProfiledDispatch> dispatches;
    {
      ProfileLog& log = profile_log();
      std::lock_guard<std::mutex> lock(log.mutex);
      log.recording = false;
      dispatches.swap(log.dispatches);
    }
    nb::list out;
    for (const auto& d : dispatches) out.append(RecordDict(d));
    return out;
  }, "Stops recording; returns one dict per dispatch recorded.");
  m.def("profile_recording", []() {
    ProfileLog& log = profile_log();
    std::lock_guard<std::mutex> lock(log.mutex);
    return log.recording;
  }, "Whether metal_emulated dispatches are being recorded.");
  m.def("set_gpu_cores", [](int cores) {
    if (cores < 0) throw nb::value_error("the GPU core count must be >= 0 (0: not known)");
    emulated_gpu_cores().store(cores);
  }, nb::arg("cores"),
        "Sets the core count of the GPU the emulator stands for (0: not known), which the "
        "backward plan fills with two threadgroups per core.");
  m.def("gpu_cores", []() { return emulated_gpu_cores().load(); },
        "The core count set_gpu_cores set (0: not known).");
  m.def("counter_names", []() {
    std::vector<std::string> names;
#define FATRAIN_COUNTER_NAME(name) names.push_back(#name);
    MSL_EMU_DISPATCH_COUNTERS(FATRAIN_COUNTER_NAME)
#undef FATRAIN_COUNTER_NAME
    return names;
  }, "The names of the per-dispatch cost counters.");
}
