// Dispatch plan of the Metal backend, in portable C++ (no Metal headers).
//
// For one attention problem, the plan lists every compute dispatch the
// kernels in jax_fatrain/metal/*.metal need: kernel name, function-constant
// values, buffer bindings by index (device buffers by role, setBytes data as
// bytes), threadgroup memory length, grid and threadgroup size. It is the
// single source of these facts: the macOS host executes a plan with Metal,
// the MSL emulator (cpp/metal/emulator) executes the same plan on the CPU.
//
// The ABI (kernel names, buffer indices, function constants, params structs,
// tile sizes) is jax_fatrain/metal/flash_attn_abi.h, included by the kernels
// too. The problem is the one every backend takes (attention_problem.h) plus
// what the Metal kernels need of the operands' layout. Dispatches:
//   forward   flash_attn_train_fwd_{dt}_d{D}[_boolmask], grid (ceil(qL/BQ), H_q, B)
//   backward  (deterministic, no atomics, no f32 scratch of K/V size)
//     flash_attn_train_bwd_compute_d_{dt}: Delta = rowsum(dO * O), grid (ceil(qL/32), H_q, B)
//     flash_attn_train_bwd_dq_{dt}_d{D}[_boolmask]: Q tiles outer, grid (ceil(qL/BQ), H_q, B)
//     flash_attn_train_bwd_dkdv_{dt}_d{D}[_boolmask]: KV tiles outer, grid (ceil(kL/BKV), H_kv, B),
//       looping over the query heads of its GQA group and all query tiles
//   or, when the dQ accumulators fit kFusedBackwardScratchBudget (fused backward, 5 tile
//   products per block instead of 7):
//     flash_attn_train_bwd_compute_d_{dt}, as above
//     flash_attn_train_bwd_dkdv_dq_{dt}_d{D}[_boolmask]: grid (nsplit, H_kv, B); threadgroup s
//       walks the key tiles of split s and adds dS K into float32 accumulator split s
//     flash_attn_train_bwd_dq_reduce_{dt}: dQ = scale * sum of the splits, grid
//       (ceil(qL/kBwdReduceRows), H_q, B), threadgroup (kBwdReduceThreads, 1, 1)
//   threadgroup (32, kSimdgroups, 1), except (32, bwd_dkdv_threads / 32, 1) for dK/dV: the
//   only source of threads per threadgroup (hosts and emulator take them from the plan).
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "attention_problem.h"  // cpp/: the problem every backend takes
#include "flash_attn_abi.h"       // jax_fatrain/metal: shared with the kernels

