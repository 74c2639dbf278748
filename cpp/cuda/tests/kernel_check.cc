// A standalone check of the CUDA kernels, with no JAX, XLA or Python in the
// process, so that compute-sanitizer sees nothing but these kernels and the
// copies around them (tools/cuda_gpu_tests.sh runs it under memcheck and
// racecheck):
//
//   fatrain_cuda_kernel_check [--family hopper|mma_sync|simt] [--deterministic]
//                             [NAME_FILTER]
//
// Runs the forward, backward and bias gradient of every case of
// cpp/testing/attention_check.h (those whose name contains NAME_FILTER)
// and compares each with the double-precision reference there, to the
// bounds the Python suite holds the kernels to. --family caps the kernel
// families (kernel_choice.h; default: every one, the fastest first);
// --deterministic takes the deterministic backward, whose reruns must agree
// bit for bit. Prints the distinct kernels that ran; exits 1 on a failed
// check, 2 without a GPU.
#include <cstdio>
#include <cstring>
#include <set>
#include <string>
#include <vector>

#include <cuda_runtime_api.h>

#include "cuda/attention_cuda.h"
#include "testing/attention_check.h"

using namespace fatrain::testing;
using fatrain::AttentionProblem;
using fatrain::BackwardOperands;
using fatrain::BiasGradOperands;
using fatrain::DType;
using fatrain::ForwardOperands;
namespace cuda = fatrain::cuda;

namespace {

// Device buffers of one entry point's call, freed together.
class DeviceBuffers {
 public:
  ~DeviceBuffers() {
    for (void* p : owned_) cudaFree(p);
  }
  // `bytes` of device memory, every byte set to `fill` (0xFF: NaN in every
  // float type, so an output element the kernels leave unwritten shows).
  void* alloc(size_t bytes, int fill) {
    void* p = nullptr;
    if (cudaMalloc(&p, bytes > 0 ? bytes : 1) != cudaSuccess) return nullptr;
    owned_.push_back(p);
    cudaMemset(p, fill, bytes);
    return p;
  }
  // A device copy of `bytes` of host memory (nullptr stays nullptr).
  template <class T>
  T* upload(T* host, size_t bytes) {
    if (host == nullptr) return nullptr;
    void* p = alloc(bytes, 0);
    if (p != nullptr) cudaMemcpy(p, host, bytes, cudaMemcpyHostToDevice);
    return static_cast<T*>(p);
  }

 private:
  std::vector<void*> owned_;
};

int64_t product(const int64_t dims[4]) { return dims[0] * dims[1] * dims[2] * dims[3]; }

// The kernels on the current GPU, operands copied in and results copied out.
class CudaBackend : public Backend {
 public:
  explicit CudaBackend(bool deterministic) : deterministic_(deterministic) {}

  // tests/attention_cases.py's TOLERANCE (out, grad) for every kernel against
  // jax.nn; L and the bias gradient as in the CPU check.
  Tolerance tolerance(DType d) const override {
    if (d == DType::kF32) return {1e-4, 1e-4, 2e-4, 4e-4};
    if (d == DType::kBF16) return {1.5e-2, 2e-2, 3e-2, 6e-2};
    return {5e-3, 2e-2, 1e-2, 2e-2};
  }
  int backward_reruns() const override { return deterministic_ ? 1 : 0; }

  const char* forward(const AttentionProblem& p, const ForwardOperands& ops) override {
    DeviceBuffers mem;
    const AttentionProblem dp = stage(p, mem);
    ForwardOperands d = ops;
    d.q.data = mem.upload(ops.q.data, q_bytes(p, ops.q.dtype));
    d.k.data = mem.upload(ops.k.data, kv_bytes(p, ops.k.dtype));
    d.v.data = mem.upload(ops.v.data, kv_bytes(p, ops.v.dtype));
    d.o.data = mem.alloc(q_bytes(p, ops.o.dtype), 0xFF);
    d.lse = static_cast<float*>(mem.alloc(lse_bytes(p), 0xFF));
    void* scratch = mem.alloc(cuda::forward_scratch_bytes(dp), 0);
    if (const char* e = cuda::attention_forward(dp, d, scratch, nullptr)) return keep(e);
    if (const char* e = finish()) return e;
    cudaMemcpy(ops.o.data, d.o.data, q_bytes(p, ops.o.dtype), cudaMemcpyDeviceToHost);
    cudaMemcpy(ops.lse, d.lse, lse_bytes(p), cudaMemcpyDeviceToHost);
    return finish();
  }

  const char* backward(const AttentionProblem& p, const BackwardOperands& ops, int) override {
    DeviceBuffers mem;
    const AttentionProblem dp = stage(p, mem);
    BackwardOperands d = upload_backward_inputs(p, ops, mem);
    d.dq.data = mem.alloc(q_bytes(p, ops.dq.dtype), 0xFF);
    d.dk.data = mem.alloc(kv_bytes(p, ops.dk.dtype), 0xFF);
    d.dv.data = mem.alloc(kv_bytes(p, ops.dv.dtype), 0xFF);
    void* scratch = mem.alloc(cuda::backward_scratch_bytes(dp, deterministic_), 0);
    if (const char* e = cuda::attention_backward(dp, d, deterministic_, scratch, nullptr))
      return keep(e);
    if (const char* e = finish()) return e;
    cudaMemcpy(ops.dq.data, d.dq.data, q_bytes(p, ops.dq.dtype), cudaMemcpyDeviceToHost);
    cudaMemcpy(ops.dk.data, d.dk.data, kv_bytes(p, ops.dk.dtype), cudaMemcpyDeviceToHost);
    cudaMemcpy(ops.dv.data, d.dv.data, kv_bytes(p, ops.dv.dtype), cudaMemcpyDeviceToHost);
    return finish();
  }

