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
// too. Dispatches:
//   forward   flash_attn_train_fwd_{dt}_d{D}[_boolmask], grid (ceil(qL/BQ), H_q, B)
//   backward  (deterministic, no atomics, no f32 scratch of K/V size)
//     flash_attn_train_bwd_compute_d_{dt}: Delta = rowsum(dO * O), grid (ceil(qL/32), H_q, B)
//     flash_attn_train_bwd_dq_{dt}_d{D}[_boolmask]: Q tiles outer, grid (ceil(qL/BQ), H_q, B)
//     flash_attn_train_bwd_dkdv_{dt}_d{D}[_boolmask]: KV tiles outer, grid (ceil(kL/BKV), H_kv, B),
//       looping over the query heads of its GQA group and all query tiles
//   threadgroup (32, kSimdgroups, 1), except (32, bwd_dkdv_simdgroups, 1) for dK/dV.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "flash_attn_abi.h"  // jax_fatrain/metal: shared with the kernels

namespace fatrain::metal_plan {

enum class DType : int32_t { kF32 = 0, kBF16 = 1, kF16 = 2, kBool = 3 };

// What a device-buffer binding refers to; the executor maps roles to memory.
enum class Role : int32_t {
  kQ, kK, kV, kO, kL, kMask, kQLengths, kKVLengths, kDO, kDelta, kDQ, kDK, kDV,
};
const char* role_name(Role role);

// Element strides of a [batch, heads, seq, head_dim] tensor (head_dim contiguous).
struct Strides {
  int64_t batch = 0, head = 0, seq = 0;
};

enum class MaskKind : int32_t { kNone = 0, kAdditive = 1, kBool = 2 };

struct Problem {
  int64_t batch = 0, q_heads = 0, kv_heads = 0, q_len = 0, kv_len = 0, head_dim = 0;
  DType dtype = DType::kF32;   // Q, K, V, O, dO, dQ, dK, dV
  float scale = 1.0f;          // applied to Q K^T in float32
  bool causal = false;         // top-left: query i sees key j <= i
  int64_t window_left = -1;    // query i sees key j iff i-left <= j <= i+right; -1: unbounded
  int64_t window_right = -1;
  bool has_q_lengths = false;  // int32 [B]: rows i >= len see nothing
  bool has_kv_lengths = false; // int32 [B]: keys j >= len are invisible
  Strides q, k, v, o;          // dO has O's strides, dQ Q's, dK K's, dV V's
  MaskKind mask = MaskKind::kNone;
  DType mask_dtype = DType::kBool;  // additive: must equal dtype; bool: kBool
  int64_t mask_strides[4] = {0, 0, 0, 0};  // [B, N, T, S] element strides, 0 = broadcast
};

struct Binding {
  int index = 0;
  bool is_bytes = false;
  Role role = Role::kQ;             // when !is_bytes
  std::vector<uint8_t> bytes;       // when is_bytes (setBytes)
};

struct Dispatch {
  std::string kernel;
  std::vector<std::pair<int, bool>> constants;  // (function constant index, value)
  std::vector<Binding> bindings;
  uint32_t threadgroup_memory_length = 0;
  uint32_t grid[3] = {1, 1, 1};         // threadgroups per grid
  uint32_t threadgroup[3] = {1, 1, 1};  // threads per threadgroup
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

// Returns "" when the problem can run on the Metal kernels, else why not.
std::string validate(const Problem& p);
std::string plan_forward(const Problem& p, Plan* plan);
std::string plan_backward(const Problem& p, Plan* plan);

// Minimum bytes a buffer of the given role must have for this problem.
uint64_t required_bytes(const Problem& p, Role role);

const char* dtype_name(DType t);  // "bf16", "f16", "f32"
std::vector<std::string> all_kernel_names();

}  // namespace fatrain::metal_plan
