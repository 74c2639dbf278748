// XLA FFI handlers for the CPU backend: they translate XLA buffers and
// attributes into the framework-free structs of cpu/attention_cpu.h (through
// attention_ffi.h, shared with the CUDA handlers), run the kernels on XLA's
// own intra-op thread pool, and turn every problem into an ffi::Error (never
// a crash). The Python layer checks the same rules first and gives friendlier
// messages; these checks are the last line of defence.

#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>

#include "cpu/attention_cpu.h"
#include "ffi/attention_ffi.h"
#include "ffi/pool_parallel_for.h"
#include "nanobind/nanobind.h"
#include "nanobind/stl/string.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
namespace nb = nanobind;
using fatrain::ffi_glue::Attributes;
using fatrain::ffi_glue::EncapsulateFfiHandler;

namespace {

ffi::Error Status(const std::string& message,
                  ffi::ErrorCode code = ffi::ErrorCode::kInvalidArgument) {
  return fatrain::ffi_glue::Status("jax_fatrain cpu", message, code);
}

ffi::Error KernelStatus(const char* error) {
  return Status(error == nullptr ? "" : error, ffi::ErrorCode::kInternal);
}

#define FATRAIN_RETURN_IF_ERROR(expr) \
  if (auto _error = Status(expr); _error.failure()) return _error

void Poison(ffi::AnyBuffer& buffer) {
  if (fatrain::ffi_glue::PoisonOutputsRequested()) {
    std::memset(buffer.untyped_data(), 0xFF, buffer.size_bytes());
  }
}

fatrain::cpu::ParallelFor MakeParallelFor(ffi::ThreadPool& pool) {
  const int64_t threads = pool.num_threads();
  if (threads <= 1) return fatrain::cpu::serial_parallel_for();
  fatrain::cpu::ParallelFor parallel;
  parallel.run = fatrain::ffi_glue::RunOnPool;
  parallel.self = &pool;
  parallel.num_threads = threads;
  return parallel;
}

ffi::Error ForwardImpl(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k,
                       ffi::AnyBuffer v, ffi::AnyBuffer bias, ffi::AnyBuffer mask,
                       ffi::Buffer<ffi::S32> q_lengths,
                       ffi::Buffer<ffi::S32> kv_lengths,
                       ffi::Buffer<ffi::S32> q_segment_ids,
                       ffi::Buffer<ffi::S32> kv_segment_ids,
                       ffi::Result<ffi::AnyBuffer> o,
                       ffi::Result<ffi::AnyBuffer> lse, Attributes attrs) {
  namespace glue = fatrain::ffi_glue;
  fatrain::AttentionProblem problem;
  fatrain::ForwardOperands ops;
  FATRAIN_RETURN_IF_ERROR(glue::BuildProblem(attrs, q, k, v, bias, mask, q_lengths,
                                             kv_lengths, q_segment_ids, kv_segment_ids,
                                             fatrain::cpu::validate_problem,
                                             &problem, &ops.q, &ops.k, &ops.v));
  FATRAIN_RETURN_IF_ERROR(glue::ExpectSameAs("output", *o, "query", q));
  FATRAIN_RETURN_IF_ERROR(glue::ExpectLse(*lse, problem));
  int64_t unused[4];
  FATRAIN_RETURN_IF_ERROR(glue::ReadSeqTensor("output", *o, attrs.layout, unused, &ops.o));
  ops.lse = static_cast<float*>(lse->untyped_data());
  Poison(*o);
  Poison(*lse);
  return KernelStatus(
      fatrain::cpu::attention_forward(problem, ops, MakeParallelFor(pool)));
}

ffi::Error BackwardImpl(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k,
                        ffi::AnyBuffer v, ffi::AnyBuffer bias, ffi::AnyBuffer mask,
                        ffi::Buffer<ffi::S32> q_lengths,
                        ffi::Buffer<ffi::S32> kv_lengths,
                        ffi::Buffer<ffi::S32> q_segment_ids,
                        ffi::Buffer<ffi::S32> kv_segment_ids, ffi::AnyBuffer o,
                        ffi::AnyBuffer lse, ffi::AnyBuffer d_o,
                        ffi::Result<ffi::AnyBuffer> dq,
                        ffi::Result<ffi::AnyBuffer> dk,
                        ffi::Result<ffi::AnyBuffer> dv, Attributes attrs) {
  namespace glue = fatrain::ffi_glue;
  glue::BackwardInputs in;
  FATRAIN_RETURN_IF_ERROR(glue::ReadBackwardInputs(
      attrs, q, k, v, bias, mask, q_lengths, kv_lengths, q_segment_ids, kv_segment_ids,
      o, lse, d_o,
      fatrain::cpu::validate_problem, &in));
  fatrain::BackwardOperands ops;
  ops.q = in.q; ops.k = in.k; ops.v = in.v; ops.o = in.o; ops.d_o = in.d_o;
  ops.lse = in.lse;
  FATRAIN_RETURN_IF_ERROR(glue::ReadGradients(attrs.layout, q, k, v, *dq, *dk, *dv, &ops));
  Poison(*dq);
  Poison(*dk);
  Poison(*dv);
  return KernelStatus(
      fatrain::cpu::attention_backward(in.problem, ops, MakeParallelFor(pool)));
}

ffi::Error BiasGradImpl(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k,
                        ffi::AnyBuffer v, ffi::AnyBuffer bias, ffi::AnyBuffer mask,
                        ffi::Buffer<ffi::S32> q_lengths,
                        ffi::Buffer<ffi::S32> kv_lengths,
                        ffi::Buffer<ffi::S32> q_segment_ids,
                        ffi::Buffer<ffi::S32> kv_segment_ids, ffi::AnyBuffer o,
                        ffi::AnyBuffer lse, ffi::AnyBuffer d_o,
                        ffi::Result<ffi::AnyBuffer> dbias, Attributes attrs) {
  namespace glue = fatrain::ffi_glue;
  if (!attrs.has_bias) return Status("the bias gradient needs a bias");
  glue::BackwardInputs in;
  FATRAIN_RETURN_IF_ERROR(glue::ReadBackwardInputs(
      attrs, q, k, v, bias, mask, q_lengths, kv_lengths, q_segment_ids, kv_segment_ids,
      o, lse, d_o,
      fatrain::cpu::validate_problem, &in));
  FATRAIN_RETURN_IF_ERROR(glue::ExpectBiasGradient(*dbias, bias));
  fatrain::BiasGradOperands ops;
  ops.q = in.q; ops.k = in.k; ops.v = in.v; ops.o = in.o; ops.d_o = in.d_o;
  ops.lse = in.lse;
  ops.dbias = static_cast<float*>(dbias->untyped_data());
  Poison(*dbias);
  return KernelStatus(
      fatrain::cpu::attention_bias_grad(in.problem, ops, MakeParallelFor(pool)));
}

// A peak-rate loop of the CPU kernels as a Python function
// f(threads=0, seconds=0.2), the GIL released while it runs.
template <double (*Peak)(int, double)>
void def_peak(nb::module_& m, const char* name, const char* doc) {
  m.def(name,
        [](int threads, double seconds) {
          nb::gil_scoped_release release;
          return Peak(threads, seconds);
        },
        nb::arg("threads") = 0, nb::arg("seconds") = 0.2, doc);
}

}  // namespace

XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(Attributes, FATRAIN_ATTRIBUTE_MEMBERS);

#define FATRAIN_CPU_INPUTS \
  FATRAIN_BIND_ATTENTION_INPUTS(ffi::Ffi::Bind().Ctx<ffi::ThreadPool>())

XLA_FFI_DEFINE_HANDLER_SYMBOL(FatrainCpuForward, ForwardImpl,
                              FATRAIN_CPU_INPUTS
                                  .Ret<ffi::AnyBuffer>()  // out
                                  .Ret<ffi::AnyBuffer>()  // lse
                                  .Attrs<Attributes>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(FatrainCpuBackward, BackwardImpl,
                              FATRAIN_CPU_INPUTS
                                  .Arg<ffi::AnyBuffer>()  // out
                                  .Arg<ffi::AnyBuffer>()  // lse
                                  .Arg<ffi::AnyBuffer>()  // d_out
                                  .Ret<ffi::AnyBuffer>()  // dq
                                  .Ret<ffi::AnyBuffer>()  // dk
                                  .Ret<ffi::AnyBuffer>()  // dv
                                  .Attrs<Attributes>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(FatrainCpuBiasGrad, BiasGradImpl,
                              FATRAIN_CPU_INPUTS
                                  .Arg<ffi::AnyBuffer>()  // out
                                  .Arg<ffi::AnyBuffer>()  // lse
                                  .Arg<ffi::AnyBuffer>()  // d_out
                                  .Ret<ffi::AnyBuffer>()  // dbias
                                  .Attrs<Attributes>());

NB_MODULE(_cpu_ffi, m) {
  m.doc() = "XLA FFI handlers of jax_fatrain's CPU backend.";
  m.def("registrations", []() {
    nb::dict targets;
    targets["jax_fatrain_cpu_forward"] = EncapsulateFfiHandler(FatrainCpuForward);
    targets["jax_fatrain_cpu_backward"] = EncapsulateFfiHandler(FatrainCpuBackward);
    targets["jax_fatrain_cpu_bias_grad"] = EncapsulateFfiHandler(FatrainCpuBiasGrad);
    return targets;
  });
  m.def("selected_isa", []() { return std::string(fatrain::cpu::selected_isa()); },
        "The instruction set the CPU kernels dispatch to on this machine.");
  def_peak<fatrain::cpu::fma_peak_gflops>(
      m, "fma_peak_gflops",
      "This machine's float32 FMA rate in GFLOP/s with the selected ISA (threads=0: one per "
      "CPU this process may run on).");
  def_peak<fatrain::cpu::bf16_dot_peak_gflops>(
      m, "bf16_dot_peak_gflops",
      "This machine's bf16 pair dot-product (vdpbf16ps) rate in GFLOP/s, 4 FLOPs a lane; "
      "0 where the selected kernels do not run it.");
  def_peak<fatrain::cpu::amx_bf16_peak_gflops>(
      m, "amx_bf16_peak_gflops",
      "This machine's AMX bf16 tile product (TDPBF16PS) rate in GFLOP/s; 0 where the "
      "selected kernels do not run it.");

  m.def("tile_visits", [](bool reset) {
    int64_t counts[fatrain::cpu::kTileVisitCounters];
    fatrain::cpu::tile_visits(counts, reset);
    nb::dict out;
    out["forward"] = counts[fatrain::cpu::kTileVisitsForward];
    out["backward_dq"] = counts[fatrain::cpu::kTileVisitsBackwardDq];
    out["backward_dkdv"] = counts[fatrain::cpu::kTileVisitsBackwardDkDv];
    out["bias_grad"] = counts[fatrain::cpu::kTileVisitsBiasGrad];
    return out;
  }, nb::arg("reset") = false,
        "Tiles (query tile x key tile pairs) each pass has computed so far (a test tool).");
  m.def("tile_sizes", []() {
    return nb::make_tuple(fatrain::cpu::kTileQ, fatrain::cpu::kTileK);
  }, "(query rows, keys) per tile of the CPU kernels.");
}
