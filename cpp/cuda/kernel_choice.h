// Which kernel serves a problem: every rule in one place, as pure functions
// of the problem (and, through the launchers' fallbacks, of the GPU). The
// measurements behind each rule are in docs/cuda.md.
//
// Families, fastest first; a launcher that cannot serve a problem returns
// cudaErrorNotSupported and the next family takes it:
//   kHopper   warp-specialised wgmma/TMA kernels (hopper_fwd_ws.cu,
//             hopper_bwd_ws.cu); bf16/f16 at D = 64/128/256 on a GPU running
//             sm_90a code. The backward takes no mask or bias at D = 256 and
//             only a staged one (KParams::staged) at D = 64 and 128.
//   kMmaSync  mma.sync tensor-core kernels (tc_fwd.cu, tc_bwd.cu, tc_dq.cu),
//             sm_80 and later; bf16/f16 at D = 64/128/256, any mask or bias.
//   kSimt     float32-accumulating SIMT kernels (simt.cu): every dtype and
//             head dim, and GPUs without the shared memory a tensor-core
//             kernel needs (the D = 256 backward on an A100).
#pragma once

#include "cuda/attention_cuda.h"
#include "cuda/common.cuh"

namespace fatrain::cuda {

enum class KernelFamily : int { kHopper = 0, kMmaSync = 1, kSimt = 2 };

// The first family a problem may use: kSimt for float32, head dims other
// than 64/128/256, and operands not 16-byte aligned (the tensor-core kernels
// copy 16 bytes at a time); else kHopper. `fastest_allowed` caps it (tests
// run every kept family on one GPU through set_fastest_kernel_family).
inline KernelFamily first_family(DType dtype, int64_t head_dim, bool operands_aligned,
                                 KernelFamily fastest_allowed) {
  const bool tensor_core = (dtype == DType::kBF16 || dtype == DType::kF16) &&
                           (head_dim == 64 || head_dim == 128 || head_dim == 256) &&
                           operands_aligned;
  const KernelFamily first = tensor_core ? KernelFamily::kHopper : KernelFamily::kSimt;
  return static_cast<int>(first) < static_cast<int>(fastest_allowed) ? fastest_allowed : first;
}

// Hopper forward: consumer warpgroups of 64 query rows each. Three at D = 64
// without a mask, bias or window, from T = 2048 on without causality and from
// T = 4096 on with it (there a 64 x 128 tile's softmax takes about as long as
// its two products, so a third consumer keeps the tensor cores busy); else
// two. At T = 1024 a head has six 192-row blocks, 11% of their rows past T:
// without causality they took 386 µs against two consumers' 347 on the
// persistent grid, at T = 2048 (3% past T) 607 against 635; with causality
// at T = 1024 21% longer, at T = 4096 and 8192 5% and 10% less
// (docs/cuda.md). A mask or bias read one score at a time, or the general
// softmax a non-positive scale takes, spills at a third consumer's 160
// registers.
inline int hopper_fwd_consumers(const KParams& p) {
  const bool plain = p.mask == nullptr && p.bias == nullptr && p.scale_log2 > 0.f;
  const bool long_enough = p.T >= (p.causal ? 4096 : 2048);
  return p.D == 64 && plain && long_enough && p.wl < 0 && p.wr < 0 ? 3 : 2;
}

// Hopper forward without a staged mask or bias: keys per K and V tile. A
// longer tile spreads each tile's fixed costs (the consumers' turn barriers,
// the wgmma waits, the softmax's row reductions and O's rescale) over more
// keys, but masks more of them on a diagonal. So, as FlashAttention-3 does:
// at D = 128, 176 keys without causality or a window, else 128; at D = 256,
// 80 (the most keys, a multiple of 8 as a wgmma's N must be, whose two
// stages of K and V fit the shared memory beside Q) without a window, else
// 64; at D = 64, 128. The general softmax (a mask or bias read score by
// score) keeps one instance per head dim, with 128 and 64 keys.
inline int hopper_fwd_key_tile(const KParams& p, bool general_softmax) {
  const bool windowed = p.wl >= 0 || p.wr >= 0;
  switch (p.D) {
    case 64: return 128;
    case 128: return !p.causal && !windowed && !general_softmax ? 176 : 128;
    case 256: return !windowed && !general_softmax ? 80 : 64;
    default: return 0;
  }
}

// Hopper forward: a persistent grid. Each block walks work items, (head,
// query block) pairs, from item blockIdx.x in steps of gridDim.x, heads
// outermost so that the blocks running at one time share a few heads' K and
// V in L2, and loads the next item's first K tile and Q while it finishes the
// last one. With causality an item is two query blocks, m and
// blocks - 1 - m (folded, as the backward folds key blocks): every item then
// has about the same work, so the fixed stride balances; else one.
__host__ __device__ inline bool hopper_fwd_folds_query_blocks(const KParams& p) {
  return p.causal != 0;
}
// Blocks of the Hopper forward: one per SM (a block takes most of an SM's
// shared memory or registers, so only one fits), fewer when there are fewer
// items; but one per item, each block doing a single item, with three
// consumers (hopper_fwd_consumers): there the persistent grid measured 18%
// slower at T = 4096 (1.30 against 1.10 ms on an H100) and no faster at
// T = 1024 and 8192 without causality, and 8% and 20% slower at T = 4096
// and 8192 with it (docs/cuda.md, "A persistent forward").
inline int hopper_fwd_grid(const KParams& p, int64_t items, int sms) {
  if (hopper_fwd_consumers(p) == 3) return static_cast<int>(items);
  return static_cast<int>(items < sms ? items : sms);
}

// Hopper backward at D = 64 and 128: query rows per step. Without a mask
// or bias, 128 at D = 64 (a 64-row step's products and waits are too small
// to keep the tensor cores busy there) and 80 at D = 128 (the most rows
// whose Sᵀ and dPᵀ fit the registers beside dK and dV, and FlashAttention-3's
// step there without causality; docs/cuda.md has its measurements). With a
// staged mask or bias, 64: a staged score slot of more rows does not fit the
// shared memory.
inline int hopper_bwd_query_rows(const KParams& p) {
  if (p.mask != nullptr || p.bias != nullptr) return 64;
  return p.D == 64 ? 128 : p.D == 128 ? 80 : 64;
}

// Hopper backward: with causality key block j sees the queries from j on, so
// its work falls with j and one block (or cluster) per key block ends in a
// tail of idle SMs. Folded, block m does key blocks m and nkb - 1 - m: every
// block about the same work.
inline bool hopper_bwd_folds_key_blocks(const KParams& p) { return p.causal != 0; }

// Hopper backward at D = 256 (dK and dV of 64 keys x 256 columns fill a
// thread's registers, so two blocks share each key block):
//   kClusterPair  in the atomic mode: a thread-block cluster whose two blocks
//                 split the score products (5 products per step instead of
//                 7); where no pair fits the GPU, kSplitHead.
//   kSplitHead    in the deterministic mode: each block computes all of S
//                 and dP and keeps one 128-column half of dK, dV and dQ.
enum class Hopper256Backward : int { kClusterPair, kSplitHead };
inline Hopper256Backward hopper_bwd_256(bool atomic_dq) {
  return atomic_dq ? Hopper256Backward::kClusterPair : Hopper256Backward::kSplitHead;
}

}  // namespace fatrain::cuda
