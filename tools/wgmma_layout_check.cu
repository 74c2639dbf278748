// Checks the wgmma operand layouts of cpp/cuda/wgmma.cuh on a Hopper GPU,
// one product per layout the kernels use, against a host reference:
//   nvcc -std=c++17 -gencode=arch=compute_90a,code=sm_90a -Icpp \
//     tools/wgmma_layout_check.cu -o /tmp/wgmma_check && /tmp/wgmma_check
// Prints one line per case and exits non-zero if any is wrong. A kernel bug in
// hopper_*.cu is much easier to find once these pass.
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "cuda/wgmma.cuh"

using namespace fatrain::cuda;
using E = __nv_bfloat16;

// Case 1: C[64][64] = A[64][128] Bᵀ, A and B K-major ([rows][K] tiles).
// Case 2: C[64][128] = P[64][64] V[64][128], P from registers (read in
//         accumulator layout), V MN-major ([K][N] tile, two column blocks).
// Case 3: C[64][64] = Aᵀ B with A stored [K=128][M=64] (MN-major A) and B
//         stored [K=128][N=64] (MN-major B).
// Case 4: C[64][32] = Aᵀ B[:, 32:64], B MN-major from column 32 of a block.
// `swap` exchanges the two offsets of the MN-major descriptors.
__global__ void check_kernel(const uint16_t* a, const uint16_t* b, float* c, int which,
                             int swap) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ __align__(1024) uint8_t smem[];
  const uint32_t sa = smem_u32(smem), sb = sa + 32768;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  auto mn_desc = [&](uint32_t tile, int rows, int col0, int kk) {
    const uint32_t addr = tile + (col0 >> 6) * (rows * 128) + (col0 & 63) * 2 + kk * 2048;
    return swap ? sw128_desc(addr, 1024, rows * 128) : sw128_desc(addr, rows * 128, 1024);
  };
  if (which == 1) {
    load_tile_sw128<64, 128, 128>(sa, a, 128, 0, 64, tid);
    load_tile_sw128<64, 128, 128>(sb, b, 128, 0, 64, tid);
    cp_async_commit(); cp_async_wait<0>(); fence_proxy_async(); __syncthreads();
    float d[32];
    for (int i = 0; i < 32; ++i) d[i] = 0.f;
    fence_regs(d); wgmma_fence();
    for (int kk = 0; kk < 8; ++kk)
      Wgmma<E, 64>::ss<0, 0>(d, desc_k_major<64>(sa, 0, kk), desc_k_major<64>(sb, 0, kk), 1);
    wgmma_commit(); wgmma_wait<0>(); fence_regs(d);
    for (int j = 0; j < 8; ++j)
      for (int e = 0; e < 4; ++e) c[acc_row(warp, lane, e) * 64 + acc_col(j, lane, e)] = d[4 * j + e];
  } else if (which == 2) {
    load_tile_sw128<64, 128, 128>(sb, b, 128, 0, 64, tid);
    cp_async_commit(); cp_async_wait<0>(); fence_proxy_async(); __syncthreads();
    float p[32];  // P[64][64] in accumulator layout
    for (int j = 0; j < 8; ++j)
      for (int e = 0; e < 4; ++e)
        p[4 * j + e] = __bfloat162float(
            reinterpret_cast<const E*>(a)[acc_row(warp, lane, e) * 64 + acc_col(j, lane, e)]);
    float d[64];
    for (int i = 0; i < 64; ++i) d[i] = 0.f;
    fence_regs(d); wgmma_fence();
    for (int kk = 0; kk < 4; ++kk) {
      uint32_t af[4];
      acc_to_a<E>(p, kk, af);
      const uint64_t db = swap ? mn_desc(sb, 64, 0, kk) : desc_mn_major<64>(sb, 0, kk);
      Wgmma<E, 128>::rs<1>(d, af, db, 1);
    }
    wgmma_commit(); wgmma_wait<0>(); fence_regs(d);
    for (int j = 0; j < 16; ++j)
      for (int e = 0; e < 4; ++e)
        c[acc_row(warp, lane, e) * 128 + acc_col(j, lane, e)] = d[4 * j + e];
  } else {
    load_tile_sw128<128, 64, 128>(sa, a, 64, 0, 128, tid);
    load_tile_sw128<128, 64, 128>(sb, b, 64, 0, 128, tid);
    cp_async_commit(); cp_async_wait<0>(); fence_proxy_async(); __syncthreads();
    if (which == 3) {
      float d[32];
      for (int i = 0; i < 32; ++i) d[i] = 0.f;
      fence_regs(d); wgmma_fence();
      for (int kk = 0; kk < 8; ++kk) {
        const uint64_t da = swap ? mn_desc(sa, 128, 0, kk) : desc_mn_major<128>(sa, 0, kk);
        const uint64_t db = swap ? mn_desc(sb, 128, 0, kk) : desc_mn_major<128>(sb, 0, kk);
        Wgmma<E, 64>::ss<1, 1>(d, da, db, 1);
      }
      wgmma_commit(); wgmma_wait<0>(); fence_regs(d);
      for (int j = 0; j < 8; ++j)
        for (int e = 0; e < 4; ++e)
          c[acc_row(warp, lane, e) * 64 + acc_col(j, lane, e)] = d[4 * j + e];
    } else {
      float d[16];
      for (int i = 0; i < 16; ++i) d[i] = 0.f;
      fence_regs(d); wgmma_fence();
      for (int kk = 0; kk < 8; ++kk) {
        const uint64_t da = swap ? mn_desc(sa, 128, 0, kk) : desc_mn_major<128>(sa, 0, kk);
        const uint64_t db = swap ? mn_desc(sb, 128, 32, kk) : desc_mn_major<128>(sb, 32, kk);
        Wgmma<E, 32>::ss<1, 1>(d, da, db, 1);
      }
      wgmma_commit(); wgmma_wait<0>(); fence_regs(d);
      for (int j = 0; j < 4; ++j)
        for (int e = 0; e < 4; ++e)
          c[acc_row(warp, lane, e) * 32 + acc_col(j, lane, e)] = d[4 * j + e];
    }
  }
