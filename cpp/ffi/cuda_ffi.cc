// XLA FFI handlers for the CUDA backend: they translate XLA buffers and
// attributes into the framework-free structs of cuda/attention_cuda.h (through
// attention_ffi.h, shared with the CPU handlers) and enqueue the kernels on
// the stream XLA gives us. Every problem (bad operands, CUDA launch errors)
// becomes an ffi::Error. Attributes: the shared dictionary plus
// `deterministic`.

#include <cstdint>
#include <stdexcept>
#include <string>
#include <type_traits>

#include <cuda_runtime_api.h>

#include "cuda/attention_cuda.h"
#include "ffi/attention_ffi.h"
#include "nanobind/nanobind.h"
#include "nanobind/stl/string.h"
#include "nanobind/stl/vector.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
namespace nb = nanobind;
namespace glue = fatrain::ffi_glue;

namespace {

// The shared attributes followed by the dQ mode of the backward.
struct CudaAttributes {
  glue::Attributes common;
  bool deterministic;
};

ffi::Error Status(const std::string& message,
                  ffi::ErrorCode code = ffi::ErrorCode::kInvalidArgument) {
  return glue::Status("jax_fatrain cuda", message, code);
}

ffi::Error KernelStatus(const char* error) {
  return Status(error == nullptr ? "" : error, ffi::ErrorCode::kInternal);
}

#define FATRAIN_RETURN_IF_ERROR(expr) \
  if (auto _error = Status(expr); _error.failure()) return _error

// With JAX_FATRAIN_POISON_OUTPUTS=1 outputs are filled with NaN first.
std::string Poison(ffi::AnyBuffer& buffer, cudaStream_t stream) {
  if (!glue::PoisonOutputsRequested() || buffer.size_bytes() == 0) return "";
  cudaError_t e = cudaMemsetAsync(buffer.untyped_data(), 0xFF, buffer.size_bytes(), stream);
  if (e != cudaSuccess) return std::string("poison memset failed: ") + cudaGetErrorString(e);
  return "";
}

std::string GetScratch(ffi::AnyBuffer& workspace, size_t bytes, void** out) {
  *out = nullptr;
  if (bytes == 0) return "";
  if (workspace.size_bytes() < bytes) {
    return "workspace must hold " + std::to_string(bytes) + " bytes, got " +
           std::to_string(workspace.size_bytes());
  }
  *out = workspace.untyped_data();
  return "";
}

ffi::Error ForwardImpl(cudaStream_t stream, ffi::AnyBuffer q,
                       ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer bias,
                       ffi::AnyBuffer mask, ffi::Buffer<ffi::S32> q_lengths,
                       ffi::Buffer<ffi::S32> kv_lengths,
                       ffi::Buffer<ffi::S32> q_segment_ids,
                       ffi::Buffer<ffi::S32> kv_segment_ids, ffi::Result<ffi::AnyBuffer> o,
                       ffi::Result<ffi::AnyBuffer> lse,
                       ffi::Result<ffi::AnyBuffer> workspace, CudaAttributes attrs) {
  fatrain::AttentionProblem problem;
  fatrain::ForwardOperands ops;
  FATRAIN_RETURN_IF_ERROR(glue::BuildProblem(attrs.common, q, k, v, bias, mask, q_lengths,
                                             kv_lengths, q_segment_ids, kv_segment_ids,
                                             fatrain::cuda::validate_problem,
                                             &problem, &ops.q, &ops.k, &ops.v));
  FATRAIN_RETURN_IF_ERROR(glue::ExpectSameAs("output", *o, "query", q));
  FATRAIN_RETURN_IF_ERROR(glue::ExpectLse(*lse, problem));
  int64_t unused[4];
  FATRAIN_RETURN_IF_ERROR(
      glue::ReadSeqTensor("output", *o, attrs.common.layout, unused, &ops.o));
  ops.lse = static_cast<float*>(lse->untyped_data());
  FATRAIN_RETURN_IF_ERROR(Poison(*o, stream));
  FATRAIN_RETURN_IF_ERROR(Poison(*lse, stream));
  void* memory = nullptr;
  FATRAIN_RETURN_IF_ERROR(
      GetScratch(*workspace, fatrain::cuda::forward_scratch_bytes(problem), &memory));
  return KernelStatus(fatrain::cuda::attention_forward(problem, ops, memory, stream));
}

ffi::Error BackwardImpl(cudaStream_t stream, ffi::AnyBuffer q,
                        ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer bias,
                        ffi::AnyBuffer mask, ffi::Buffer<ffi::S32> q_lengths,
                        ffi::Buffer<ffi::S32> kv_lengths,
                        ffi::Buffer<ffi::S32> q_segment_ids,
                        ffi::Buffer<ffi::S32> kv_segment_ids, ffi::AnyBuffer o,
                        ffi::AnyBuffer lse, ffi::AnyBuffer d_o,
                        ffi::Result<ffi::AnyBuffer> dq, ffi::Result<ffi::AnyBuffer> dk,
                        ffi::Result<ffi::AnyBuffer> dv,
                        ffi::Result<ffi::AnyBuffer> workspace, CudaAttributes attrs) {
  glue::BackwardInputs in;
  FATRAIN_RETURN_IF_ERROR(glue::ReadBackwardInputs(
      attrs.common, q, k, v, bias, mask, q_lengths, kv_lengths, q_segment_ids, kv_segment_ids,
      o, lse, d_o,
      fatrain::cuda::validate_problem, &in));
  fatrain::BackwardOperands ops;
  ops.q = in.q; ops.k = in.k; ops.v = in.v; ops.o = in.o; ops.d_o = in.d_o;
  ops.lse = in.lse;
  FATRAIN_RETURN_IF_ERROR(
      glue::ReadGradients(attrs.common.layout, q, k, v, *dq, *dk, *dv, &ops));
  FATRAIN_RETURN_IF_ERROR(Poison(*dq, stream));
  FATRAIN_RETURN_IF_ERROR(Poison(*dk, stream));
  FATRAIN_RETURN_IF_ERROR(Poison(*dv, stream));
  void* memory = nullptr;
  FATRAIN_RETURN_IF_ERROR(GetScratch(
      *workspace, fatrain::cuda::backward_scratch_bytes(in.problem, attrs.deterministic),
      &memory));
  return KernelStatus(fatrain::cuda::attention_backward(in.problem, ops, attrs.deterministic,
                                                        memory, stream));
}

ffi::Error BiasGradImpl(cudaStream_t stream, ffi::AnyBuffer q,
                        ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer bias,
                        ffi::AnyBuffer mask, ffi::Buffer<ffi::S32> q_lengths,
                        ffi::Buffer<ffi::S32> kv_lengths,
                        ffi::Buffer<ffi::S32> q_segment_ids,
                        ffi::Buffer<ffi::S32> kv_segment_ids, ffi::AnyBuffer o,
                        ffi::AnyBuffer lse, ffi::AnyBuffer d_o,
                        ffi::Result<ffi::AnyBuffer> dbias,
                        ffi::Result<ffi::AnyBuffer> workspace, CudaAttributes attrs) {
  if (!attrs.common.has_bias) return Status("the bias gradient needs a bias");
  glue::BackwardInputs in;
  FATRAIN_RETURN_IF_ERROR(glue::ReadBackwardInputs(
      attrs.common, q, k, v, bias, mask, q_lengths, kv_lengths, q_segment_ids, kv_segment_ids,
      o, lse, d_o,
      fatrain::cuda::validate_problem, &in));
  FATRAIN_RETURN_IF_ERROR(glue::ExpectBiasGradient(*dbias, bias));
  fatrain::BiasGradOperands ops;
  ops.q = in.q; ops.k = in.k; ops.v = in.v; ops.o = in.o; ops.d_o = in.d_o;
  ops.lse = in.lse;
  ops.dbias = static_cast<float*>(dbias->untyped_data());
  FATRAIN_RETURN_IF_ERROR(Poison(*dbias, stream));
  void* memory = nullptr;
  FATRAIN_RETURN_IF_ERROR(
      GetScratch(*workspace, fatrain::cuda::bias_grad_scratch_bytes(in.problem), &memory));
  return KernelStatus(fatrain::cuda::attention_bias_grad(in.problem, ops, memory, stream));
}

}  // namespace

