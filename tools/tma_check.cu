// Checks the TMA primitives of cpp/cuda/tma.cuh on a Hopper GPU: a tile loaded
// by bulk tensor copies (one per 64-column block, completing on an mbarrier)
// must equal, byte for byte, the same tile loaded by load_tile_sw128 (the
// cp.async reference loader of wgmma.cuh), rows past the sequence end included
// (zeros). The operand has padded head and sequence strides, as a sliced
// [B, T, N, D] array would. Two loads reuse one mbarrier, so its phase bit
// is exercised as a pipeline would.
//   nvcc -std=c++17 -gencode=arch=compute_90a,code=sm_90a -Icpp \
//     tools/tma_check.cu -o /tmp/tma_check && /tmp/tma_check
// Prints one line per case and exits non-zero if any is wrong.
#include <cstdio>
#include <vector>

#include "cuda/tma.cuh"
#include "cuda/wgmma.cuh"

using namespace fatrain::cuda;

constexpr int kRows = 64, kB = 2, kT = 300, kN = 3;

template <int D>
__global__ void check_kernel(const __grid_constant__ CUtensorMap map, const uint16_t* data,
                             int64_t seq_stride, int64_t head_stride, int64_t batch_stride,
                             int b, int n, int r0a, int r0b, unsigned* mismatches) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  const uint32_t base = (smem_u32(smem_raw) + 1023) & ~1023u;
  const uint32_t s_tma = base, s_ref = base + kRows * D * 2, bar = s_ref + kRows * D * 2;
  const uint8_t* p_tma = smem_raw + (s_tma - smem_u32(smem_raw));
  const uint8_t* p_ref = smem_raw + (s_ref - smem_u32(smem_raw));
  const int tid = threadIdx.x;
  if (tid == 0) {
    mbar_init(bar, 1);
    fence_mbar_init();
  }
  __syncthreads();
  const uint16_t* head = data + b * batch_stride + n * head_stride;
  const int starts[2] = {r0a, r0b};
  for (int phase = 0; phase < 2; ++phase) {
    const int r0 = starts[phase];
    if (tid == 0) {
      mbar_arrive_expect_tx(bar, kRows * D * 2);
      for (int cb = 0; cb < D / 64; ++cb)
        tma_load_4d(s_tma + cb * kRows * 128, &map, bar, 64 * cb, r0, n, b);
    }
    load_tile_sw128<kRows, D, 128>(s_ref, head, seq_stride, r0, kT, tid);
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();
    mbar_wait(bar, phase);
    unsigned bad = 0;
    for (int i = tid; i < kRows * D * 2; i += blockDim.x) bad += p_tma[i] != p_ref[i];
    if (bad) atomicAdd(mismatches + phase, bad);
    __syncthreads();  // both buffers are reused by the next phase
  }
#endif
}

template <int D>
bool run_case(int b, int n, int r0a, int r0b) {
  const int64_t dp = D + 8;  // padded head stride: 16-byte multiple, not D
  const int64_t hs = dp, ss = kN * dp, bs = kT * ss;
  std::vector<uint16_t> host(kB * bs);
  for (size_t i = 0; i < host.size(); ++i) host[i] = static_cast<uint16_t>(i * 2654435761u >> 7);
  uint16_t* dev = nullptr;
  unsigned* mism = nullptr;
  cudaMalloc(&dev, host.size() * 2);
  cudaMalloc(&mism, 2 * sizeof(unsigned));
  cudaMemcpy(dev, host.data(), host.size() * 2, cudaMemcpyHostToDevice);
  cudaMemset(mism, 0, 2 * sizeof(unsigned));
  CUtensorMap map;
  cudaError_t e = make_seq_tensor_map(&map, dev, D, kT, kN, kB, ss, hs, bs, kRows);
  if (e != cudaSuccess) {
    std::printf("D=%d: make_seq_tensor_map failed: %s\n", D, cudaGetErrorString(e));
    return false;
  }
  const int smem = 2 * kRows * D * 2 + 8 + 1024;
  cudaFuncSetAttribute(check_kernel<D>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  check_kernel<D><<<1, 128, smem>>>(map, dev, ss, hs, bs, b, n, r0a, r0b, mism);
  e = cudaDeviceSynchronize();
  unsigned bad[2] = {0, 0};
  cudaMemcpy(bad, mism, sizeof(bad), cudaMemcpyDeviceToHost);
  cudaFree(dev);
  cudaFree(mism);
  const bool ok = e == cudaSuccess && bad[0] == 0 && bad[1] == 0;
  std::printf("D=%3d b=%d n=%d rows %3d.. then %3d..: %s (mismatched bytes %u, %u%s%s)\n", D, b,
              n, r0a, r0b, ok ? "OK" : "WRONG", bad[0], bad[1], e ? ", " : "",
              e ? cudaGetErrorString(e) : "");
  return ok;
}

int main() {
  bool ok = true;
  ok &= run_case<64>(0, 0, 0, 64);
  ok &= run_case<128>(1, 2, 64, 256);   // the second tile runs past T = 300
  ok &= run_case<256>(1, 1, 256, 128);
  return ok ? 0 : 1;
}
