// Hopper FlashAttention forward (wgmma from shared memory, sm_90a only).
//
// Grid (ceil(T / 128), N, B), two warpgroups of 128 threads; warpgroup w owns
// query rows [64 w, 64 w + 64) of the block and their O (64 x D float32) in
// registers. K and V tiles of BK keys are double buffered through cp.async
// into SW128 tiles (see wgmma.cuh). Per tile t:
//   S_t = Q K_tᵀ      wgmma, A = Q and B = K from shared memory (both K-major);
//   O += P_{t-1} V_{t-1}   wgmma, A = P from registers, B = V (MN-major),
//                     issued right behind S_t so that it runs on the tensor
//                     cores while this warpgroup computes the softmax of S_t;
//   online softmax in base 2 on the S registers (same masking as tc_fwd.cu),
//   then O is rescaled once its wgmma is done and P_t kept as 16-bit pairs.
// One warpgroup-wide wgmma replaces 4 warps' ldmatrix + mma.sync: the B tile
// is read from shared memory once per warpgroup instead of once per warp,
// which was the mma.sync kernels' limit (docs/cuda.md).
#include "cuda/launch.h"
#include "cuda/hopper_fwd_common.cuh"
#include "cuda/wgmma.cuh"

namespace fatrain::cuda {
namespace {

constexpr int kGroups = 2, kBQ = 64 * kGroups, kNT = 128 * kGroups;

template <int D_, int BK_, int MIN_BLOCKS_>
struct HopperFwdTile {
  static constexpr int D = D_, BK = BK_, MIN_BLOCKS = MIN_BLOCKS_;
  // Q + 2 stages of K and V, plus slack to align the base to 1024 bytes.
  static constexpr int kSmemBytes = (kBQ * D + 4 * BK * D) * 2 + 1024;
};

// Shared memory for the two slots of staged score tiles (EB bytes per
// element, 0: none staged).
template <class Tile, int EB>
__host__ __device__ constexpr int staged_slot_bytes() {
  return EB == 0 ? 0 : kBQ * staged_row_bytes<Tile::BK, EB>();
}

// EB > 0: the mask (1) or 16-bit bias (2) is staged in shared memory with the
// K tile of the same step (KParams::staged). EB = 0: LOADED, a mask or bias
// is read one score at a time; !LOADED, the problem has neither.
template <class E, class Tile, int EB, bool LOADED>
__global__ void __launch_bounds__(kNT, Tile::MIN_BLOCKS) fwd_wgmma_kernel(const KParams p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr int D = Tile::D, BK = Tile::BK;
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  const uint32_t sQ = (smem_u32(smem_raw) + 1023) & ~1023u;
  const uint32_t sK = sQ + kBQ * D * 2;
  const uint32_t sV = sK + 2 * BK * D * 2;
  constexpr uint32_t kStage = BK * D * 2;
  const uint32_t sScore = sV + 2 * kStage;  // 2 slots of staged_slot_bytes, when EB > 0
  constexpr uint32_t kScoreSlot = staged_slot_bytes<Tile, EB>();
  auto smem_ptr = [&](uint32_t addr) { return smem_raw + (addr - smem_u32(smem_raw)); };

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int wg = warp >> 2, wq = warp & 3;
  const int b = blockIdx.z, n = blockIdx.y, i0 = blockIdx.x * kBQ;
  const int kvh = n / (p.N / p.K);
  HeadMask hm;
  hm.init(p, b, n, kLog2e);
  const uint16_t* qb = static_cast<const uint16_t*>(p.q) + b * p.q_bs + n * p.q_hs;
  const uint16_t* kb = static_cast<const uint16_t*>(p.k) + b * p.k_bs + kvh * p.k_hs;
  const uint16_t* vb = static_cast<const uint16_t*>(p.v) + b * p.k_bs + kvh * p.k_hs;

  int t_begin, n_tiles;
  hm.key_tiles(p, b, i0, min(i0 + kBQ, p.T), BK, &t_begin, &n_tiles);

  // Loads are grouped so that one wait per tile suffices: the prologue brings
  // Q and K_0; step t brings K_{t+1} and V_t while it computes with K_t and
  // V_{t-1} (each slot's previous tile was finished in step t - 1).
  load_tile_sw128<kBQ, D, kNT>(sQ, qb, p.q_ss, i0, p.T, tid);
  if (n_tiles > 0) load_tile_sw128<BK, D, kNT>(sK, kb, p.k_ss, t_begin * BK, p.S, tid);
  if constexpr (EB > 0) {
    if (n_tiles > 0) stage_score_tile<kBQ, BK, EB, kNT>(p, b, n, sScore, i0, t_begin * BK, tid);
  }
  cp_async_commit();

  float o[D / 2], s[BK / 2];
  uint32_t pv[BK / 4];  // P of the previous tile, 16-bit pairs: the A operand of O += P V
  float m[2], l[2];
  init_fwd_state<D, BK>(o, s, pv, m, l);
  const int warp_row0 = i0 + wg * 64 + wq * 16;  // the warp's 16 rows
  const int row0 = warp_row0 + (lane >> 2);      // this thread's rows: row0, row0 + 8

  // Step t overlaps this warpgroup's softmax of tile t with its O += P V of
  // tile t - 1 on the tensor cores (FlashAttention-3's intra-warpgroup
  // pipelining): issue S_t = Q K_tᵀ, issue O += P_{t-1} V_{t-1}, wait for S_t
  // only, compute P_t and the row statistics, then wait for O and rescale it.
  for (int t = 0; t < n_tiles; ++t) {
    const int j0 = (t_begin + t) * BK;
    cp_async_wait<0>();
    fence_proxy_async();
    __syncthreads();  // K_t and V_{t-1} landed; every warp is done with step t - 1
    const uint32_t cK = sK + (t & 1) * kStage, cV_prev = sV + ((t + 1) & 1) * kStage;
    if (t + 1 < n_tiles) {
      load_tile_sw128<BK, D, kNT>(sK + ((t + 1) & 1) * kStage, kb, p.k_ss, j0 + BK, p.S, tid);
      if constexpr (EB > 0)
        stage_score_tile<kBQ, BK, EB, kNT>(p, b, n, sScore + ((t + 1) & 1) * kScoreSlot, i0,
                                           j0 + BK, tid);
    }
    load_tile_sw128<BK, D, kNT>(sV + (t & 1) * kStage, vb, p.k_ss, j0, p.S, tid);
    cp_async_commit();

    fence_regs(s);
    fence_regs(o);
    fence_regs(pv);
    wgmma_fence();
    issue_qk<E, D, BK, kBQ>(s, sQ, wg * 64, cK);
    if (t > 0) {
      issue_pv<E, D, BK>(o, pv, cV_prev);
      wgmma_wait<1>();
    } else {
      wgmma_wait<0>();
    }
    fence_regs(s);

    // Online softmax in base 2; this thread holds rows row0 (e < 2) and row0 + 8.
    const bool full = hm.tile_is_full<EB>(warp_row0, warp_row0 + 16, j0, j0 + BK);
    float alpha[2];
    const uint8_t* staged_row0 = nullptr;
    if constexpr (EB > 0)
      staged_row0 = smem_ptr(sScore + (t & 1) * kScoreSlot) + (row0 - i0) * staged_row_bytes<BK, EB>();
    online_softmax_tile<BK, EB, LOADED>(s, m, l, alpha, hm, p.scale_log2, full, row0, j0, lane, staged_row0);

    // O += P_{t-1} V_{t-1} is done: rescale O to this tile's maximum and keep
    // P_t for the next step.
    wgmma_wait<0>();
    fence_regs(o);
    fence_regs(pv);
    rescale_o_keep_p<E, D, BK>(o, alpha, s, pv);
  }
  if (n_tiles > 0) {
    cp_async_wait<0>();
    fence_proxy_async();
    __syncthreads();  // V of the last tile landed
    fence_regs(o);
    fence_regs(pv);
    wgmma_fence();
    issue_pv<E, D, BK>(o, pv, sV + ((n_tiles - 1) & 1) * kStage);
    wgmma_wait<0>();
    fence_regs(o);
    fence_regs(pv);
  }

  store_o_lse<E, D>(p, o, m, l, b, n, row0, lane);
#endif  // __CUDA_ARCH_FEAT_SM90_ALL: other targets get an empty kernel, never launched
}

template <class E, class Tile, int EB = 0, bool LOADED = false>
cudaError_t launch(const KParams& p, cudaStream_t stream) {
  auto* kernel = fwd_wgmma_kernel<E, Tile, EB, LOADED>;
  if (!has_sm90a_code(kernel)) return cudaErrorNotSupported;
  dim3 grid((p.T + kBQ - 1) / kBQ, p.N, p.B);
  return launch_with_smem(kernel, grid, kNT, Tile::kSmemBytes + 2 * staged_slot_bytes<Tile, EB>(),
                          stream, p);
}

// Tile shapes: 64-key tiles, two blocks per SM at D = 64 and 128, one at
// D = 256, the fastest measured (docs/cuda.md). Two blocks per SM win where
// they fit: their warpgroups do not wait on each other's barriers, so one
// block's softmax overlaps the other's wgmma.
// JAX_FATRAIN_CUDA_HOPPER_FWD_TILE=1 or 2 selects the other shapes for
// re-measuring on another GPU.
template <class E>
cudaError_t launch_d(const KParams& p, cudaStream_t stream) {
  static const int c = env_tuning_choice("JAX_FATRAIN_CUDA_HOPPER_FWD_TILE");
  // A staged mask or bias adds two slots of 128 rows x 64 keys: D = 64 keeps
  // its shape, D = 128 drops to one block per SM (two no longer fit), and
  // D = 256 does not fit at all, so there each score loads on its own.
  if (p.staged == 1 && p.D == 64) return launch<E, HopperFwdTile<64, 64, 2>, 1>(p, stream);
  if (p.staged == 2 && p.D == 64) return launch<E, HopperFwdTile<64, 64, 2>, 2>(p, stream);
  if (p.staged == 1 && p.D == 128) return launch<E, HopperFwdTile<128, 64, 1>, 1>(p, stream);
  if (p.staged == 2 && p.D == 128) return launch<E, HopperFwdTile<128, 64, 1>, 2>(p, stream);
  // A mask or bias read one score at a time (or a scale <= 0): the default
  // shapes only (the JAX_FATRAIN_CUDA_HOPPER_FWD_TILE alternatives are built
  // for the other problems, to keep the number of instances down).
  if (fwd_needs_general_softmax(p)) {
    switch (p.D) {
      case 64: return launch<E, HopperFwdTile<64, 64, 2>, 0, true>(p, stream);
      case 128: return launch<E, HopperFwdTile<128, 64, 2>, 0, true>(p, stream);
      case 256: return launch<E, HopperFwdTile<256, 64, 1>, 0, true>(p, stream);
      default: return cudaErrorInvalidValue;
    }
  }
  switch (p.D) {
    case 64:
      if (c == 1) return launch<E, HopperFwdTile<64, 128, 1>>(p, stream);
      if (c == 2) return launch<E, HopperFwdTile<64, 128, 2>>(p, stream);
      return launch<E, HopperFwdTile<64, 64, 2>>(p, stream);
    case 128:
      if (c == 1) return launch<E, HopperFwdTile<128, 128, 1>>(p, stream);
      if (c == 2) return launch<E, HopperFwdTile<128, 64, 1>>(p, stream);
      return launch<E, HopperFwdTile<128, 64, 2>>(p, stream);
    case 256: return launch<E, HopperFwdTile<256, 64, 1>>(p, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace

cudaError_t launch_fwd_wgmma(const KParams& p, DType dtype, cudaStream_t stream) {
  return dtype == DType::kBF16 ? launch_d<__nv_bfloat16>(p, stream)
                               : launch_d<__half>(p, stream);
}

}  // namespace fatrain::cuda
