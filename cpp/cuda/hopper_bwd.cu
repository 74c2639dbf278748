// Hopper FlashAttention backward (wgmma from shared memory, sm_90a only),
// KV tiles outer: bwd_wgmma_kernel for head_dim 64 and 128, below it
// bwd_wgmma_d256_kernel for head_dim 256.
//
// Grid (ceil(S / 128), K, B), two warpgroups; warpgroup w owns keys
// [64 w, 64 w + 64) of the block and keeps their dK, dV (64 x D float32) in
// registers while the block walks the query heads of its GQA group and the
// query tiles of 64 that can see its keys (Q, dO, L, D double buffered).
// Per query tile:
//   1. Sᵀ = K Qᵀ, dPᵀ = V dOᵀ        (ss wgmma, all operands K-major, two
//      commit groups); Pᵀ = exp2(Sᵀ - L) once Sᵀ is done, dSᵀ = Pᵀ (dPᵀ - D)
//      once dPᵀ is, in registers; dSᵀ also goes to shared memory as 16-bit
//      for step 3.
//   2. dV += Pᵀ dO (issued before dPᵀ is waited for), dK += dSᵀ Q
//                                     (rs wgmma: A from registers, B MN-major);
//   3. (atomic mode) dQ += dS K        (ss wgmma, A = dSᵀ and B = K read
//      MN-major; warpgroup w takes columns [w D/2, (w + 1) D/2)), added to a
//      float32 scratch with atomics. The deterministic mode leaves dQ to
//      tc_dq.cu.
#include "cuda/hopper_bwd_common.cuh"
#include "cuda/launch.h"
#include "cuda/wgmma.cuh"