  const char* bias_grad(const AttentionProblem& p, const BiasGradOperands& ops, int) override {
    DeviceBuffers mem;
    const AttentionProblem dp = stage(p, mem);
    BiasGradOperands d = upload_backward_inputs(p, ops, mem);
    const size_t db_bytes = product(p.bias.dims) * sizeof(float);
    d.dbias = static_cast<float*>(mem.alloc(db_bytes, 0xFF));
    void* scratch = mem.alloc(cuda::bias_grad_scratch_bytes(dp), 0);
    if (const char* e = cuda::attention_bias_grad(dp, d, scratch, nullptr)) return keep(e);
    if (const char* e = finish()) return e;
    cudaMemcpy(ops.dbias, d.dbias, db_bytes, cudaMemcpyDeviceToHost);
    return finish();
  }

 private:
  static size_t q_bytes(const AttentionProblem& p, DType t) {
    return p.batch * p.q_len * p.q_heads * p.head_dim * dsize(t);
  }
  static size_t kv_bytes(const AttentionProblem& p, DType t) {
    return p.batch * p.kv_len * p.kv_heads * p.head_dim * dsize(t);
  }
  static size_t lse_bytes(const AttentionProblem& p) {
    return p.batch * p.q_heads * p.q_len * sizeof(float);
  }
  // `ops` with device copies of the inputs the backward and the bias
  // gradient share (q, k, v, o, d_o, lse); the outputs still on the host.
  template <class Operands>
  static Operands upload_backward_inputs(const AttentionProblem& p, const Operands& ops,
                                         DeviceBuffers& mem) {
    Operands d = ops;
    d.q.data = mem.upload(ops.q.data, q_bytes(p, ops.q.dtype));
    d.k.data = mem.upload(ops.k.data, kv_bytes(p, ops.k.dtype));
    d.v.data = mem.upload(ops.v.data, kv_bytes(p, ops.v.dtype));
    d.o.data = mem.upload(ops.o.data, q_bytes(p, ops.o.dtype));
    d.d_o.data = mem.upload(ops.d_o.data, q_bytes(p, ops.d_o.dtype));
    d.lse = mem.upload(ops.lse, lse_bytes(p));
    return d;
  }
  // The problem with its lengths, segment ids, bias and mask in device memory.
  static AttentionProblem stage(const AttentionProblem& p, DeviceBuffers& mem) {
    AttentionProblem d = p;
    const size_t b = p.batch * sizeof(int32_t);
    d.q_lengths = mem.upload(p.q_lengths, b);
    d.kv_lengths = mem.upload(p.kv_lengths, b);
    d.q_segment_ids = mem.upload(p.q_segment_ids, b * p.q_len);
    d.kv_segment_ids = mem.upload(p.kv_segment_ids, b * p.kv_len);
    d.bias.data = mem.upload(p.bias.data, product(p.bias.dims) * dsize(p.bias.dtype));
    d.mask.data = mem.upload(p.mask.data, product(p.mask.dims));  // one byte each
    return d;
  }
  // Waits for the GPU; nullptr, or the first CUDA error of the call.
  const char* finish() {
    const cudaError_t e = cudaDeviceSynchronize();
    if (e != cudaSuccess) return keep(cudaGetErrorString(e));
    const cudaError_t last = cudaGetLastError();
    return last == cudaSuccess ? nullptr : keep(cudaGetErrorString(last));
  }
  const char* keep(const char* message) {
    error_ = message;
    return error_.c_str();
  }

  bool deterministic_;
  std::string error_;
};

}  // namespace

int main(int argc, char** argv) {
  bool deterministic = false;
  std::string family = "hopper", filter;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--deterministic") {
      deterministic = true;
    } else if (arg == "--family" && i + 1 < argc) {
      family = argv[++i];
    } else if (arg.rfind("--", 0) == 0) {
      std::fprintf(stderr, "unknown argument %s\n", arg.c_str());
      return 1;
    } else {
      filter = arg;
    }
  }
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("no CUDA GPU: nothing checked\n");
    return 2;
  }
  if (!cuda::set_fastest_kernel_family(family)) {
    std::fprintf(stderr, "--family must be hopper, mma_sync or simt, got %s\n", family.c_str());
    return 1;
  }
  std::printf("family %s, %s backward\n", family.c_str(),
              deterministic ? "deterministic" : "atomic");
  CudaBackend backend(deterministic);
  cuda::set_launch_recording(true);
  int ran = 0;
  for (const Case& c : standard_cases()) {
    if (!filter.empty() && c.name.find(filter) == std::string::npos) continue;
    run_case(c, backend);
    ++ran;
  }
  std::set<std::string> kernels;
  for (const std::string& name : cuda::take_launch_record()) kernels.insert(name);
  std::printf("%d cases; kernels that ran:\n", ran);
  for (const std::string& name : kernels) std::printf("  %s\n", name.c_str());
  if (ran == 0 || failures()) {
    std::printf("FAILED: %d check(s), %d cases\n", failures(), ran);
    return 1;
  }
  std::printf("ALL PASSED\n");
  return 0;
}
