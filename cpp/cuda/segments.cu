// The segment-id tables of packed sequences (KParams::q_seg_meet and
// q_seg_runs), built on the stream before the attention kernels that read
// them: first each granule's id range, then from those the meeting granules
// of the other side and the runs of single-id granules.
#include "cuda/common.cuh"
#include "cuda/launch.h"

namespace fatrain::cuda {
namespace {

int granules(int len) { return (len + kSegGranule - 1) / kSegGranule; }

// One side's ids ([batch, len]) cut into granules of kSegGranule.
struct SegSide {
  const int32_t* ids;
  int len, granules;
};

// One thread per granule of either side (the query side's batch * nq
// granules, then the key side's): its id range (min, max).
__global__ void segment_ranges_kernel(SegSide q, SegSide kv, int batch, int2* out) {
  const int idx = blockIdx.x * blockDim.x + threadIdx.x;
  const bool on_q = idx < batch * q.granules;
  const SegSide& side = on_q ? q : kv;
  const int local = on_q ? idx : idx - batch * q.granules;
  if (local >= batch * side.granules) return;
  const int b = local / side.granules, first = (local % side.granules) * kSegGranule;
  const int32_t* x = side.ids + static_cast<int64_t>(b) * side.len + first;
  const int n = min(kSegGranule, side.len - first);
  int lo = x[0], hi = x[0];
  for (int k = 1; k < n; ++k) {
    lo = min(lo, x[k]);
    hi = max(hi, x[k]);
  }
  out[idx] = make_int2(lo, hi);
}

static_assert(kSegRunGranules <= 32, "a warp checks a run's granules at once");

// One warp per granule of either side, from the ranges (the layout of
// segment_ranges_kernel's output): in `meet`, the first and last granule of
// the other side (same batch row) whose id range meets its own (x > y:
// none); in `runs`, its one id and the last granule of the run of granules
// from it on that hold only that id, at most kSegRunGranules long (a granule
// of several ids: y = its own index - 1). The lanes split the other side's
// granules, then reduce; lane k checks granule + k of the run.
__global__ void segment_meet_kernel(const int2* ranges, int nq, int nk, int batch, int2* meet,
                                    int2* runs) {
  const int idx = blockIdx.x * (blockDim.x / 32) + (threadIdx.x >> 5), lane = threadIdx.x & 31;
  const bool on_q = idx < batch * nq;
  const int n_mine = on_q ? nq : nk, n_other = on_q ? nk : nq;
  const int local = on_q ? idx : idx - batch * nq;
  if (local >= batch * n_mine) return;  // the whole warp
  const int b = local / n_mine, g_mine = local % n_mine;
  const int2* mine = ranges + (on_q ? 0 : batch * nq) + static_cast<int64_t>(b) * n_mine;
  const int2* other = ranges + (on_q ? batch * nq : 0) + static_cast<int64_t>(b) * n_other;
  const int2 r = mine[g_mine];
  int first = n_other, last = -1;
  for (int g = lane; g < n_other; g += 32) {
    const int2 x = other[g];
    if (r.x <= x.y && x.x <= r.y) {
      first = min(first, g);
      last = g;
    }
  }
  for (int o = 16; o > 0; o >>= 1) {
    first = min(first, __shfl_xor_sync(0xffffffffu, first, o));
    last = max(last, __shfl_xor_sync(0xffffffffu, last, o));
  }
  const int h = g_mine + lane;
  const bool one_id = lane < kSegRunGranules && h < n_mine && mine[h].x == r.x && mine[h].y == r.x;
  // Bit k: granule g_mine + k holds only r.x; the run is the trailing ones
  // (bits >= kSegRunGranules are 0, so ~ones has a set bit).
  const unsigned ones = __ballot_sync(0xffffffffu, one_id);
  if (lane == 0) {
    meet[idx] = make_int2(first, last);
    runs[idx] = make_int2(r.x, g_mine + __ffs(~ones) - 2);
  }
}

}  // namespace

size_t segment_table_bytes(const AttentionProblem& pr) {
  if (pr.q_segment_ids == nullptr) return 0;
  const size_t cells = static_cast<size_t>(pr.batch) *
                       (granules(static_cast<int>(pr.q_len)) + granules(static_cast<int>(pr.kv_len)));
  return (3 * cells * sizeof(int2) + 255) & ~size_t(255);  // ranges, meet, runs
}

cudaError_t launch_segment_tables(KParams* p, void* scratch, cudaStream_t stream) {
  const int nq = granules(p->T), nk = granules(p->S);
  const int cells = p->B * (nq + nk);
  int2* ranges = static_cast<int2*>(scratch);
  int2* meet = ranges + cells;
  int2* runs = meet + cells;
  constexpr int kThreads = 128, kWarps = kThreads / 32;
  segment_ranges_kernel<<<(cells + kThreads - 1) / kThreads, kThreads, 0, stream>>>(
      SegSide{p->q_seg, p->T, nq}, SegSide{p->kv_seg, p->S, nk}, p->B, ranges);
  record_launch(segment_ranges_kernel);
  segment_meet_kernel<<<(cells + kWarps - 1) / kWarps, kThreads, 0, stream>>>(ranges, nq, nk,
                                                                              p->B, meet, runs);
  record_launch(segment_meet_kernel);
  p->q_seg_meet = meet;
  p->kv_seg_meet = meet + p->B * nq;
  p->q_seg_runs = runs;
  p->kv_seg_runs = runs + p->B * nq;
  return cudaGetLastError();
}

}  // namespace fatrain::cuda