// Brace elision fills `common` from the first members, in order.
XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(CudaAttributes, FATRAIN_ATTRIBUTE_MEMBERS,
                                      ffi::StructMember<bool>("deterministic"));

#define FATRAIN_CUDA_INPUTS \
  FATRAIN_BIND_ATTENTION_INPUTS(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>())

XLA_FFI_DEFINE_HANDLER_SYMBOL(FatrainCudaForward, ForwardImpl,
                              FATRAIN_CUDA_INPUTS
                                  .Ret<ffi::AnyBuffer>()  // out
                                  .Ret<ffi::AnyBuffer>()  // lse
                                  .Ret<ffi::AnyBuffer>()  // workspace (uint8)
                                  .Attrs<CudaAttributes>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(FatrainCudaBackward, BackwardImpl,
                              FATRAIN_CUDA_INPUTS
                                  .Arg<ffi::AnyBuffer>()  // out
                                  .Arg<ffi::AnyBuffer>()  // lse
                                  .Arg<ffi::AnyBuffer>()  // d_out
                                  .Ret<ffi::AnyBuffer>()  // dq
                                  .Ret<ffi::AnyBuffer>()  // dk
                                  .Ret<ffi::AnyBuffer>()  // dv
                                  .Ret<ffi::AnyBuffer>()  // workspace (uint8)
                                  .Attrs<CudaAttributes>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(FatrainCudaBiasGrad, BiasGradImpl,
                              FATRAIN_CUDA_INPUTS
                                  .Arg<ffi::AnyBuffer>()  // out
                                  .Arg<ffi::AnyBuffer>()  // lse
                                  .Arg<ffi::AnyBuffer>()  // d_out
                                  .Ret<ffi::AnyBuffer>()  // dbias
                                  .Ret<ffi::AnyBuffer>()  // workspace (uint8)
                                  .Attrs<CudaAttributes>());

NB_MODULE(_cuda_ffi, m) {
  m.doc() = "XLA FFI handlers of jax_fatrain's CUDA backend.";
  m.def("registrations", []() {
    nb::dict targets;
    targets["jax_fatrain_cuda_forward"] = glue::EncapsulateFfiHandler(FatrainCudaForward);
    targets["jax_fatrain_cuda_backward"] = glue::EncapsulateFfiHandler(FatrainCudaBackward);
    targets["jax_fatrain_cuda_bias_grad"] = glue::EncapsulateFfiHandler(FatrainCudaBiasGrad);
    return targets;
  });
  m.def("device_count", []() {
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess) return 0;
    return count;
  }, "Number of CUDA devices the runtime sees (0 when none or no driver).");
  m.def("selected_path", [](const std::string& dtype, int64_t head_dim) {
    fatrain::AttentionProblem problem;
    problem.head_dim = head_dim;
    const fatrain::DType code = dtype == "bfloat16" ? fatrain::DType::kBF16
                                : dtype == "float16" ? fatrain::DType::kF16
                                                     : fatrain::DType::kF32;
    return std::string(fatrain::cuda::selected_path(problem, code));
  }, nb::arg("dtype"), nb::arg("head_dim"),
        "The path (\"tensor_core\" or \"simt\") of problems with this dtype name and "
        "head dim.");
  m.def("scratch_bytes", [](const std::string& stage, int64_t batch, int64_t q_heads,
                            int64_t q_len, int64_t head_dim, bool deterministic,
                            int64_t kv_len, bool segment_ids) -> size_t {
    fatrain::AttentionProblem problem;
    problem.batch = batch;
    problem.q_heads = q_heads;
    problem.q_len = q_len;
    problem.kv_len = kv_len;
    problem.head_dim = head_dim;
    // Only the presence of segment ids matters for the sizes.
    static const int32_t kPresent = 0;
    if (segment_ids) problem.q_segment_ids = problem.kv_segment_ids = &kPresent;
    if (stage == "forward") return fatrain::cuda::forward_scratch_bytes(problem);
    if (stage == "backward") return fatrain::cuda::backward_scratch_bytes(problem, deterministic);
    if (stage == "bias_grad") return fatrain::cuda::bias_grad_scratch_bytes(problem);
    throw std::invalid_argument("stage must be forward, backward or bias_grad, got " + stage);
  }, nb::arg("stage"), nb::arg("batch"), nb::arg("q_heads"), nb::arg("q_len"),
        nb::arg("head_dim"), nb::arg("deterministic"), nb::arg("kv_len") = 0,
        nb::arg("segment_ids") = false,
        "Device scratch bytes a stage's handler needs (its workspace result).");
  m.def("set_launch_recording", &fatrain::cuda::set_launch_recording, nb::arg("on"),
        "Starts or stops recording the kernels the handlers launch (a test tool).");
  m.def("take_launch_record", &fatrain::cuda::take_launch_record,
        "The recorded kernels' symbol names since the last call, oldest first.");
  m.def(
      "set_tile_visit_counting",
      [](bool on) {
        if (const char* e = fatrain::cuda::set_tile_visit_counting(on))
          throw std::runtime_error(e);
      },
      nb::arg("on"), "Starts or stops counting the tiles the kernels visit (a test tool).");
  m.def(
      "take_tile_visits",
      []() {
        const std::vector<unsigned long long> c = fatrain::cuda::take_tile_visits();
        nb::dict counts;
        counts["forward"] = c[0];
        counts["backward"] = c[1];
        return counts;
      },
      "The tile visits {forward, backward} counted since the last call, which zeroes them.");
  m.def(
      "set_fastest_kernel_family",
      [](const std::string& name) {
        if (!fatrain::cuda::set_fastest_kernel_family(name))
          throw nb::value_error(("kernel family must be \"hopper\", \"mma_sync\" or \"simt\", "
                                 "got \"" + name + "\"").c_str());
      },
      nb::arg("name"),
      "Caps the kernel families later launches may use: \"hopper\" (no cap), \"mma_sync\" "
      "or \"simt\" (a test tool; process-wide).");
}
