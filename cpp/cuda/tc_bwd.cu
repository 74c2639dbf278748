// Tensor-core FlashAttention-2 backward, KV tiles outer.
//
// Grid (ceil(S / BK), K, B), 8 warps. A block owns BK keys of one kv head and
// keeps dK, dV for them in registers while it loops over the query heads of
// its GQA group and the query tiles that can see its keys (Q, dO, L, D double
// buffered). Per query tile:
//   1. Sᵀ = K Qᵀ and dPᵀ = V dOᵀ (warp: 16 keys x 32 queries); P = exp2(S - L),
//      dS = P (dP - D); P and dS go to shared memory as 16-bit.
//   2. dV += Pᵀ dO, dK += dSᵀ Q (warp: 16 keys x D/2).
//   3. (atomic mode) dQ += dS K (warp: 16 queries x D/2) by float32 atomics
//      into scratch; the deterministic mode leaves dQ to tc_dq.cu.
#include <algorithm>
#include <cstdint>

#include "cuda/common.cuh"
#include "cuda/launch.h"

namespace fatrain::cuda {
namespace {

constexpr int kBK = 64, kBQ = 64, kNW = 8, kNT = kNW * 32;

template <int D>
constexpr int bwd_smem_bytes() {
  return (2 * kBK * D + 4 * kBQ * D + 2 * kBK * kBQ) * 2 + 4 * kBQ * 4;
}

template <class E, int D, bool ATOMIC, int MIN_BLOCKS>
__global__ void __launch_bounds__(kNT, MIN_BLOCKS) bwd_tc_kernel(const KParams p) {
  constexpr int BK = kBK, BQ = kBQ, NT = kNT, DH = D / 2;
  extern __shared__ __align__(128) uint16_t smem[];
  uint16_t* sK = smem;
  uint16_t* sV = sK + BK * D;
  uint16_t* sQ = sV + BK * D;       // 2 stages
  uint16_t* sdO = sQ + 2 * BQ * D;  // 2 stages
  uint16_t* sP = sdO + 2 * BQ * D;
  uint16_t* sdS = sP + BK * BQ;
  float* sL = reinterpret_cast<float*>(sdS + BK * BQ);  // 2 stages
  float* sDs = sL + 2 * BQ;                             // 2 stages

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int g = lane >> 2, tg = lane & 3;
  const int b = blockIdx.z, kvh = blockIdx.y, j0 = blockIdx.x * BK;
  const int G = p.N / p.K;
  const uint16_t* kb = static_cast<const uint16_t*>(p.k) + b * p.k_bs + kvh * p.k_hs;
  const uint16_t* vb = static_cast<const uint16_t*>(p.v) + b * p.k_bs + kvh * p.k_hs;

  HeadMask hm;
  hm.init(p, b, kvh * G, kLog2e);
  int qt_begin, nq;
  hm.query_tiles(p, b, j0, min(j0 + BK, p.S), BQ, &qt_begin, &nq);
  const int total = G * nq;

  load_tile<BK, D, NT>(sK, kb, p.k_ss, j0, p.S, tid);
  load_tile<BK, D, NT>(sV, vb, p.k_ss, j0, p.S, tid);

  auto prefetch = [&](int it, int stage) {
    const int h = kvh * G + it / nq;
    const int i0 = (qt_begin + it % nq) * BQ;
    const uint16_t* qb = static_cast<const uint16_t*>(p.q) + b * p.q_bs + h * p.q_hs;
    const uint16_t* dob = static_cast<const uint16_t*>(p.d_o) + b * p.q_bs + h * p.q_hs;
    load_tile<BQ, D, NT>(sQ + stage * BQ * D, qb, p.q_ss, i0, p.T, tid);
    load_tile<BQ, D, NT>(sdO + stage * BQ * D, dob, p.q_ss, i0, p.T, tid);
    load_row_stats(p, b, h, i0, BQ, tid, sL + stage * BQ, sDs + stage * BQ);
  };
  if (total > 0) prefetch(0, 0);
  cp_async_commit();

  float dk[DH / 8][4], dv[DH / 8][4];
#pragma unroll
  for (int i = 0; i < DH / 8; ++i) {
    dk[i][0] = dk[i][1] = dk[i][2] = dk[i][3] = 0.f;
    dv[i][0] = dv[i][1] = dv[i][2] = dv[i][3] = 0.f;
  }
  const int ks = warp & 3, qh = warp >> 2;  // phase 1: key strip, query half
  const int dh = warp >> 2;                 // phases 2/3: d half

  for (int it = 0; it < total; ++it) {
    const int h = kvh * G + it / nq;
    const int i0 = (qt_begin + it % nq) * BQ;
    if (it + 1 < total) {
      prefetch(it + 1, (it + 1) & 1);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    hm.init(p, b, h, kLog2e);
    const uint16_t* cQ = sQ + (it & 1) * BQ * D;
    const uint16_t* cdO = sdO + (it & 1) * BQ * D;
    const float* cL = sL + (it & 1) * BQ;
    const float* cDs = sDs + (it & 1) * BQ;

    // Phase 1.
    float st[4][4], dpt[4][4];
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
      for (int e = 0; e < 4; ++e) st[i][e] = dpt[i][e] = 0.f;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      uint32_t ak[4], av[4];
      const int a_off = swz<D>(ks * 16 + (lane & 15), kk * 16 + (lane >> 4) * 8);
      ldsm_x4(smem_u32(sK + a_off), ak[0], ak[1], ak[2], ak[3]);
      ldsm_x4(smem_u32(sV + a_off), av[0], av[1], av[2], av[3]);
#pragma unroll
      for (int np = 0; np < 2; ++np) {
        const int b_off = swz<D>(qh * 32 + np * 16 + (lane & 7) + (lane >> 4) * 8,
                                 kk * 16 + ((lane >> 3) & 1) * 8);
        uint32_t b0, b1, b2, b3;
        ldsm_x4(smem_u32(cQ + b_off), b0, b1, b2, b3);
        Mma<E>::run(st[2 * np], ak, b0, b1);
        Mma<E>::run(st[2 * np + 1], ak, b2, b3);
        ldsm_x4(smem_u32(cdO + b_off), b0, b1, b2, b3);
        Mma<E>::run(dpt[2 * np], av, b0, b1);
        Mma<E>::run(dpt[2 * np + 1], av, b2, b3);
      }
    }
    const bool full =
        hm.tile_is_full(i0 + qh * 32, i0 + qh * 32 + 32, j0 + ks * 16, j0 + ks * 16 + 16);
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int kl = ks * 16 + g + (e >> 1) * 8;
        const int ql = qh * 32 + nt * 8 + tg * 2 + (e & 1);
        float x = st[nt][e] * p.scale_log2;
        if (!full) x = hm.apply(i0 + ql, j0 + kl, x);
        const float pv = exp2_fast(x - cL[ql]);
        st[nt][e] = pv;
        dpt[nt][e] = pv * (dpt[nt][e] - cDs[ql]);
      }
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        const int off = swz<BQ>(ks * 16 + g + hf * 8, qh * 32 + nt * 8 + tg * 2);
        *reinterpret_cast<uint32_t*>(sP + off) = Cvt<E>::pack(st[nt][2 * hf], st[nt][2 * hf + 1]);
        *reinterpret_cast<uint32_t*>(sdS + off) =
            Cvt<E>::pack(dpt[nt][2 * hf], dpt[nt][2 * hf + 1]);
      }
    }
    __syncthreads();

