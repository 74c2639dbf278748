// XLA FFI handlers of the `metal_emulated` implementation (cpu platform): the
// Metal backend's dispatch plan (cpp/metal/plan) executed by the MSL emulator
// (cpp/metal/emulator), which runs the unmodified jax_fatrain/metal/*.metal
// kernels on the CPU. A test tool: it checks the Metal kernels off-Mac, slowly.
//
// Operand conventions are those of the cpu target (jax_fatrain/_backends/_ffi.py); the
// mapping of XLA buffers onto the plan is shared with the macOS host
// (cpp/ffi/metal_ffi_common.h).

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <type_traits>

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

ffi::Error Run(const mp::Problem& p, const mp::Plan& plan, const mp::RoleBuffers& roles,
               ffi::ThreadPool& pool) {
  fatrain::metal_ffi::PoisonHostOutputs(roles);
  msl::emu::RoleMemory m;
  for (int r = 0; r < mp::RoleBuffers::kRoles; ++r) {
    m.data[r] = roles.data[r];
    m.size[r] = roles.size[r];
  }
  return fatrain::metal_ffi::Status(kWho, msl::emu::execute_plan(p, plan, m, MakeParallel(pool)));
}

ffi::Error ForwardImpl(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                       ffi::AnyBuffer bias, ffi::AnyBuffer mask, ffi::Buffer<ffi::S32> q_lengths,
                       ffi::Buffer<ffi::S32> kv_lengths, ffi::Result<ffi::AnyBuffer> o,
                       ffi::Result<ffi::AnyBuffer> lse, Attributes attrs) {
  mp::Problem p;
  mp::Plan plan;
  mp::RoleBuffers roles;
  if (auto e = fatrain::metal_ffi::PrepareForward(kWho, attrs, q, k, v, bias, mask, q_lengths,
                                                  kv_lengths, *o, *lse, &p, &plan, &roles);
      e.failure()) {
    return e;
  }
  return Run(p, plan, roles, pool);
}

ffi::Error BackwardImpl(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                        ffi::AnyBuffer bias, ffi::AnyBuffer mask, ffi::Buffer<ffi::S32> q_lengths,
                        ffi::Buffer<ffi::S32> kv_lengths, ffi::AnyBuffer o, ffi::AnyBuffer lse,
                        ffi::AnyBuffer d_o, ffi::Result<ffi::AnyBuffer> dq,
                        ffi::Result<ffi::AnyBuffer> dk, ffi::Result<ffi::AnyBuffer> dv,
                        Attributes attrs) {
  mp::Problem p;
  mp::Plan plan;
  mp::RoleBuffers roles;
  if (auto e = fatrain::metal_ffi::PrepareBackward(kWho, attrs, q, k, v, bias, mask, q_lengths,
                                                   kv_lengths, o, lse, d_o, *dq, *dk, *dv, &p,
                                                   &plan, &roles);
      e.failure()) {
    return e;
  }
  return Run(p, plan, roles, pool);
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
}
