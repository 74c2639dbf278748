// Framework-free FlashAttention-2 training kernels for the CPU.
//
// Nothing in cpp/cpu/ knows about XLA, JAX or Python: the FFI layer
// (cpp/ffi/) translates XLA buffers into the plain structs below, and a
// C++ test could call these functions directly.
// The numerical conventions are those of attention_problem.h; in addition
// the backward is deterministic: no atomics, fixed reduction order.
#pragma once

#include <cstdint>

#include "attention_problem.h"

namespace fatrain::cpu {

// The problem and operand structs are shared with the other backends.
using fatrain::AttentionProblem;
using fatrain::BackwardOperands;
using fatrain::BiasGradOperands;
using fatrain::DType;
using fatrain::ForwardOperands;
using fatrain::kMaxHeadDim;
using fatrain::ScoreTensor;
using fatrain::SeqTensor;

// Runs body(context, i) for every i in [0, count), possibly concurrently, and
// returns only when all have finished. Items must be independent. The FFI
// layer implements it on XLA's intra-op thread pool; serial_parallel_for runs
// them in order on the calling thread. A plain function pointer (not
// std::function) keeps the ISA-specific translation units free of standard
// library templates, see cpu_attention_impl.h.
struct ParallelFor {
  void (*run)(void* self, int64_t count, void (*body)(void* context, int64_t i),
              void* context) = nullptr;
  void* self = nullptr;
  // Number of worker threads: sizes per-thread scratch and picks the
  // backward's form (kernels/backward.h: use_fused_backward).
  int64_t num_threads = 1;
};
ParallelFor serial_parallel_for();

// Returns nullptr when the problem is well formed, else a static or
// thread-local message naming the offending field (never throws).
const char* validate_problem(const AttentionProblem& problem);

// Each entry point validates, runs, and returns nullptr on success or an
// error message (e.g. allocation failure). They never throw or abort.
const char* attention_forward(const AttentionProblem& problem,
                              const ForwardOperands& operands,
                              const ParallelFor& parallel);
const char* attention_backward(const AttentionProblem& problem,
                               const BackwardOperands& operands,
                               const ParallelFor& parallel);
const char* attention_bias_grad(const AttentionProblem& problem,
                                const BiasGradOperands& operands,
                                const ParallelFor& parallel);

// The instruction set the kernels were dispatched to on this machine
// ("avx512_amx", "avx512", "avx2", "baseline", ...), for benchmarks and bug
// reports.
const char* selected_isa();

// The vector instructions the selected kernels were compiled for: "avx512",
// "avx2", "sse2", "neon" or "scalar" (baseline is sse2 on x86-64 and neon on
// arm64).
const char* selected_vector_isa();

// This machine's float32 FMA rate in GFLOP/s with the selected ISA's vectors:
// `threads` threads (0: one per CPU this process may run on) each running independent
// vector FMAs for about `seconds`. What the benchmark compares kernels with.
double fma_peak_gflops(int threads, double seconds);

// The same for bfloat16 pair dot products (vdpbf16ps, 4 FLOPs per lane), the
// instruction the avx512_bf16 kernels multiply bfloat16 problems with; 0 where
// the selected kernels do not run it natively.
double bf16_dot_peak_gflops(int threads, double seconds);

// The same for AMX bf16 tile products (TDPBF16PS), the instruction the
// avx512_amx kernels multiply bfloat16 problems with; 0 where the selected
// kernels are not those.
double amx_bf16_peak_gflops(int threads, double seconds);

// Tile sizes of every pass: query rows and keys per tile.
constexpr int64_t kTileQ = 64;
constexpr int64_t kTileK = 64;

// Process-wide counts of the (query tile, key tile) pairs the passes compute
// (skipped tiles are not counted): a test tool that shows which tiles the
// masks and segment ids let the kernels skip. Each work item adds its count
// once, atomically.
enum TileVisitCounter : int {
  kTileVisitsForward = 0,
  kTileVisitsBackwardDq = 1,    // backward dQ: pass 1, or the single pass
  kTileVisitsBackwardDkDv = 2,  // backward dK/dV: pass 2, or the single pass
  kTileVisitsBiasGrad = 3,
  kTileVisitCounters = 4,
};
void count_tile_visits(int counter, int64_t tiles);
// Copies the counts into out and, with reset, sets them to zero.
void tile_visits(int64_t out[kTileVisitCounters], bool reset);

}  // namespace fatrain::cpu