    // Phase 2: dV += Pᵀ dO, dK += dSᵀ Q for keys ks*16.. and d in [dh*DH, dh*DH + DH).
#pragma unroll
    for (int kk = 0; kk < BQ / 16; ++kk) {
      uint32_t ap[4], ad[4];
      const int a_off = swz<BQ>(ks * 16 + (lane & 15), kk * 16 + (lane >> 4) * 8);
      ldsm_x4(smem_u32(sP + a_off), ap[0], ap[1], ap[2], ap[3]);
      ldsm_x4(smem_u32(sdS + a_off), ad[0], ad[1], ad[2], ad[3]);
#pragma unroll
      for (int dp = 0; dp < DH / 16; ++dp) {
        const int b_off = swz<D>(kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8,
                                 dh * DH + dp * 16 + (lane >> 4) * 8);
        uint32_t b0, b1, b2, b3;
        ldsm_x4_t(smem_u32(cdO + b_off), b0, b1, b2, b3);
        Mma<E>::run(dv[2 * dp], ap, b0, b1);
        Mma<E>::run(dv[2 * dp + 1], ap, b2, b3);
        ldsm_x4_t(smem_u32(cQ + b_off), b0, b1, b2, b3);
        Mma<E>::run(dk[2 * dp], ad, b0, b1);
        Mma<E>::run(dk[2 * dp + 1], ad, b2, b3);
      }
    }

