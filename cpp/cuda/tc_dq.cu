// Deterministic dQ: Q tiles outer (grid (ceil(T / BQ), N, B)), each warp keeps
// dQ for its 16 query rows in registers while it walks the visible KV tiles:
// S = Q Kᵀ, dP = dO Vᵀ, dS = P (dP - D), dQ += dS K. No atomics.
#include "cuda/common.cuh"
#include "cuda/launch.h"

namespace fatrain::cuda {
namespace {

template <class E, int D, int NW, int BK>
__global__ void __launch_bounds__(NW * 32) dq_tc_kernel(const KParams p) {
  constexpr int BQ = NW * 16, NT = NW * 32;
  extern __shared__ __align__(128) uint16_t smem[];
  uint16_t* sQ = smem;
  uint16_t* sdO = sQ + BQ * D;
  uint16_t* sK = sdO + BQ * D;   // 2 stages
  uint16_t* sV = sK + 2 * BK * D;  // 2 stages
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int g = lane >> 2, tg = lane & 3;
  const int b = blockIdx.z, n = blockIdx.y, i0 = blockIdx.x * BQ;
  const int kvh = n / (p.N / p.K);
  HeadMask hm;
  hm.init(p, b, n, kLog2e);
  const uint16_t* qb = static_cast<const uint16_t*>(p.q) + b * p.q_bs + n * p.q_hs;
  const uint16_t* dob = static_cast<const uint16_t*>(p.d_o) + b * p.q_bs + n * p.q_hs;
  const uint16_t* kb = static_cast<const uint16_t*>(p.k) + b * p.k_bs + kvh * p.k_hs;
  const uint16_t* vb = static_cast<const uint16_t*>(p.v) + b * p.k_bs + kvh * p.k_hs;

  int t_begin, n_tiles;
  hm.key_tiles(p, b, i0, min(i0 + BQ, p.T), BK, &t_begin, &n_tiles);

  load_tile<BQ, D, NT>(sQ, qb, p.q_ss, i0, p.T, tid);
  load_tile<BQ, D, NT>(sdO, dob, p.q_ss, i0, p.T, tid);
  if (n_tiles > 0) {
    load_tile<BK, D, NT>(sK, kb, p.k_ss, t_begin * BK, p.S, tid);
    load_tile<BK, D, NT>(sV, vb, p.k_ss, t_begin * BK, p.S, tid);
  }
  cp_async_commit();

  const int row_w = warp * 16;
  const int r_glob0 = i0 + row_w + g;
  float L2[2], Ds[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int i = r_glob0 + r * 8;
    L2[r] = INFINITY;
    Ds[r] = 0.f;
    if (i < p.T) {
      const int64_t idx = (static_cast<int64_t>(b) * p.N + n) * p.T + i;
      const float lv = p.lse[idx];
      L2[r] = lv == -INFINITY ? INFINITY : lv * kLog2e;
      Ds[r] = p.dsum[idx];
    }
  }
  float acc[D / 8][4];
#pragma unroll
  for (int i = 0; i < D / 8; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;

  for (int t = 0; t < n_tiles; ++t) {
    const int j0 = (t_begin + t) * BK;
    if (t + 1 < n_tiles) {
      const int st = (t + 1) & 1;
      load_tile<BK, D, NT>(sK + st * BK * D, kb, p.k_ss, j0 + BK, p.S, tid);
      load_tile<BK, D, NT>(sV + st * BK * D, vb, p.k_ss, j0 + BK, p.S, tid);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    const uint16_t* cK = sK + (t & 1) * BK * D;
    const uint16_t* cV = sV + (t & 1) * BK * D;

    float s[BK / 8][4], dp[BK / 8][4];
#pragma unroll
    for (int i = 0; i < BK / 8; ++i)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[i][e] = dp[i][e] = 0.f;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      uint32_t aq[4], ad[4];
      const int a_off = swz<D>(row_w + (lane & 15), kk * 16 + (lane >> 4) * 8);
      ldsm_x4(smem_u32(sQ + a_off), aq[0], aq[1], aq[2], aq[3]);
      ldsm_x4(smem_u32(sdO + a_off), ad[0], ad[1], ad[2], ad[3]);
#pragma unroll
      for (int np = 0; np < BK / 16; ++np) {
        const int b_off = swz<D>(np * 16 + (lane & 7) + (lane >> 4) * 8,
                                 kk * 16 + ((lane >> 3) & 1) * 8);
        uint32_t b0, b1, b2, b3;
        ldsm_x4(smem_u32(cK + b_off), b0, b1, b2, b3);
        Mma<E>::run(s[2 * np], aq, b0, b1);
        Mma<E>::run(s[2 * np + 1], aq, b2, b3);
        ldsm_x4(smem_u32(cV + b_off), b0, b1, b2, b3);
        Mma<E>::run(dp[2 * np], ad, b0, b1);
        Mma<E>::run(dp[2 * np + 1], ad, b2, b3);
      }
    }
    const bool full = hm.tile_is_full(i0 + row_w, i0 + row_w + 16, j0, j0 + BK);
#pragma unroll
    for (int nt = 0; nt < BK / 8; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float x = s[nt][e] * p.scale_log2;
        if (!full) x = hm.apply(r_glob0 + (e >> 1) * 8, j0 + nt * 8 + tg * 2 + (e & 1), x);
        const float pv = exp2_fast(x - L2[e >> 1]);
        s[nt][e] = pv * (dp[nt][e] - Ds[e >> 1]);
      }
    }
#pragma unroll
    for (int kk = 0; kk < BK / 16; ++kk) {
      uint32_t a[4];
      a[0] = Cvt<E>::pack(s[2 * kk][0], s[2 * kk][1]);
      a[1] = Cvt<E>::pack(s[2 * kk][2], s[2 * kk][3]);
      a[2] = Cvt<E>::pack(s[2 * kk + 1][0], s[2 * kk + 1][1]);
      a[3] = Cvt<E>::pack(s[2 * kk + 1][2], s[2 * kk + 1][3]);
#pragma unroll
      for (int dd = 0; dd < D / 16; ++dd) {
        uint32_t b0, b1, b2, b3;
        ldsm_x4_t(smem_u32(cK + swz<D>(kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8,
                                       dd * 16 + (lane >> 4) * 8)),
                  b0, b1, b2, b3);
        Mma<E>::run(acc[2 * dd], a, b0, b1);
        Mma<E>::run(acc[2 * dd + 1], a, b2, b3);
      }
    }
    __syncthreads();
  }
  cp_async_wait<0>();

  E* dqb = static_cast<E*>(p.dq) + b * p.q_bs + n * p.q_hs;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = r_glob0 + r * 8;
    if (row >= p.T) continue;
    E* drow = dqb + static_cast<int64_t>(row) * p.q_ss;
#pragma unroll
    for (int dt = 0; dt < D / 8; ++dt) {
      *reinterpret_cast<uint32_t*>(drow + dt * 8 + tg * 2) =
          Cvt<E>::pack(acc[dt][2 * r] * p.scale, acc[dt][2 * r + 1] * p.scale);
    }
  }
}

template <class E, int D, int NW, int BK>
cudaError_t launch(const KParams& p, cudaStream_t stream) {
  constexpr int BQ = NW * 16;
  constexpr int kSmem = (2 * BQ * D + 4 * BK * D) * 2;
  dim3 grid((p.T + BQ - 1) / BQ, p.N, p.B);
  return launch_with_smem(dq_tc_kernel<E, D, NW, BK>, grid, NW * 32, kSmem, stream, p);
}

template <class E>
cudaError_t launch_d(const KParams& p, cudaStream_t stream) {
  switch (p.D) {
    case 64: return launch<E, 64, 4, 64>(p, stream);
    case 128: return launch<E, 128, 4, 64>(p, stream);
    case 256: return launch<E, 256, 4, 32>(p, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace

cudaError_t launch_dq_tc(const KParams& p, DType dtype, cudaStream_t stream) {
  return dtype == DType::kBF16 ? launch_d<__nv_bfloat16>(p, stream)
                               : launch_d<__half>(p, stream);
}

}  // namespace fatrain::cuda