namespace fatrain::metal_plan {

using fatrain::DType;

// What a device-buffer binding refers to; the executor maps roles to memory.
enum class Role : int32_t {
  kQ, kK, kV, kO, kL, kMask, kQLengths, kKVLengths, kDO, kDelta, kDQ, kDK, kDV,
  kQSegmentIds, kKVSegmentIds,
  kDQAccum,  // float32 dQ accumulators of the fused backward (scratch)
};
const char* role_name(Role role);

// Element strides of a [batch, heads, seq, head_dim] tensor (head_dim contiguous).
struct Strides {
  int64_t batch = 0, head = 0, seq = 0;
};

// An attention problem for the Metal kernels: sizes, scale, causal, window,
// and which optional operands are present (lengths, segment ids, and at most
// one of bias and mask: the kernels take one score operand, expanded along
// the keys), as every backend describes them; the plan reads only the
// presence of the optional operands, their memory comes by role. Added: the
// element type of Q, K, V, O (and of dO, dQ, dK, dV) and their strides.
struct Problem : AttentionProblem {
  DType dtype = DType::kF32;
  Strides q, k, v, o;  // dO has O's strides, dQ Q's, dK K's, dV V's
};

struct Binding {
  int index = 0;
  bool is_bytes = false;
  Role role = Role::kQ;             // when !is_bytes
  std::vector<uint8_t> bytes;       // when is_bytes (setBytes)
};

// Threads of a simdgroup: the kernels' simd reductions, shuffles and
// simdgroup_matrix layouts assume the 32 of Apple GPUs. Every threadgroup is
// (kSimdgroupWidth, simdgroups, 1); the macOS host refuses a pipeline whose
// threadExecutionWidth differs.
constexpr uint32_t kSimdgroupWidth = 32;

struct Dispatch {
  std::string kernel;
  std::vector<std::pair<int, bool>> constants;  // (function constant index, value)
  std::vector<Binding> bindings;
  uint32_t threadgroup_memory_length = 0;
  uint32_t grid[3] = {1, 1, 1};         // threadgroups per grid
  uint32_t threadgroup[3] = {1, 1, 1};  // threads per threadgroup
  uint64_t threads_per_threadgroup() const {
    return uint64_t(threadgroup[0]) * threadgroup[1] * threadgroup[2];
  }
};

// A buffer the executor must allocate for the plan's lifetime (contents
// undefined on entry; the plan writes before it reads).
struct Scratch {
  Role role;
  uint64_t bytes;
};

struct Plan {
  std::vector<Scratch> scratch;
  std::vector<Dispatch> dispatches;  // in order; each depends on the previous ones
};

// Params structs, indices and tile sizes: the header the kernels include too.
using metal_abi::AttnMaskParams;
using metal_abi::AttnParams;
using metal_abi::WindowParams;

// The fused backward keeps nsplit float32 dQ accumulators of B x H_q x
// dq_accum_rows(qL) x D floats each. It is planned when one split fits this
// many bytes; the number of splits is
//   nsplit = min(ceil(target / (B * H_kv)),                          -- fill the GPU
//                number of key tiles,                                -- one tile at least
//                kFusedBackwardScratchBudget / bytes of one split)   -- the budget
// with target = backward_target_threadgroups(gpu_cores, key tile): two
// threadgroups per core of the GPU the plan runs on, or
// kBackwardTargetThreadgroups when the core count is not known (0) and, at
// least, where the key tiles are shorter than kShortSplitMinBlockKv keys. It
// is then evened out: nsplit = ceil(tiles / ceil(tiles / nsplit)), so that
// every split walks the same number of key tiles (+-1). Otherwise the
// backward is the two-kernel form (dQ kernel + dK/dV kernel, no
// accumulators). Key tiles are the fused kernel's: bwd_block_kv(D, element
// bytes, fused).
//
// Why two threadgroups per core: with fewer, a core runs 8 simdgroups
// instead of 16 and the compute-bound fused kernel slows by up to 2x. More
// splits make the reduce read more: it reads what the splits wrote,
// nsplit x T x D x 4 bytes per query head (causal: about half, as a split's
// rows above its first key are neither written nor read,
// abi::dq_split_first_row). Fewer make each split walk more key tiles, and a
// split stores its rows on its first tile and reads and writes them on every
// later one: 8 / block_kv bytes per FLOP on top of the operands. With 64-key
// tiles (16-bit D = 64) the fused kernel is bound by its MMAs and hides that
// traffic (one head, T = 4096, D = 64 on an 8-core M1: 16 splits instead of
// the 64 a 40-core GPU needs cut the reduce's bytes to a quarter); with
// shorter tiles (D >= 128, float32) it is bound by device memory and pays
// for it in full, more than the reduce saves (D = 128 and 256 on M1 in the
// model), so there a GPU with fewer than 40 cores keeps the 40-core target.
// Metal reports no core count: the macOS host reads the GPU's IORegistry
// entry (cpp/metal/host/executor.h, gpu_core_count), the emulator's model
// passes the modelled GPU's; without one the rule fills a 40-core GPU.
inline constexpr uint64_t kFusedBackwardScratchBudget = uint64_t(512) << 20;  // 512 MiB
// Threadgroups that fill a large Apple GPU: two per core, 40 cores (M-series
// Max); the target when the GPU's core count is not known, and the least
// target for key tiles shorter than kShortSplitMinBlockKv.
inline constexpr int kBackwardTargetThreadgroups = 80;
// The shortest fused key tile whose kernel hides a longer split's
// accumulator traffic behind its MMAs (see above).
inline constexpr int kShortSplitMinBlockKv = 64;
// Threadgroups the fused backward aims at on a GPU of `gpu_cores` cores (0:
// unknown) with key tiles of `block_kv` keys: two per core, so that every
// core runs two threadgroups at once, and no fewer than a 40-core GPU needs
// where the tiles are shorter than kShortSplitMinBlockKv keys.
inline constexpr int64_t backward_target_threadgroups(int gpu_cores, int block_kv) {
  if (gpu_cores <= 0) return kBackwardTargetThreadgroups;
  const int64_t per_core = 2 * int64_t(gpu_cores);
  return block_kv >= kShortSplitMinBlockKv
             ? per_core
             : std::max<int64_t>(per_core, kBackwardTargetThreadgroups);
}

// What the backward plan takes besides the problem. `gpu_cores`: the GPU's
// core count (0: not known; see above). Test hooks (the defaults are the
// plan's own choice): `force_nsplit` > 0 asks for that many splits (clamped
// to the key tiles; the budget still applies), `scratch_budget` replaces
// kFusedBackwardScratchBudget.
struct BackwardOptions {
  int gpu_cores = 0;
  int force_nsplit = 0;
  uint64_t scratch_budget = kFusedBackwardScratchBudget;
};

// Returns "" when the problem can run on the Metal kernels, else why not.
std::string validate(const Problem& p);
std::string plan_forward(const Problem& p, Plan* plan);
std::string plan_backward(const Problem& p, Plan* plan,
                          const BackwardOptions& options = BackwardOptions());
// The number of dQ accumulator splits plan_backward picks; 0: the two-kernel form.
int backward_splits(const Problem& p, const BackwardOptions& options = BackwardOptions());

// Minimum bytes a buffer of the given role must have for this problem (the
// dQ accumulators: one split; the plan's Scratch entry has the full size).
uint64_t required_bytes(const Problem& p, Role role);

const char* dtype_name(DType t);  // "bf16", "f16", "f32"
std::vector<std::string> all_kernel_names();

}  // namespace fatrain::metal_plan
