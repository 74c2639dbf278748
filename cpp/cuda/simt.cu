// The float32 SIMT path: any dtype (f32/bf16/f16) and any head_dim <= 256.
// One warp per row (query row, key row or bias element); lanes split head_dim
// and dot products are warp reductions. Exact to float32 rounding, slow: it
// serves float32 inputs, untuned head dims and the bias gradient.
// Also the D = rowsum(dO ∘ O) pre-kernel, shared with the tensor-core path.
#include "cuda/common.cuh"
#include "cuda/launch.h"

namespace fatrain::cuda {
namespace {

constexpr int kPer = 8;  // head_dim / 32, rounded up
constexpr int kWarps = 4;

template <class E>
__device__ __forceinline__ void load_row(float* out, const E* row, int D, int lane) {
#pragma unroll
  for (int e = 0; e < kPer; ++e) {
    const int d = lane + 32 * e;
    out[e] = d < D ? Cvt<E>::to_f(row[d]) : 0.f;
  }
}
__device__ __forceinline__ float dot(const float* a, const float* b) {
  float s = 0.f;
#pragma unroll
  for (int e = 0; e < kPer; ++e) s = fmaf(a[e], b[e], s);
  return warp_sum(s);
}
__device__ __forceinline__ int64_t row_id() {
  return static_cast<int64_t>(blockIdx.x) * kWarps + (threadIdx.x >> 5);
}

// Grid (ceil(T / kWarps), N, B): one warp per query row, its (b, n, i) from
// the block's coordinates. (Splitting a flat 64-bit row index instead took
// three 64-bit divisions per row and made this memory-bound pass three
// times slower than its reads.)
template <class E>
__global__ void __launch_bounds__(kWarps * 32) dsum_kernel(const KParams p) {
  const int i = blockIdx.x * kWarps + (threadIdx.x >> 5), n = blockIdx.y, b = blockIdx.z;
  if (i >= p.T) return;
  const int lane = threadIdx.x & 31;
  const int64_t off = b * p.q_bs + n * p.q_hs + i * p.q_ss;
  const E* o = static_cast<const E*>(p.o) + off;
  const E* d_o = static_cast<const E*>(p.d_o) + off;
  float s = 0.f;
  for (int d = lane; d < p.D; d += 32) s += Cvt<E>::to_f(o[d]) * Cvt<E>::to_f(d_o[d]);
  s = warp_sum(s);
  if (lane == 0) p.dsum[(static_cast<int64_t>(b) * p.N + n) * p.T + i] = s;
}

template <class E>
__global__ void __launch_bounds__(kWarps * 32) fwd_kernel(const KParams p) {
  const int64_t row = row_id();
  if (row >= static_cast<int64_t>(p.B) * p.N * p.T) return;
  const int lane = threadIdx.x & 31;
  const int i = row % p.T, n = (row / p.T) % p.N, b = row / (static_cast<int64_t>(p.T) * p.N);
  const int kvh = n / (p.N / p.K);
  HeadMask hm;
  hm.init(p, b, n, kLog2e);
  float q[kPer], o[kPer], kr[kPer];
  load_row(q, static_cast<const E*>(p.q) + b * p.q_bs + n * p.q_hs + i * p.q_ss, p.D, lane);
#pragma unroll
  for (int e = 0; e < kPer; ++e) o[e] = 0.f;
  float m = -INFINITY, l = 0.f;
  int lo, hi;
  hm.key_range(i, i + 1, &lo, &hi);
  if (i >= hm.q_end) hi = lo;
  const E* kb = static_cast<const E*>(p.k) + b * p.k_bs + kvh * p.k_hs;
  const E* vb = static_cast<const E*>(p.v) + b * p.k_bs + kvh * p.k_hs;
  for (int j = lo; j < hi; ++j) {
    if (!hm.visible(i, j)) continue;
    load_row(kr, kb + static_cast<int64_t>(j) * p.k_ss, p.D, lane);
    const float x = hm.apply(i, j, dot(q, kr) * p.scale_log2);
    if (x == -INFINITY) continue;
    const float m_new = fmaxf(m, x);
    const float alpha = exp2f(m - m_new);
    const float pj = exp2f(x - m_new);
    l = l * alpha + pj;
    load_row(kr, vb + static_cast<int64_t>(j) * p.k_ss, p.D, lane);
#pragma unroll
    for (int e = 0; e < kPer; ++e) o[e] = o[e] * alpha + pj * kr[e];
    m = m_new;
  }
  const RowEnd end = finish_row(m, l);
  E* out = static_cast<E*>(p.out) + b * p.q_bs + n * p.q_hs + i * p.q_ss;
#pragma unroll
  for (int e = 0; e < kPer; ++e) {
    const int d = lane + 32 * e;
    if (d < p.D) out[d] = Cvt<E>::from_f(o[e] * end.inv_l);
  }
  if (lane == 0) p.lse[row] = end.lse;
}

// dS for one (b, n, i, j) given the loaded rows; 0 where invisible.
struct RowGrad {
  float p, ds;
};
__device__ __forceinline__ RowGrad row_grad(const KParams& p, const HeadMask& hm, int i, int j,
                                            const float* q, const float* k, const float* d_o,
                                            const float* v, float L2, float Ds) {
  const float x = hm.apply(i, j, dot(q, k) * p.scale_log2);
  const float pv = exp2f(x - L2);
  const float dp = dot(d_o, v);
  return {pv, pv * (dp - Ds)};
}

__device__ __forceinline__ float lse2(const KParams& p, int64_t idx) {
  const float lv = p.lse[idx];
  return lv == -INFINITY ? INFINITY : lv * kLog2e;
}

// dK, dV: one warp per key row (b, kv head, j), looping over the GQA group.
template <class E>
__global__ void __launch_bounds__(kWarps * 32) dkdv_kernel(const KParams p) {
  const int64_t row = row_id();
  if (row >= static_cast<int64_t>(p.B) * p.K * p.S) return;
  const int lane = threadIdx.x & 31;
  const int j = row % p.S, kvh = (row / p.S) % p.K, b = row / (static_cast<int64_t>(p.S) * p.K);
  const int G = p.N / p.K;
  const int64_t koff = b * p.k_bs + kvh * p.k_hs + static_cast<int64_t>(j) * p.k_ss;
  float k[kPer], v[kPer], q[kPer], d_o[kPer], dk[kPer], dv[kPer];
  load_row(k, static_cast<const E*>(p.k) + koff, p.D, lane);
  load_row(v, static_cast<const E*>(p.v) + koff, p.D, lane);
#pragma unroll
  for (int e = 0; e < kPer; ++e) dk[e] = dv[e] = 0.f;
  for (int h = kvh * G; h < (kvh + 1) * G; ++h) {
    HeadMask hm;
    hm.init(p, b, h, kLog2e);
    int lo, hi;
    hm.query_range(j, j + 1, &lo, &hi);
    if (j >= hm.kv_end) hi = lo;
    for (int i = lo; i < hi; ++i) {
      if (!hm.visible(i, j)) continue;
      const int64_t qoff = b * p.q_bs + h * p.q_hs + static_cast<int64_t>(i) * p.q_ss;
      load_row(q, static_cast<const E*>(p.q) + qoff, p.D, lane);
      load_row(d_o, static_cast<const E*>(p.d_o) + qoff, p.D, lane);
      const int64_t r = (static_cast<int64_t>(b) * p.N + h) * p.T + i;
      const RowGrad gr = row_grad(p, hm, i, j, q, k, d_o, v, lse2(p, r), p.dsum[r]);
#pragma unroll
      for (int e = 0; e < kPer; ++e) {
        dv[e] = fmaf(gr.p, d_o[e], dv[e]);
        dk[e] = fmaf(gr.ds, q[e], dk[e]);
      }
    }
  }
  E* dkr = static_cast<E*>(p.dk) + koff;
  E* dvr = static_cast<E*>(p.dv) + koff;
#pragma unroll
  for (int e = 0; e < kPer; ++e) {
    const int d = lane + 32 * e;
    if (d < p.D) {
      dkr[d] = Cvt<E>::from_f(dk[e] * p.scale);
      dvr[d] = Cvt<E>::from_f(dv[e]);
    }
  }
}

// dQ: one warp per query row.
template <class E>
__global__ void __launch_bounds__(kWarps * 32) dq_kernel(const KParams p) {
  const int64_t row = row_id();
  if (row >= static_cast<int64_t>(p.B) * p.N * p.T) return;
  const int lane = threadIdx.x & 31;
  const int i = row % p.T, n = (row / p.T) % p.N, b = row / (static_cast<int64_t>(p.T) * p.N);
  const int kvh = n / (p.N / p.K);
  HeadMask hm;
  hm.init(p, b, n, kLog2e);
  const int64_t qoff = b * p.q_bs + n * p.q_hs + static_cast<int64_t>(i) * p.q_ss;
  float q[kPer], d_o[kPer], k[kPer], v[kPer], dq[kPer];
  load_row(q, static_cast<const E*>(p.q) + qoff, p.D, lane);
  load_row(d_o, static_cast<const E*>(p.d_o) + qoff, p.D, lane);
#pragma unroll
  for (int e = 0; e < kPer; ++e) dq[e] = 0.f;
  const float L2 = lse2(p, row), Ds = p.dsum[row];
  int lo, hi;
  hm.key_range(i, i + 1, &lo, &hi);
  if (i >= hm.q_end) hi = lo;
  const E* kb = static_cast<const E*>(p.k) + b * p.k_bs + kvh * p.k_hs;
  const E* vb = static_cast<const E*>(p.v) + b * p.k_bs + kvh * p.k_hs;
  for (int j = lo; j < hi; ++j) {
    if (!hm.visible(i, j)) continue;
    load_row(k, kb + static_cast<int64_t>(j) * p.k_ss, p.D, lane);
    load_row(v, vb + static_cast<int64_t>(j) * p.k_ss, p.D, lane);
    const RowGrad gr = row_grad(p, hm, i, j, q, k, d_o, v, L2, Ds);
#pragma unroll
    for (int e = 0; e < kPer; ++e) dq[e] = fmaf(gr.ds, k[e], dq[e]);
  }
  E* out = static_cast<E*>(p.dq) + qoff;
#pragma unroll
  for (int e = 0; e < kPer; ++e) {
    const int d = lane + 32 * e;
    if (d < p.D) out[d] = Cvt<E>::from_f(dq[e] * p.scale);
  }
}

// dbias: one warp per element of the (possibly broadcast) bias, summing dS over
// the broadcast dims in a fixed order (deterministic).
template <class E>
__global__ void __launch_bounds__(kWarps * 32) dbias_kernel(const KParams p, int64_t count) {
  const int64_t idx = row_id();
  if (idx >= count) return;
  const int lane = threadIdx.x & 31;
  const int64_t* dims = p.bias_dims;
  int64_t rest = idx;
  const int jj = rest % dims[3]; rest /= dims[3];
  const int ii = rest % dims[2]; rest /= dims[2];
  const int nn = rest % dims[1]; rest /= dims[1];
  const int bb = static_cast<int>(rest);
  const int b_lo = dims[0] == 1 ? 0 : bb, b_hi = dims[0] == 1 ? p.B : bb + 1;
  const int n_lo = dims[1] == 1 ? 0 : nn, n_hi = dims[1] == 1 ? p.N : nn + 1;
  const int i_lo = dims[2] == 1 ? 0 : ii, i_hi = dims[2] == 1 ? p.T : ii + 1;
  const int j_lo = dims[3] == 1 ? 0 : jj, j_hi = dims[3] == 1 ? p.S : jj + 1;
  float q[kPer], d_o[kPer], k[kPer], v[kPer];
  float total = 0.f;
  for (int b = b_lo; b < b_hi; ++b) {
    for (int n = n_lo; n < n_hi; ++n) {
      const int kvh = n / (p.N / p.K);
      HeadMask hm;
      hm.init(p, b, n, kLog2e);
      for (int i = i_lo; i < i_hi; ++i) {
        const int64_t qoff = b * p.q_bs + n * p.q_hs + static_cast<int64_t>(i) * p.q_ss;
        bool loaded = false;
        const int64_t r = (static_cast<int64_t>(b) * p.N + n) * p.T + i;
        for (int j = j_lo; j < j_hi; ++j) {
          if (!hm.visible(i, j)) continue;
          if (!loaded) {
            load_row(q, static_cast<const E*>(p.q) + qoff, p.D, lane);
            load_row(d_o, static_cast<const E*>(p.d_o) + qoff, p.D, lane);
            loaded = true;
          }
          const int64_t koff = b * p.k_bs + kvh * p.k_hs + static_cast<int64_t>(j) * p.k_ss;
          load_row(k, static_cast<const E*>(p.k) + koff, p.D, lane);
          load_row(v, static_cast<const E*>(p.v) + koff, p.D, lane);
          total += row_grad(p, hm, i, j, q, k, d_o, v, lse2(p, r), p.dsum[r]).ds;
        }
      }
    }
  }
  if (lane == 0) p.dbias[idx] = total;
}

unsigned blocks_for(int64_t rows) { return static_cast<unsigned>((rows + kWarps - 1) / kWarps); }

}  // namespace

// Launches kernel<E> for the dtype on `grid` (blocks of kWarps warps);
// nothing for an empty grid.
#define FATRAIN_SIMT_LAUNCH_GRID(kernel, grid, ...)                                        \
  do {                                                                                     \
    const dim3 g = (grid);                                                                 \
    if (g.x == 0 || g.y == 0 || g.z == 0) return cudaSuccess;                              \
    switch (dtype) {                                                                       \
      case DType::kF32:                                                                    \
        kernel<float><<<g, kWarps * 32, 0, stream>>>(__VA_ARGS__);                         \
        record_launch(kernel<float>);                                                      \
        break;                                                                             \
      case DType::kBF16:                                                                   \
        kernel<__nv_bfloat16><<<g, kWarps * 32, 0, stream>>>(__VA_ARGS__);                 \
        record_launch(kernel<__nv_bfloat16>);                                              \
        break;                                                                             \
      default:                                                                             \
        kernel<__half><<<g, kWarps * 32, 0, stream>>>(__VA_ARGS__);                        \
        record_launch(kernel<__half>);                                                     \
        break;                                                                             \
    }                                                                                      \
  } while (0)
// One warp per row of `rows`.
#define FATRAIN_SIMT_LAUNCH(kernel, rows, ...) \
  FATRAIN_SIMT_LAUNCH_GRID(kernel, dim3(blocks_for(rows)), __VA_ARGS__)

cudaError_t launch_dsum(const KParams& p, DType dtype, cudaStream_t stream) {
  FATRAIN_SIMT_LAUNCH_GRID(dsum_kernel, dim3(blocks_for(p.T), p.N, p.B), p);
  return cudaGetLastError();
}

cudaError_t launch_fwd_simt(const KParams& p, DType dtype, cudaStream_t stream) {
  FATRAIN_SIMT_LAUNCH(fwd_kernel, static_cast<int64_t>(p.B) * p.N * p.T, p);
  return cudaGetLastError();
}

cudaError_t launch_bwd_simt(const KParams& p, DType dtype, cudaStream_t stream) {
  FATRAIN_SIMT_LAUNCH(dkdv_kernel, static_cast<int64_t>(p.B) * p.K * p.S, p);
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  FATRAIN_SIMT_LAUNCH(dq_kernel, static_cast<int64_t>(p.B) * p.N * p.T, p);
  return cudaGetLastError();
}

cudaError_t launch_dbias_simt(const KParams& p, DType dtype, int64_t elements,
                              cudaStream_t stream) {
  FATRAIN_SIMT_LAUNCH(dbias_kernel, elements, p, elements);
  return cudaGetLastError();
}

}  // namespace fatrain::cuda