    // Phase 3: dQ (16 queries x DH) += dS K, float32 atomics.
    if constexpr (ATOMIC) {
      const int qs = warp & 3;
      float dq[DH / 8][4];
#pragma unroll
      for (int i = 0; i < DH / 8; ++i) dq[i][0] = dq[i][1] = dq[i][2] = dq[i][3] = 0.f;
#pragma unroll
      for (int kk = 0; kk < BK / 16; ++kk) {
        const int mi = lane >> 3;
        uint32_t a[4];
        ldsm_x4_t(smem_u32(sdS + swz<BQ>(kk * 16 + (mi >> 1) * 8 + (lane & 7),
                                         qs * 16 + (mi & 1) * 8)),
                  a[0], a[1], a[2], a[3]);
#pragma unroll
        for (int dp = 0; dp < DH / 16; ++dp) {
          uint32_t b0, b1, b2, b3;
          ldsm_x4_t(smem_u32(sK + swz<D>(kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8,
                                         dh * DH + dp * 16 + (lane >> 4) * 8)),
                    b0, b1, b2, b3);
          Mma<E>::run(dq[2 * dp], a, b0, b1);
          Mma<E>::run(dq[2 * dp + 1], a, b2, b3);
        }
      }
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int i = i0 + qs * 16 + g + r * 8;
        if (i >= p.T) continue;
        float* dst = p.dq_acc + ((static_cast<int64_t>(b) * p.N + h) * p.T + i) * D + dh * DH;
#pragma unroll
        for (int nt = 0; nt < DH / 8; ++nt) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
          atomicAdd(reinterpret_cast<float2*>(dst + nt * 8 + tg * 2),
                    make_float2(dq[nt][2 * r], dq[nt][2 * r + 1]));
#else
          atomicAdd(dst + nt * 8 + tg * 2, dq[nt][2 * r]);
          atomicAdd(dst + nt * 8 + tg * 2 + 1, dq[nt][2 * r + 1]);
#endif
        }
      }
    }
    __syncthreads();
  }
  cp_async_wait<0>();

  E* dkb = static_cast<E*>(p.dk) + b * p.k_bs + kvh * p.k_hs;
  E* dvb = static_cast<E*>(p.dv) + b * p.k_bs + kvh * p.k_hs;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int j = j0 + ks * 16 + g + r * 8;
    if (j >= p.S) continue;
    E* dkr = dkb + static_cast<int64_t>(j) * p.k_ss + dh * DH;
    E* dvr = dvb + static_cast<int64_t>(j) * p.k_ss + dh * DH;
#pragma unroll
    for (int nt = 0; nt < DH / 8; ++nt) {
      *reinterpret_cast<uint32_t*>(dkr + nt * 8 + tg * 2) =
          Cvt<E>::pack(dk[nt][2 * r] * p.scale, dk[nt][2 * r + 1] * p.scale);
      *reinterpret_cast<uint32_t*>(dvr + nt * 8 + tg * 2) =
          Cvt<E>::pack(dv[nt][2 * r], dv[nt][2 * r + 1]);
    }
  }
}

