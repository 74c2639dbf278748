// XLA FFI handlers of the `metal` implementation (macOS, Apple GPU).
//
// jax-metal has no FFI (docs/metal.md), so these handlers are
// registered on the `cpu` platform: XLA:CPU hands them host pointers, and the
// executor (cpp/metal/host/executor.h) runs the Metal kernels on those through
// unified memory. The mapping of XLA buffers and attributes onto the dispatch
// plan is shared with `metal_emulated` (metal_ffi_common.h), so the emulator
// tests that logic off-Mac. The bias gradient is not a Metal kernel: the
// Python side uses the CPU backend's (jax_fatrain/_backends/metal.py).

#include <string>
#include <type_traits>

#include "metal/host/executor.h"
#include "metal_ffi_common.h"
#include "metal/plan/plan.h"
#include "nanobind/nanobind.h"
#include "nanobind/stl/string.h"
#include "nanobind/stl/vector.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
namespace nb = nanobind;
namespace mp = fatrain::metal_plan;
using fatrain::ffi_glue::EncapsulateFfiHandler;

namespace {

using fatrain::metal_ffi::Attributes;
constexpr const char* kWho = "jax_fatrain metal";

ffi::Error Run(const mp::Problem& p, const mp::Plan& plan, const mp::RoleBuffers& roles) {
  return fatrain::metal_ffi::Status(
      kWho, fatrain::metal::execute(p, plan, roles, fatrain::metal_ffi::PoisonOutputs()));
}

ffi::Error ForwardImpl(ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer bias,
                       ffi::AnyBuffer mask, ffi::Buffer<ffi::S32> q_lengths,
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
  return Run(p, plan, roles);
}

ffi::Error BackwardImpl(ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer bias,
                        ffi::AnyBuffer mask, ffi::Buffer<ffi::S32> q_lengths,
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
                                                   &plan, &roles,
                                                   fatrain::metal::gpu_core_count());
      e.failure()) {
    return e;
  }
  return Run(p, plan, roles);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(FatrainMetalForward, ForwardImpl,
                              fatrain::metal_ffi::AddInputs(ffi::Ffi::Bind())
                                  .Ret<ffi::AnyBuffer>()   // o
                                  .Ret<ffi::AnyBuffer>()   // lse
                                  .Attrs<Attributes>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(FatrainMetalBackward, BackwardImpl,
                              fatrain::metal_ffi::AddInputs(ffi::Ffi::Bind())
                                  .Arg<ffi::AnyBuffer>()   // o
                                  .Arg<ffi::AnyBuffer>()   // lse
                                  .Arg<ffi::AnyBuffer>()   // d_o
                                  .Ret<ffi::AnyBuffer>()   // dq
                                  .Ret<ffi::AnyBuffer>()   // dk
                                  .Ret<ffi::AnyBuffer>()   // dv
                                  .Attrs<Attributes>());

NB_MODULE(_metal_ffi, m) {
  m.doc() = "jax_fatrain's Metal kernels on the Apple GPU (FFI handlers on the cpu platform).";
  m.def("registrations", []() {
    nb::dict t;
    t["jax_fatrain_metal_forward"] = EncapsulateFfiHandler(FatrainMetalForward);
    t["jax_fatrain_metal_backward"] = EncapsulateFfiHandler(FatrainMetalBackward);
    return t;
  });
  m.def("device_name", []() { return fatrain::metal::device_name(); },
        "The default Metal device's name, or '' when there is none.");
  m.def("gpu_core_count", []() { return fatrain::metal::gpu_core_count(); },
        "The default Metal device's GPU core count (IORegistry), 0 when not known.");
  m.def("unsupported_reason", []() { return fatrain::metal::unsupported_reason(); },
        "'' when the default Metal device can run the kernels, else why not.");
  m.def("initialize",
        [](const std::string& source, const std::string& metallib_path) {
          nb::gil_scoped_release release;
          return fatrain::metal::initialize(source, metallib_path);
        },
        nb::arg("source"), nb::arg("metallib_path") = "",
        "Creates device, queue and kernel library once; returns '' or the error.");
  m.def("planned_kernel_names", []() { return mp::all_kernel_names(); },
        "Every kernel name the dispatch plan can ask for.");
}