#endif
}

static float bf(uint16_t x) {
  uint32_t u = static_cast<uint32_t>(x) << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

int main() {
  const int n = 128 * 128;
  std::vector<uint16_t> ha(n), hb(n);
  srand(1);
  for (int i = 0; i < n; ++i) {
    ha[i] = 0x3f80 + (rand() % 256) - 128;  // bf16 values around [0.5, 2)
    hb[i] = (rand() % 2 ? 0xbf80 : 0x3f80) + (rand() % 128) - 64;
  }
  uint16_t *da, *db;
  float* dc;
  cudaMalloc(&da, n * 2); cudaMalloc(&db, n * 2); cudaMalloc(&dc, n * 4);
  cudaMemcpy(da, ha.data(), n * 2, cudaMemcpyHostToDevice);
  cudaMemcpy(db, hb.data(), n * 2, cudaMemcpyHostToDevice);
  cudaFuncSetAttribute(check_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, 65536);
  const char* names[] = {"", "ss K-major A, K-major B (n64)", "rs A regs, MN-major B (n128)",
                         "ss MN-major A, MN-major B (n64)", "ss MN-major A, MN-major B col 32 (n32)"};
  int bad = 0;
  for (int which = 1; which <= 4; ++which) {
    for (int swap = 0; swap < (which == 1 ? 1 : 2); ++swap) {
      cudaMemset(dc, 0, n * 4);
      check_kernel<<<1, 128, 65536>>>(da, db, dc, which, swap);
      cudaError_t e = cudaDeviceSynchronize();
      std::vector<float> hc(n);
      cudaMemcpy(hc.data(), dc, n * 4, cudaMemcpyDeviceToHost);
      const int M = 64, N = which == 2 ? 128 : which == 4 ? 32 : 64, K = which == 2 ? 64 : 128;
      double worst = 0;
      for (int i = 0; i < M; ++i)
        for (int j = 0; j < N; ++j) {
          double ref = 0;
          for (int k = 0; k < K; ++k) {
            float x, y;
            if (which == 1) { x = bf(ha[i * 128 + k]); y = bf(hb[j * 128 + k]); }
            else if (which == 2) {
              x = bf(ha[i * 64 + k]); y = bf(hb[k * 128 + j]);
            } else { x = bf(ha[k * 64 + i]); y = bf(hb[k * 64 + j + (which == 4 ? 32 : 0)]); }
            ref += static_cast<double>(x) * y;
          }
          const double err = fabs(hc[i * N + j] - ref) / (1.0 + fabs(ref));
          if (err > worst) worst = err;
        }
      const bool ok = e == cudaSuccess && worst < 1e-3;
      if (!ok && swap == 0) ++bad;
      printf("%-45s %s: %s (cuda: %s, worst rel err %.2e)\n", names[which],
             swap ? "offsets swapped" : "as in wgmma.cuh", ok ? "OK" : "WRONG",
             cudaGetErrorString(e), worst);
      if (e != cudaSuccess) return 2;
    }
  }
  return bad ? 1 : 0;
}