// dQ = scale * dq_acc, rounded to E: dq_acc is float32 [B, N, T, D], dQ
// has Q's strides. Block (x, n, b) walks rows i of head n of batch b, four
// columns per thread: a float4 load and one 8-byte store. The row's
// coordinates come from 32-bit divisions within one head (T * D fits), not
// from a flat 64-bit index split per element, which made this conversion
// several times slower (docs/cuda.md).
template <class E>
__global__ void dq_convert_kernel(const KParams p) {
  const int per_row = p.D / 4, n = blockIdx.y, b = blockIdx.z;
  const int count = p.T * per_row;
  const float* acc = p.dq_acc + (static_cast<int64_t>(b) * p.N + n) * p.T * p.D;
  E* dq = static_cast<E*>(p.dq) + static_cast<int64_t>(b) * p.q_bs +
          static_cast<int64_t>(n) * p.q_hs;
  for (int x = blockIdx.x * blockDim.x + threadIdx.x; x < count; x += gridDim.x * blockDim.x) {
    const int i = x / per_row, d = (x - i * per_row) * 4;
    const float4 a = *reinterpret_cast<const float4*>(acc + static_cast<int64_t>(i) * p.D + d);
    *reinterpret_cast<uint2*>(dq + static_cast<int64_t>(i) * p.q_ss + d) =
        make_uint2(Cvt<E>::pack(a.x * p.scale, a.y * p.scale),
                   Cvt<E>::pack(a.z * p.scale, a.w * p.scale));
  }
}

// MIN_BLOCKS = 2 caps registers so that two blocks share an SM (their
// barriers then no longer stall the whole SM at once); it fits in shared
// memory up to D = 128.
template <class E, int D, bool ATOMIC, int MIN_BLOCKS>
cudaError_t launch(const KParams& p, cudaStream_t stream) {
  constexpr int kSmem = bwd_smem_bytes<D>();
  dim3 grid((p.S + kBK - 1) / kBK, p.K, p.B);
  return launch_with_smem(bwd_tc_kernel<E, D, ATOMIC, MIN_BLOCKS>, grid, kNT, kSmem, stream, p);
}

// Two blocks per SM at D = 64 and 128 (their registers capped to fit): 1.2x
// faster forward+backward on an H200 than one block with uncapped registers.
// At D = 256 one block fills the shared memory.
template <class E, bool ATOMIC>
cudaError_t launch_d(const KParams& p, cudaStream_t stream) {
  switch (p.D) {
    case 64: return launch<E, 64, ATOMIC, 2>(p, stream);
    case 128: return launch<E, 128, ATOMIC, 2>(p, stream);
    case 256: return launch<E, 256, ATOMIC, 1>(p, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace

cudaError_t launch_bwd_tc(const KParams& p, DType dtype, bool atomic_dq, cudaStream_t stream) {
  if (dtype == DType::kBF16) {
    return atomic_dq ? launch_d<__nv_bfloat16, true>(p, stream)
                     : launch_d<__nv_bfloat16, false>(p, stream);
  }
  return atomic_dq ? launch_d<__half, true>(p, stream) : launch_d<__half, false>(p, stream);
}

namespace {

template <class E>
cudaError_t launch_dq_convert_e(const KParams& p, cudaStream_t stream) {
  // Whole 4-column groups, 8-byte aligned in dQ (dq_acc is 256-byte
  // aligned). Always so for the head dims of the tensor-core kernels (64,
  // 128, 256) and XLA's dense buffers; otherwise the caller falls back to
  // the SIMT backward, which computes dQ itself.
  if (p.D % 4 != 0 || p.q_ss % 4 != 0 || p.q_hs % 4 != 0 || p.q_bs % 4 != 0 ||
      reinterpret_cast<uintptr_t>(p.dq) % 8 != 0)
    return cudaErrorNotSupported;
  // About 132 SMs x 16 blocks of 256 threads over all heads, at least one
  // block per head.
  const int per_head = p.T * (p.D / 4);
  const int64_t heads = static_cast<int64_t>(p.B) * p.N;
  const int x = static_cast<int>(std::clamp<int64_t>(132 * 16 / heads, 1, (per_head + 255) / 256));
  dq_convert_kernel<E><<<dim3(x, p.N, p.B), 256, 0, stream>>>(p);
  record_launch(dq_convert_kernel<E>);
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_dq_convert(const KParams& p, DType dtype, cudaStream_t stream) {
  return dtype == DType::kBF16 ? launch_dq_convert_e<__nv_bfloat16>(p, stream)
                               : launch_dq_convert_e<__half>(p, stream);
}

}  // namespace fatrain::cuda
