// The segment-id tables of packed sequences (KParams::q_seg_meet), built on
// the stream before the attention kernels that read them: first each
// granule's id range, then from those the meeting granules.
#include "cuda/common.cuh"
#include "cuda/launch.h"

namespace fatrain::cuda {
namespace {

// One thread per granule of `len` ids of each of `batch` rows: its id range.
__global__ void segment_ranges_kernel(const int32_t* ids, int len, int granules, int batch,
                                      int2* out) {
  const int idx = blockIdx.x * blockDim.x + threadIdx.x;
  if (idx >= batch * granules) return;
  const int b = idx / granules, first = (idx % granules) * kSegGranule;
  const int32_t* x = ids + static_cast<int64_t>(b) * len + first;
  const int n = min(kSegGranule, len - first);
  int lo = x[0], hi = x[0];
  for (int k = 1; k < n; ++k) {
    lo = min(lo, x[k]);
    hi = max(hi, x[k]);
  }
  out[idx] = make_int2(lo, hi);
}

// One thread per granule of one side: the first and last granule of the
// other side (same batch row) whose id range meets its own (x > y: none).
// The threads of a warp read the other side's ranges in step (broadcasts).
__global__ void segment_meet_kernel(const int2* mine, int n_mine, const int2* other,
                                    int n_other, int batch, int2* out) {
  const int idx = blockIdx.x * blockDim.x + threadIdx.x;
  if (idx >= batch * n_mine) return;
  const int2 r = mine[idx];
  const int2* o = other + static_cast<int64_t>(idx / n_mine) * n_other;
  int first = n_other, last = -1;
  for (int g = 0; g < n_other; ++g) {
    const int2 x = o[g];
    if (r.x <= x.y && x.x <= r.y) {
      first = min(first, g);
      last = g;
    }
  }
  out[idx] = make_int2(first, last);
}

int granules(int len) { return (len + kSegGranule - 1) / kSegGranule; }

}  // namespace

size_t segment_table_bytes(const AttentionProblem& pr) {
  if (pr.q_segment_ids == nullptr) return 0;
  const size_t cells = static_cast<size_t>(pr.batch) *
                       (granules(static_cast<int>(pr.q_len)) + granules(static_cast<int>(pr.kv_len)));
  return (2 * cells * sizeof(int2) + 255) & ~size_t(255);
}

cudaError_t launch_segment_tables(KParams* p, void* scratch, cudaStream_t stream) {
  const int nq = granules(p->T), nk = granules(p->S);
  int2* base = static_cast<int2*>(scratch);
  int2* q_rng = base;
  int2* kv_rng = q_rng + p->B * nq;
  int2* q_meet = kv_rng + p->B * nk;
  int2* kv_meet = q_meet + p->B * nq;
  constexpr int kThreads = 128;
  auto blocks = [](int n) { return (n + kThreads - 1) / kThreads; };
  segment_ranges_kernel<<<blocks(p->B * nq), kThreads, 0, stream>>>(p->q_seg, p->T, nq, p->B,
                                                                      q_rng);
  record_launch(segment_ranges_kernel);
  segment_ranges_kernel<<<blocks(p->B * nk), kThreads, 0, stream>>>(p->kv_seg, p->S, nk, p->B,
                                                                      kv_rng);
  record_launch(segment_ranges_kernel);
  segment_meet_kernel<<<blocks(p->B * nq), kThreads, 0, stream>>>(q_rng, nq, kv_rng, nk, p->B,
                                                                    q_meet);
  record_launch(segment_meet_kernel);
  segment_meet_kernel<<<blocks(p->B * nk), kThreads, 0, stream>>>(kv_rng, nk, q_rng, nq, p->B,
                                                                    kv_meet);
  record_launch(segment_meet_kernel);
  p->q_seg_meet = q_meet;
  p->kv_seg_meet = kv_meet;
  return cudaGetLastError();
}

}  // namespace fatrain::cuda
