// Framework-free FlashAttention-2 training kernels for NVIDIA GPUs.
//
// Nothing in cpp/cuda/ knows about XLA, JAX or Python: the FFI layer
// (cpp/ffi/cuda_ffi.cc) translates XLA buffers into the plain structs below.
// The structs are those of attention_problem.h (shared with the CPU kernels);
// every pointer in them is a device pointer (lengths included) and every entry
// point only enqueues work on the given stream.
//
// Conventions (docs/design.md): S = scale * Q Kᵀ in float32, bias added after
// scaling, boolean mask / causal (top-left) / window / lengths remove scores,
// L in natural log float32 [B, Nq, T], a row with no visible key has O = 0,
// L = -inf and zero gradients.
//
// Paths (kernel_choice.h has the rules):
//  * bf16 / f16 with head_dim 64, 128 or 256 (16-byte aligned operands): tensor
//    cores, FA-2 tiling, float32 accumulation, online softmax in base 2; on
//    Hopper warp-specialised wgmma/TMA kernels, elsewhere mma.sync.
//  * everything else (float32 operands, other head dims): a plain float32
//    SIMT path (one warp per row), exact to float32 rounding, slow.
//  * backward: D = rowsum(dO∘O) pre-kernel; KV-tile-outer kernel with dK/dV
//    in registers looping over the GQA group. dQ either by float32 atomics into
//    scratch (default, nondeterministic in the last bits when more than one KV
//    tile contributes) or, with `deterministic`, by a separate Q-tile-outer
//    kernel (bitwise reproducible).
//  * the bias gradient is a separate deterministic kernel (float32 out).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include <cuda_runtime_api.h>

#include "attention_problem.h"

namespace fatrain::cuda {

// The problem and operand structs are shared with the CPU backend; here every
// pointer in them is a device pointer.
using fatrain::AttentionProblem;
using fatrain::BackwardOperands;
using fatrain::BiasGradOperands;
using fatrain::DType;
using fatrain::ForwardOperands;
using fatrain::kMaxHeadDim;
using fatrain::ScoreTensor;
using fatrain::SeqTensor;

// nullptr when well formed, else a message naming the field.
const char* validate_problem(const AttentionProblem& problem);

// Device scratch (bytes) each entry point needs; the caller passes at least
// that much, 256-byte aligned.
size_t forward_scratch_bytes(const AttentionProblem& problem);
size_t backward_scratch_bytes(const AttentionProblem& problem, bool deterministic);
size_t bias_grad_scratch_bytes(const AttentionProblem& problem);

// Enqueue on `stream`. Return nullptr on success or a message (validation or
// the CUDA launch error string).
const char* attention_forward(const AttentionProblem& problem,
                              const ForwardOperands& operands, void* scratch,
                              cudaStream_t stream);
const char* attention_backward(const AttentionProblem& problem,
                               const BackwardOperands& operands, bool deterministic,
                               void* scratch, cudaStream_t stream);
const char* attention_bias_grad(const AttentionProblem& problem,
                                const BiasGradOperands& operands, void* scratch,
                                cudaStream_t stream);

// Which path a problem takes ("tensor_core" or "simt"), for tests/benchmarks.
const char* selected_path(const AttentionProblem& problem, DType dtype);

// Caps the kernel families later launches may use (kernel_choice.h), for
// tests, which run every kept family on one GPU: "hopper" (no cap, the
// default), "mma_sync" (the sm_80 kernels, then SIMT) or "simt". Returns
// false, changing nothing, for any other name. Process-wide.
bool set_fastest_kernel_family(std::string_view name);

// A record of the kernels the entry points launch, for tests: several
// kernels can serve one problem (kernel_choice.h), so a test that expects
// one checks here that it ran. While
// recording is on, every launch appends its kernel's name (cudaFuncGetName,
// demangled where the C++ runtime can: "...bwd_ws_kernel<__nv_bfloat16, 64,
// true, 0, 128>(...)"); take_launch_record returns the names since the last
// call and empties the record. Off by default, and then a
// launch only reads one flag.
void set_launch_recording(bool on);
std::vector<std::string> take_launch_record();

// Counts of the tiles the tensor-core kernels visit, for tests that check what
// causality, windows and segment ids let them skip: each block adds the
// length of the tile range it walks (the key tiles of its query rows, or in
// the backward the query tiles of its keys), once per work item, to its
// entry point's counter. The units are each kernel's own tiles, so only
// counts of one kernel family on one shape compare; the SIMT kernels, which
// walk rows, count nothing. Off by default, and then a launch passes a null
// counter. Returns nullptr or the CUDA error of allocating the counters.
const char* set_tile_visit_counting(bool on);
// The counts {forward, backward} since the last call, which zeroes them;
// waits for the device first.
std::vector<unsigned long long> take_tile_visits();

}  // namespace fatrain::cuda
