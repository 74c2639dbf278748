// Tensor-core FlashAttention-2 forward (mma.sync m16n8k16, ldmatrix, cp.async).
//
// Grid (ceil(T / BQ), N, B); NW warps, each owning MR * 16 query rows of the
// block with the whole head_dim of O in registers. K/V tiles of BK keys are double
// buffered through cp.async. Scores are scaled into base 2 in float32, the
// online softmax runs in base 2, L is written in natural log.
#include "cuda/common.cuh"
#include "cuda/launch.h"

namespace fatrain::cuda {
namespace {

// Tile shape of one forward launch. A warp owns MR * 16 query rows and keeps
// their O (MR x 16 x D, float32) in registers: with MR = 2 every K or V
// fragment read from shared memory feeds two mma instead of one, which halves
// the shared-memory traffic per mma (the limit with 16 rows per warp).
// MIN_BLOCKS asks ptxas to fit that many blocks on an SM: independent blocks
// drift apart, so one block's softmax overlaps another's matrix work.
template <int D_, int NW_, int MR_, int BK_, int MIN_BLOCKS_>
struct FwdTile {
  static constexpr int D = D_, NW = NW_, MR = MR_, BK = BK_, MIN_BLOCKS = MIN_BLOCKS_;
  static constexpr int WR = 16 * MR, BQ = NW * WR, NT = NW * 32;
  static constexpr int kSmemBytes = (BQ * D + 4 * BK * D) * 2;  // Q + 2 stages of K, V
};

template <class E, class Tile>
__global__ void __launch_bounds__(Tile::NT, Tile::MIN_BLOCKS) fwd_tc_kernel(const KParams p) {
  constexpr int D = Tile::D, MR = Tile::MR, BK = Tile::BK;
  constexpr int WR = Tile::WR, BQ = Tile::BQ, NT = Tile::NT;
  extern __shared__ __align__(128) uint16_t smem[];
  uint16_t* sQ = smem;
  uint16_t* sK = sQ + BQ * D;
  uint16_t* sV = sK + 2 * BK * D;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int g = lane >> 2, tg = lane & 3;
  const int b = blockIdx.z, n = blockIdx.y, i0 = blockIdx.x * BQ;
  const int kvh = n / (p.N / p.K);
  HeadMask hm;
  hm.init(p, b, n, kLog2e);
  const uint16_t* qb = static_cast<const uint16_t*>(p.q) + b * p.q_bs + n * p.q_hs;
  const uint16_t* kb = static_cast<const uint16_t*>(p.k) + b * p.k_bs + kvh * p.k_hs;
  const uint16_t* vb = static_cast<const uint16_t*>(p.v) + b * p.k_bs + kvh * p.k_hs;

  int t_begin, n_tiles;
  hm.key_tiles(p, b, i0, min(i0 + BQ, p.T), BK, &t_begin, &n_tiles);

  load_tile<BQ, D, NT>(sQ, qb, p.q_ss, i0, p.T, tid);
  if (n_tiles > 0) {
    load_tile<BK, D, NT>(sK, kb, p.k_ss, t_begin * BK, p.S, tid);
    load_tile<BK, D, NT>(sV, vb, p.k_ss, t_begin * BK, p.S, tid);
  }
  cp_async_commit();

  float acc[MR][D / 8][4];
  float m[MR][2], l[MR][2];
#pragma unroll
  for (int mr = 0; mr < MR; ++mr) {
#pragma unroll
    for (int i = 0; i < D / 8; ++i) acc[mr][i][0] = acc[mr][i][1] = acc[mr][i][2] = acc[mr][i][3] = 0.f;
    m[mr][0] = m[mr][1] = -INFINITY;
    l[mr][0] = l[mr][1] = 0.f;
  }
  const int row_w = warp * WR;

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

    // S = Q Kᵀ for the warp's MR x 16 rows and the tile's BK keys.
    float s[MR][BK / 8][4];
#pragma unroll
    for (int mr = 0; mr < MR; ++mr)
#pragma unroll
      for (int i = 0; i < BK / 8; ++i) s[mr][i][0] = s[mr][i][1] = s[mr][i][2] = s[mr][i][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      uint32_t a[MR][4];
#pragma unroll
      for (int mr = 0; mr < MR; ++mr)
        ldsm_x4(smem_u32(sQ + swz<D>(row_w + mr * 16 + (lane & 15), kk * 16 + (lane >> 4) * 8)),
                a[mr][0], a[mr][1], a[mr][2], a[mr][3]);
#pragma unroll
      for (int np = 0; np < BK / 16; ++np) {
        uint32_t b0, b1, b2, b3;
        ldsm_x4(smem_u32(cK + swz<D>(np * 16 + (lane & 7) + (lane >> 4) * 8,
                                     kk * 16 + ((lane >> 3) & 1) * 8)),
                b0, b1, b2, b3);
#pragma unroll
        for (int mr = 0; mr < MR; ++mr) {
          Mma<E>::run(s[mr][2 * np], a[mr], b0, b1);
          Mma<E>::run(s[mr][2 * np + 1], a[mr], b2, b3);
        }
      }
    }

    // Online softmax in base 2 (rows g and g + 8 of each 16-row fragment).
#pragma unroll
    for (int mr = 0; mr < MR; ++mr) {
      const int r_glob0 = i0 + row_w + mr * 16 + g;
      const bool full = hm.tile_is_full(r_glob0 - g, r_glob0 - g + 16, j0, j0 + BK);
#pragma unroll
      for (int nt = 0; nt < BK / 8; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          float x = s[mr][nt][e] * p.scale_log2;
          if (!full) x = hm.apply(r_glob0 + (e >> 1) * 8, j0 + nt * 8 + tg * 2 + (e & 1), x);
          s[mr][nt][e] = x;
        }
      }
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        float mx = -INFINITY;
#pragma unroll
        for (int nt = 0; nt < BK / 8; ++nt)
          mx = fmaxf(mx, fmaxf(s[mr][nt][2 * r], s[mr][nt][2 * r + 1]));
        mx = quad_max(mx);
        const float m_new = fmaxf(m[mr][r], mx);
        const float m_use = m_new == -INFINITY ? 0.f : m_new;
        const float alpha = exp2_fast(m[mr][r] - m_use);
        m[mr][r] = m_new;
        float sum = 0.f;
#pragma unroll
        for (int nt = 0; nt < BK / 8; ++nt) {
          s[mr][nt][2 * r] = exp2_fast(s[mr][nt][2 * r] - m_use);
          s[mr][nt][2 * r + 1] = exp2_fast(s[mr][nt][2 * r + 1] - m_use);
          sum += s[mr][nt][2 * r] + s[mr][nt][2 * r + 1];
        }
        l[mr][r] = l[mr][r] * alpha + sum;
#pragma unroll
        for (int dt = 0; dt < D / 8; ++dt) {
          acc[mr][dt][2 * r] *= alpha;
          acc[mr][dt][2 * r + 1] *= alpha;
        }
      }
    }