namespace fatrain::cuda {
namespace {

constexpr int kBK = 128, kBQ = kBwdBQ, kNT = 256;

// The start of query step it: its stage has landed and every warp is done
// with step it - 1, so that step's stage (and whatever else it wrote to
// shared memory) may be overwritten; step it + 1 is prefetched.
template <class Prefetch>
__device__ __forceinline__ void begin_query_step(int it, int total, Prefetch&& prefetch) {
  cp_async_wait<0>();
  fence_proxy_async();
  __syncthreads();
  if (it + 1 < total) prefetch(it + 1, (it + 1) & 1);
  cp_async_commit();
}

// The block's K and V rows [j0, j0 + BK) of KV head kvh (SW128, cp.async).
template <int BK, int D>
__device__ __forceinline__ void load_key_block(const KParams& p, int b, int kvh, int j0,
                                               uint32_t sK, uint32_t sV, int tid) {
  const uint16_t* kb = static_cast<const uint16_t*>(p.k) + b * p.k_bs + kvh * p.k_hs;
  const uint16_t* vb = static_cast<const uint16_t*>(p.v) + b * p.k_bs + kvh * p.k_hs;
  load_tile_sw128<BK, D, kNT>(sK, kb, p.k_ss, j0, p.S, tid);
  load_tile_sw128<BK, D, kNT>(sV, vb, p.k_ss, j0, p.S, tid);
}

// One query step's Q and dO rows [i0, i0 + kBQ) of head h (SW128, cp.async)
// and their L and D row statistics.
template <int D>
__device__ __forceinline__ void load_query_step(const KParams& p, int b, int h, int i0,
                                                uint32_t sQ, uint32_t sdO, float* sL,
                                                float* sDs, int tid) {
  const uint16_t* qb = static_cast<const uint16_t*>(p.q) + b * p.q_bs + h * p.q_hs;
  const uint16_t* dob = static_cast<const uint16_t*>(p.d_o) + b * p.q_bs + h * p.q_hs;
  load_tile_sw128<kBQ, D, kNT>(sQ, qb, p.q_ss, i0, p.T, tid);
  load_tile_sw128<kBQ, D, kNT>(sdO, dob, p.q_ss, i0, p.T, tid);
  load_row_stats(p, b, h, i0, kBQ, tid, sL, sDs);
}

// Bytes of one slot of staged score tiles, [kBQ queries][kBK keys] (EB bytes
// per element, 0: none staged).
template <int EB>
__host__ __device__ constexpr int bwd_score_slot_bytes() {
  return EB == 0 ? 0 : kBQ * staged_row_bytes<kBK, EB>();
}

template <int D, int EB>
constexpr int hopper_bwd_smem_bytes() {
  // K, V; 2 stages of Q, dO; dSᵀ; 2 stages of L, D; 2 slots of staged scores;
  // alignment slack.
  return (2 * kBK * D + 4 * kBQ * D + kBK * kBQ) * 2 + 4 * kBQ * 4 +
         2 * bwd_score_slot_bytes<EB>() + 1024;
}

// EB > 0: the mask (1) or 16-bit bias (2) is staged in shared memory with the
// Q and dO tiles of the same step (KParams::staged).
template <class E, int D, bool ATOMIC, int EB>
__global__ void __launch_bounds__(kNT, 1) bwd_wgmma_kernel(const KParams p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr int BK = kBK, BQ = kBQ, NT = kNT, DH = D / 2;
  constexpr uint32_t kQStage = BQ * D * 2;
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  const uint32_t base = (smem_u32(smem_raw) + 1023) & ~1023u;
  const uint32_t sK = base, sV = sK + BK * D * 2;
  const uint32_t sQ = sV + BK * D * 2;      // 2 stages
  const uint32_t sdO = sQ + 2 * kQStage;    // 2 stages
  const uint32_t sdS = sdO + 2 * kQStage;   // [BK keys][BQ queries]
  float* sL = reinterpret_cast<float*>(smem_raw + (sdS + BK * BQ * 2 - smem_u32(smem_raw)));
  float* sDs = sL + 2 * BQ;
  uint8_t* sdS_ptr = smem_raw + (sdS - smem_u32(smem_raw));
  // 2 slots of staged scores after the row statistics, when EB > 0.
  const uint32_t sScore = sdS + BK * BQ * 2 + 4 * BQ * 4;
  constexpr int kScoreSlot = bwd_score_slot_bytes<EB>(), kScoreRow = staged_row_bytes<BK, EB>();

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int wg = warp >> 2, wq = warp & 3;
  const int b = blockIdx.z, kvh = blockIdx.y, j0 = blockIdx.x * BK;
  HeadMask hm;
  QuerySteps<> steps;
  steps.init(p, hm, b, kvh, j0, BK);
  const int total = steps.total;

  load_key_block<BK, D>(p, b, kvh, j0, sK, sV, tid);

  auto prefetch = [&](int it, int stage) {
    const int h = steps.head(it), i0 = steps.row0(it);
    load_query_step<D>(p, b, h, i0, sQ + stage * kQStage, sdO + stage * kQStage,
                       sL + stage * BQ, sDs + stage * BQ, tid);
    if constexpr (EB > 0)
      stage_score_tile<BQ, BK, EB, NT>(p, b, h, sScore + stage * kScoreSlot, i0, j0, tid);
  };
  if (total > 0) prefetch(0, 0);
  cp_async_commit();

  float dk[D / 2], dv[D / 2], st[BQ / 2], dpt[BQ / 2];
#pragma unroll
  for (int i = 0; i < D / 2; ++i) dk[i] = dv[i] = 0.f;
#pragma unroll
  for (int i = 0; i < BQ / 2; ++i) st[i] = dpt[i] = 0.f;
  const int key_w0 = wg * 64 + wq * 16;  // the warp's 16 keys, relative to j0

  for (int it = 0; it < total; ++it) {
    const int h = steps.head(it), i0 = steps.row0(it);
    begin_query_step(it, total, prefetch);  // the previous step's dSᵀ is free too
    hm.init(p, b, h, kLog2e);
    const uint32_t cQ = sQ + (it & 1) * kQStage, cdO = sdO + (it & 1) * kQStage;
    const float* cL = sL + (it & 1) * BQ;
    const float* cDs = sDs + (it & 1) * BQ;

    // 1. Sᵀ and dPᵀ for this warpgroup's 64 keys x the tile's 64 queries;
    // Pᵀ and dV += Pᵀ dO go ahead while dPᵀ computes.
    issue_st_dpt<E, D, BK>(st, dpt, sK, sV, wg * 64, cQ, cdO);
    wgmma_wait<1>();
    fence_regs(st);
    const bool full = hm.tile_is_full<EB>(i0, i0 + BQ, j0 + key_w0, j0 + key_w0 + 16);
    const uint8_t* staged = smem_raw + (sScore + (it & 1) * kScoreSlot - smem_u32(smem_raw));
    compute_pt<EB, kScoreRow>(st, hm, p.scale_log2, cL, i0, j0, key_w0, 0, lane, full,
                              staged);

    // 2a. dV += Pᵀ dO; dSᵀ once dPᵀ is done, also to shared memory as 16-bit
    // for step 3.
    issue_dv<E, D>(dv, st, cdO);
    wgmma_wait<1>();  // dPᵀ is done; dV may still run
    fence_regs(dpt);
    compute_dst(dpt, st, cDs, 0, lane);
    if constexpr (ATOMIC) {
      store_key_major<E, BK>(sdS_ptr, dpt, key_w0, 0, lane);
      fence_proxy_async();
    }

    // 2b. dK += dSᵀ Q.
    issue_dk<E, D>(dk, dpt, cQ);

    // 3. dQ (64 queries x D/2 columns of this warpgroup) += dS K.
    if constexpr (ATOMIC) {
      __syncthreads();  // dSᵀ of both warpgroups is in shared memory
      float dq[DH / 2];
      issue_dq<E, DH, BK>(dq, sdS, sK, wg * DH);
      wgmma_wait<0>();
      fence_regs(dq);
      add_dq_tile<DH>(p, dq, b, h, i0, wg * DH, wq, lane);
    } else {
      wgmma_wait<0>();
    }
    fence_regs(dv);
    fence_regs(dk);
  }

  store_dk_dv<E, D>(p, dk, dv, b, kvh, j0 + wg * 64, 0, wq, lane);
#endif  // __CUDA_ARCH_FEAT_SM90_ALL: other targets get an empty kernel, never launched
}

// head_dim 256: dK and dV of 64 keys x 256 would take 256 registers per
// thread, so here both warpgroups share the block's 64 keys and split the
// head dim instead: warpgroup w keeps dK, dV columns [128 w, 128 w + 128).
// Grid (ceil(S / 64), K, B); per query tile of 64 (Q, dO, L, D double
// buffered):
//   1. Sᵀ, dPᵀ for the 64 keys x queries [32 w, 32 w + 32) (ss wgmma, N = 32);
//      Pᵀ and dSᵀ go to shared memory as 16-bit [key][query] tiles, because
//      step 2 needs all 64 queries of them in each warpgroup;
//   2. dV += Pᵀ dO, dK += dSᵀ Q on this warpgroup's columns (ss wgmma, A
//      K-major from those tiles, B MN-major);
//   3. (atomic mode) dQ += dS K on the same columns (A = dSᵀ read MN-major),
//      added with atomics as in the kernel above.
constexpr int kBK256 = 64;

constexpr int hopper_bwd256_smem_bytes() {
  // K, V; 2 stages of Q, dO; Pᵀ and dSᵀ; 2 stages of L, D; alignment slack.
  return (2 * kBK256 * 256 + 4 * kBQ * 256 + 2 * kBK256 * kBQ) * 2 + 4 * kBQ * 4 + 1024;
}

template <class E, bool ATOMIC>
__global__ void __launch_bounds__(kNT, 1) bwd_wgmma_d256_kernel(const KParams p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr int D = 256, BK = kBK256, BQ = kBQ, DW = D / 2, QW = BQ / 2;
  constexpr uint32_t kQStage = BQ * D * 2;
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  const uint32_t base = (smem_u32(smem_raw) + 1023) & ~1023u;
  const uint32_t sK = base, sV = sK + BK * D * 2;
  const uint32_t sQ = sV + BK * D * 2;      // 2 stages
  const uint32_t sdO = sQ + 2 * kQStage;    // 2 stages
  const uint32_t sP = sdO + 2 * kQStage;    // Pᵀ: [BK keys][BQ queries]
  const uint32_t sdS = sP + BK * BQ * 2;    // dSᵀ, likewise
  auto smem_ptr = [&](uint32_t addr) { return smem_raw + (addr - smem_u32(smem_raw)); };
  float* sL = reinterpret_cast<float*>(smem_ptr(sdS + BK * BQ * 2));
  float* sDs = sL + 2 * BQ;

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int wg = warp >> 2, wq = warp & 3;
  const int b = blockIdx.z, kvh = blockIdx.y, j0 = blockIdx.x * BK;
  HeadMask hm;
  QuerySteps<> steps;
  steps.init(p, hm, b, kvh, j0, BK);
  const int total = steps.total;

  load_key_block<BK, D>(p, b, kvh, j0, sK, sV, tid);
  auto prefetch = [&](int it, int stage) {
    const int h = steps.head(it), i0 = steps.row0(it);
    load_query_step<D>(p, b, h, i0, sQ + stage * kQStage, sdO + stage * kQStage,
                       sL + stage * BQ, sDs + stage * BQ, tid);
  };
  if (total > 0) prefetch(0, 0);
  cp_async_commit();

  float dk[DW / 2], dv[DW / 2], st[QW / 2], dpt[QW / 2];
#pragma unroll
  for (int i = 0; i < DW / 2; ++i) dk[i] = dv[i] = 0.f;
#pragma unroll
  for (int i = 0; i < QW / 2; ++i) st[i] = dpt[i] = 0.f;
  const int key_w0 = wq * 16;  // the warp's 16 keys, relative to j0
  const int q_w0 = wg * QW;    // the warpgroup's 32 queries in step 1, relative to i0

  for (int it = 0; it < total; ++it) {
    const int h = steps.head(it), i0 = steps.row0(it);
    begin_query_step(it, total, prefetch);  // the previous step's Pᵀ, dSᵀ are free too
    hm.init(p, b, h, kLog2e);
    const uint32_t cQ = sQ + (it & 1) * kQStage, cdO = sdO + (it & 1) * kQStage;
    const float* cL = sL + (it & 1) * BQ;
    const float* cDs = sDs + (it & 1) * BQ;

    // 1. Sᵀ and dPᵀ for the 64 keys x this warpgroup's 32 queries.
    issue_st_dpt<E, D, BK, QW>(st, dpt, sK, sV, 0, cQ, cdO, q_w0);
    wgmma_wait<1>();
    fence_regs(st);

    const bool full = hm.tile_is_full(i0 + q_w0, i0 + q_w0 + QW, j0 + key_w0, j0 + key_w0 + 16);
    // launch_d: no mask or bias here.
    compute_pt<0, 0, QW>(st, hm, p.scale_log2, cL, i0, j0, key_w0, q_w0, lane, full, nullptr);
    store_key_major<E, BK, QW>(smem_ptr(sP), st, key_w0, q_w0, lane);
    wgmma_wait<0>();
    fence_regs(dpt);
    compute_dst<QW>(dpt, st, cDs, q_w0, lane);
    store_key_major<E, BK, QW>(smem_ptr(sdS), dpt, key_w0, q_w0, lane);
    fence_proxy_async();
    __syncthreads();  // Pᵀ and dSᵀ of both warpgroups are in shared memory

    // 2. dV += Pᵀ dO, dK += dSᵀ Q on columns [128 w, 128 w + 128).
    issue_dv_dk_from_smem<E, DW, BK>(dv, dk, sP, sdS, cdO, cQ, wg * DW);

    // 3. dQ (64 queries x this warpgroup's 128 columns) += dS K.
    if constexpr (ATOMIC) {
      float dq[DW / 2];
      issue_dq<E, DW, BK>(dq, sdS, sK, wg * DW);
      wgmma_wait<0>();
      fence_regs(dq);
      add_dq_tile<DW>(p, dq, b, h, i0, wg * DW, wq, lane);
    } else {
      wgmma_wait<0>();
    }
    fence_regs(dv);
    fence_regs(dk);
  }

  store_dk_dv<E, DW>(p, dk, dv, b, kvh, j0, wg * DW, wq, lane);
#endif  // __CUDA_ARCH_FEAT_SM90_ALL: other targets get an empty kernel, never launched
}

template <class E, int D, bool ATOMIC, int EB = 0>
cudaError_t launch(const KParams& p, cudaStream_t stream) {
  auto* kernel = bwd_wgmma_kernel<E, D, ATOMIC, EB>;
  if (!has_sm90a_code(kernel)) return cudaErrorNotSupported;
  dim3 grid((p.S + kBK - 1) / kBK, p.K, p.B);
  return launch_with_smem(kernel, grid, kNT, hopper_bwd_smem_bytes<D, EB>(), stream, p);
}

template <class E, bool ATOMIC>
cudaError_t launch_d(const KParams& p, cudaStream_t stream) {
  // With an elementwise mask or bias loaded one score at a time the mma.sync
  // kernel measured faster (docs/cuda.md): each score then waits on a global
  // load, which its 16 resident warps per SM hide better than these 8.
  // Staged through shared memory with the step's Q and dO (D = 64 and 128;
  // at D = 256 the slots do not fit), the loads overlap the previous step.
  if (p.mask != nullptr || p.bias != nullptr) {
    return launch_staged_bwd(p, [&](auto d, auto eb) {
      return launch<E, decltype(d)::value, ATOMIC, decltype(eb)::value>(p, stream);
    });
  }
  switch (p.D) {
    case 64: return launch<E, 64, ATOMIC>(p, stream);
    case 128: return launch<E, 128, ATOMIC>(p, stream);
    case 256: {
      auto* kernel = bwd_wgmma_d256_kernel<E, ATOMIC>;
      if (!has_sm90a_code(kernel)) return cudaErrorNotSupported;
      dim3 grid((p.S + kBK256 - 1) / kBK256, p.K, p.B);
      return launch_with_smem(kernel, grid, kNT, hopper_bwd256_smem_bytes(), stream, p);
    }
    default: return cudaErrorNotSupported;
  }
}

}  // namespace

cudaError_t launch_bwd_wgmma(const KParams& p, DType dtype, bool atomic_dq, cudaStream_t stream) {
  if (dtype == DType::kBF16) {
    return atomic_dq ? launch_d<__nv_bfloat16, true>(p, stream)
                     : launch_d<__nv_bfloat16, false>(p, stream);
  }
  return atomic_dq ? launch_d<__half, true>(p, stream) : launch_d<__half, false>(p, stream);
}

}  // namespace fatrain::cuda