    // O += P V, P straight from the score registers.
#pragma unroll
    for (int kk = 0; kk < BK / 16; ++kk) {
      uint32_t a[MR][4];
#pragma unroll
      for (int mr = 0; mr < MR; ++mr) {
        a[mr][0] = Cvt<E>::pack(s[mr][2 * kk][0], s[mr][2 * kk][1]);
        a[mr][1] = Cvt<E>::pack(s[mr][2 * kk][2], s[mr][2 * kk][3]);
        a[mr][2] = Cvt<E>::pack(s[mr][2 * kk + 1][0], s[mr][2 * kk + 1][1]);
        a[mr][3] = Cvt<E>::pack(s[mr][2 * kk + 1][2], s[mr][2 * kk + 1][3]);
      }
#pragma unroll
      for (int dp = 0; dp < D / 16; ++dp) {
        uint32_t b0, b1, b2, b3;
        ldsm_x4_t(smem_u32(cV + swz<D>(kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8,
                                       dp * 16 + (lane >> 4) * 8)),
                  b0, b1, b2, b3);
#pragma unroll
        for (int mr = 0; mr < MR; ++mr) {
          Mma<E>::run(acc[mr][2 * dp], a[mr], b0, b1);
          Mma<E>::run(acc[mr][2 * dp + 1], a[mr], b2, b3);
        }
      }
    }
    __syncthreads();
  }
  cp_async_wait<0>();

  E* ob = static_cast<E*>(p.out) + b * p.q_bs + n * p.q_hs;
#pragma unroll
  for (int mr = 0; mr < MR; ++mr) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const float lt = quad_sum(l[mr][r]);
      const int row = i0 + row_w + mr * 16 + g + r * 8;
      if (row >= p.T) continue;
      const RowEnd end = finish_row(m[mr][r], lt);
      E* orow = ob + static_cast<int64_t>(row) * p.q_ss;
#pragma unroll
      for (int dt = 0; dt < D / 8; ++dt) {
        *reinterpret_cast<uint32_t*>(orow + dt * 8 + tg * 2) =
            Cvt<E>::pack(acc[mr][dt][2 * r] * end.inv_l, acc[mr][dt][2 * r + 1] * end.inv_l);
      }
      if (tg == 0) {
        p.lse[(static_cast<int64_t>(b) * p.N + n) * p.T + row] = end.lse;
      }
    }
  }
}

template <class E, class Tile>
cudaError_t launch(const KParams& p, cudaStream_t stream) {
  dim3 grid((p.T + Tile::BQ - 1) / Tile::BQ, p.N, p.B);
  return launch_with_smem(fwd_tc_kernel<E, Tile>, grid, Tile::NT, Tile::kSmemBytes, stream, p);
}

// The tile of each head dim: the fastest of the shapes measured on an H200
// (docs/cuda.md). More resident warps beat larger warp tiles (MR = 2 was
// slower at every head dim): the kernel is latency bound.
template <class E>
cudaError_t launch_d(const KParams& p, cudaStream_t stream) {
  switch (p.D) {
    case 64: return launch<E, FwdTile<64, 4, 1, 64, 4>>(p, stream);
    case 128: return launch<E, FwdTile<128, 8, 1, 64, 2>>(p, stream);
    case 256: return launch<E, FwdTile<256, 8, 1, 32, 1>>(p, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace

cudaError_t launch_fwd_tc(const KParams& p, DType dtype, cudaStream_t stream) {
  return dtype == DType::kBF16 ? launch_d<__nv_bfloat16>(p, stream)
                               : launch_d<__half>(p, stream);
}

}  // namespace fatrain::cuda
