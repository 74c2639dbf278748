// Hopper FlashAttention backward with a TMA producer and two consumer
// warpgroups that never meet at a block-wide barrier (sm_90a only): head
// dims 64 and 128 (bwd_ws_kernel, without a mask or bias or with one that
// qualifies for staging, KParams::staged) and 256 (without a mask or bias:
// bwd_ws_cluster_pair_kernel or bwd_ws_split_head_kernel, further down;
// kernel_choice.h says which runs where).
//
// Why the producer warp and barrier-free consumers: loading each step's Q and
// dO from all threads and meeting at block-wide barriers (before the step,
// and before dQ += dS K, which needs both warpgroups' dS) makes both
// warpgroups run the same phase at the same time, so the tensor cores idle
// through every softmax and dS phase (docs/cuda.md, "Profiles").
//
// Grid (ceil(S / 128), K, B), one block per key block of 128 keys; with
// causality half that, rounded up: block m folds key blocks nkb - 1 - m and m (nkb of them), one after
// the other, so that every block has about the same work. Three warpgroups:
//   warpgroup 0, the producer: gives its registers back; one warp loads K and
//     V of the key block once (TMA; a folded block's second ones once both
//     consumers are done with the first: "kv_empty"), then for each query
//     step the Q and dO tiles (TMA) and the L and D row statistics (plain
//     loads) into kStages slots, each completing on the slot's "full"
//     mbarrier; before refilling a slot it waits on the slot's "empty"
//     mbarrier.
//   warpgroups 1 and 2, the consumers: consumer c owns keys [64 c, 64 c + 64)
//     of the key block and keeps their dK, dV in registers until the key
//     block's last step. Per step it:
//     1. Sᵀ = K Qᵀ, dPᵀ = V dOᵀ (ss wgmma); Pᵀ = exp2(Sᵀ - L); dV += Pᵀ dO (rs);
//        dSᵀ = Pᵀ (dPᵀ - D); dK += dSᵀ Q (rs);
//     2. (atomic mode) stores its 64 keys of dSᵀ, 16-bit, into the step's dSᵀ
//        buffer and arrives on that buffer's "ready" mbarrier;
//     3. (atomic mode) computes the previous step's dQ columns
//        [c D/2, (c + 1) D/2) = dS K over all 128 keys, once the other
//        consumer's half of that dSᵀ is ready -- a step late, so the wait is
//        normally already over -- and adds them to the float32 scratch with
//        one tensor reduction per 16 x 32 box (cp.reduce.async.bulk.tensor
//        from a per-warp staging area in shared memory, issued by one lane;
//        no register atomics, and no per-row loop: a reduction per row, with
//        per-lane addresses, compiled to a 16-step loop that held 19% of
//        the stall samples at D = 128, 14% at D = 64).
//   dSᵀ has two buffers; a consumer reuses one only after both consumers are
//   done reading it ("done" mbarrier). So a consumer may run up to a step
//   ahead of the other, and one's softmax overlaps the other's products.
// A staged mask or 16-bit bias: the producer warp also copies each step's
// [64 queries][128 keys] tile of it into one slot (cp.async, 16-byte chunks,
// completing on the slot's "scores full" mbarrier), refilled for the next
// step as soon as both consumers have computed their Pᵀ ("scores empty"): one
// slot, because two do not fit beside the D = 128 tiles, and the refill still
// has the rest of the step to land.
// At head dim 64 without a mask or bias a step is 128 query rows (BQ =
// kBQWide): the products and the waits of a 64-row step were too small to
// keep the tensor cores busy there. Then Sᵀ, dPᵀ are 64 keys x 128 queries
// per consumer, and in 3 consumer c computes dQ for queries [64 c, 64 c + 64)
// x all 64 columns instead (DqSplit). At head dim 128 without a mask or bias
// a step is 80 rows (kBQHead128): Sᵀ, dPᵀ are 64 keys x 80 queries, dSᵀ goes
// to its buffer query-major, and in 3 consumer c computes dQᵀ, columns
// [64 c, 64 c + 64) x all 80 queries, and adds each warp's 16 columns with
// one tensor reduction (add_dq_columns).
// Rows past T read as zeros (the tensor maps' bounds) with L = +inf, so they
// add nothing. The deterministic mode skips 2 and 3 (tc_dq.cu computes dQ).
#include "cuda/hopper_bwd_common.cuh"
#include "cuda/kernel_choice.h"
#include "cuda/launch.h"
#include "cuda/tma.cuh"
#include "cuda/wgmma.cuh"

namespace fatrain::cuda {
namespace {

constexpr int kConsumers = 2, kBK = 64 * kConsumers, kBQ = kBwdBQ;
// Query rows per step of bwd_ws_kernel at head dim 64 without a mask or bias
// (kernel_choice.h, hopper_bwd_query_rows): twice kBQ, so that each step's waits and small
// products serve twice the work (Sᵀ and dPᵀ become 64 x 128, dV and dK reduce
// over 128 queries).
constexpr int kBQWide = 2 * kBwdBQ;
// Query rows per step of bwd_ws_kernel at head dim 128 without a mask or
// bias (hopper_bwd_query_rows): 80, the most for which Sᵀ and dPᵀ (64 keys x
// 80 queries) fit the registers beside dK and dV of 64 keys x 128 columns.
// Sᵀ, dPᵀ and dQ read both operands from shared memory, at 64 x 64 x 16 as
// many bytes per product as the tensor cores take in its cycles (4 KB in
// 32); at 64 x 80 x 16, 4.5 KB in 40, and every per-step wait serves 25%
// more work. A wgmma's M is 64, so dQ of 80 queries is computed transposed
// (issue_dq_transposed; DqSplit).
constexpr int kBQHead128 = 80;

// The key blocks ("units") that block (bwd_ws_kernel) or cluster
// (bwd_ws_cluster_pair_kernel) m does, one after the other: key block m,
// and when folded (causal; see the launches) also key block nkb - 1 - m, so
// that every block has about the same work. Walked tile by tile, folded
// blocks do the short key block first, tiles down, then the long one, tiles
// up, so that the blocks of a KV head read at most two query tiles at a
// time (bwd_ws_cluster_pair_kernel says how).
struct KeyBlockUnits {
  int m, nkb, count;
  bool short_first;
  __device__ __forceinline__ KeyBlockUnits(const KParams& p, int m_, int folded)
      : m(m_), nkb((p.S + kBK - 1) / kBK) {
    count = folded && nkb - 1 - m != m ? 2 : 1;
    short_first = folded;
  }
  // Unit `unit`'s first key (returned) and its query steps.
  template <int BQ>
  __device__ __forceinline__ int start(int unit, const KParams& p, int b, int kvh, HeadMask& hm,
                                       QuerySteps<BQ>& steps) const {
    const bool key_block_m = (unit == 0) != short_first;
    const int j0 = (key_block_m ? m : nkb - 1 - m) * kBK;
    steps.init(p, hm, b, kvh, j0, kBK,
               short_first && unit == 1 ? StepOrder::kTilesUp : StepOrder::kTilesDown);
    return j0;
  }
};
constexpr int kNT = 128 * (kConsumers + 1);
constexpr int kStages = 2;

struct BwdTensorMaps {
  CUtensorMap q, d_o, k, v;
  CUtensorMap dq_acc;  // the float32 dQ scratch (atomic mode; not the split head)
};

// bwd_ws_kernel's mbarriers, 8 bytes each from `base`, for kStages slots of
// Q and dO.
struct BwdBarriers {
  static constexpr int STAGES = kStages;
  static constexpr int kCount = 1 + 2 * STAGES + 4 + 2 + 1;
  uint32_t base;
  // K and V landed; every consumer thread is done with them (bwd_ws_kernel
  // with folded key blocks: the next unit's K and V may be loaded).
  __device__ __forceinline__ uint32_t kv_full() const { return base; }
  __device__ __forceinline__ uint32_t kv_empty() const { return base + 8 * (7 + 2 * STAGES); }
  // Slot s's Q, dO (bytes) and row statistics (the producer warp's 32 lanes)
  // landed; every consumer thread is done with it.
  __device__ __forceinline__ uint32_t full(int s) const { return base + 8 * (1 + s); }
  __device__ __forceinline__ uint32_t empty(int s) const { return base + 8 * (1 + STAGES + s); }
  // Both consumers wrote their part of shared buffer u (dSᵀ); both are done
  // reading it.
  __device__ __forceinline__ uint32_t ready(int u) const {
    return base + 8 * (1 + 2 * STAGES + u);
  }
  __device__ __forceinline__ uint32_t done(int u) const {
    return base + 8 * (3 + 2 * STAGES + u);
  }
  // The staged score slot landed (each producer lane's cp.async copies);
  // both consumers have read it.
  __device__ __forceinline__ uint32_t scores_full() const { return base + 8 * (5 + 2 * STAGES); }
  __device__ __forceinline__ uint32_t scores_empty() const {
    return base + 8 * (6 + 2 * STAGES);
  }
  // One thread initialises them, before the block-wide barrier.
  __device__ __forceinline__ void init() const {
    mbar_init(kv_full(), 1);
    mbar_init(kv_empty(), kConsumers * 128);
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(full(s), 32);
      mbar_init(empty(s), kConsumers * 128);
    }
    for (int u = 0; u < 2; ++u) {
      mbar_init(ready(u), kConsumers * 128);
      mbar_init(done(u), kConsumers * 128);
    }
    mbar_init(scores_full(), 32);
    mbar_init(scores_empty(), kConsumers * 128);
    fence_mbar_init();
  }
};

// Which part of a step's dQ (BQ queries x D) consumer c computes: with
// 64-row steps, all 64 queries x columns [c D / 2, (c + 1) D / 2); with
// 128-row steps, queries [64 c, 64 c + 64) x all D columns; with 80-row
// steps (kTransposed), all 80 queries x columns [64 c, 64 c + 64), as the
// 64 x 80 accumulator of dQᵀ.
template <int D, int BQ>
struct DqSplit {
  static constexpr bool kTransposed = BQ == kBQHead128;
  static constexpr int kCols = BQ == kBQWide ? D : D / 2;
  static __device__ __forceinline__ int col0(int c) { return BQ == kBQWide ? 0 : c * kCols; }
  static __device__ __forceinline__ int row0(int c) { return BQ == kBQWide ? c * 64 : 0; }
};

// Shared memory, in byte offsets from a 1024-byte aligned base (every SW128
// tile starts on a 1024-byte boundary). EB: bytes per element of a staged
// mask (1) or bias (2), 0 for none; BQ: query rows per step.
template <int D, int EB, int BQ = kBQ>
struct BwdWsLayout {
  static_assert(BQ == kBQ || EB == 0, "wider steps leave no room for a staged score slot");
  static constexpr int kKVBytes = kBK * D * 2;       // K, or V: [kBK keys][D]
  static constexpr int kQBytes = BQ * D * 2;         // one slot of Q, or dO
  // One dSᵀ buffer: [kBK keys][BQ queries], or (DqSplit::kTransposed)
  // [BQ queries][kBK keys].
  static constexpr int kDSBytes = kBK * BQ * 2;
  // One consumer's dQ staging: 64 rows of DqSplit::kCols floats, as 32 x 16
  // boxes (dq_box_offset), each warp's 16 rows kCols / 32 boxes; transposed,
  // each warp's 16 columns of all BQ rows, one 16 x BQ box (dq_box64_offset).
  static constexpr int kDqBytes =
      (DqSplit<D, BQ>::kTransposed ? BQ : 64) * DqSplit<D, BQ>::kCols * 4;
  static constexpr int kStatBytes = BQ * 4;          // one slot of L, or D
  static constexpr int kScoreRow = EB == 0 ? 0 : staged_row_bytes<kBK, EB>();
  static constexpr int kScoreBytes = BQ * kScoreRow;  // the staged score slot
  static constexpr int kK = 0, kV = kK + kKVBytes, kQ = kV + kKVBytes,
                       kDO = kQ + kStages * kQBytes, kDS = kDO + kStages * kQBytes,
                       kDq = kDS + 2 * kDSBytes, kL = kDq + kConsumers * kDqBytes,
                       kDsum = kL + kStages * kStatBytes, kScore = kDsum + kStages * kStatBytes,
                       kBars = kScore + kScoreBytes;
  static constexpr int kSmemBytes = kBars + 8 * BwdBarriers::kCount + 1024;  // + alignment slack
  static_assert(kSmemBytes <= 227 * 1024, "more shared memory than a Hopper block has");
};

// Writes a warp's 16 rows of dq (a 16 x DH slice of a wgmma accumulator) as
// rows [row0, row0 + 16) of DH / 32 boxes of 32 columns x BOX_ROWS rows at
// `boxes` (1024-byte aligned, dq_box_offset's layout), for tensor reductions.
template <int DH, int BOX_ROWS>
__device__ __forceinline__ void write_dq_rows(const float (&dq)[DH / 2], uint8_t* boxes, int row0,
                                              int lane) {
  constexpr int kBoxBytes = 32 * BOX_ROWS * 4;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = row0 + (lane >> 2) + 8 * r;
#pragma unroll
    for (int j = 0; j < DH / 8; ++j) {
      const int col = acc_col(j, lane, 0);
      *reinterpret_cast<float2*>(boxes + (col >> 5) * kBoxBytes + dq_box_offset(row, col & 31)) =
          make_float2(dq[4 * j + 2 * r], dq[4 * j + 2 * r + 1]);
    }
  }
}

// Adds a warp's 16 rows of dq (query rows i0 + 16 wq .., columns
// [col0, col0 + DH) of head h) to the float32 scratch: the warp writes them
// into its DH / 32 boxes at `boxes` (32 x 16 floats each, 1024-byte aligned)
// and one lane issues a tensor reduction per box (rows past T are skipped by
// the tensor map's bounds) and commits them as one bulk group. The caller
// makes sure earlier readers of the boxes are done, and keeps them unwritten
// until that lane's bulk_wait_read says the reductions have read them.
template <int DH>
__device__ __forceinline__ void reduce_dq_rows(const CUtensorMap* dq_map, const float (&dq)[DH / 2],
                                               uint8_t* boxes, int b, int h, int i0, int col0,
                                               int wq, int lane) {
  constexpr int kBoxes = DH / 32, kBoxBytes = 32 * 16 * 4;
  write_dq_rows<DH, 16>(dq, boxes, 0, lane);
  fence_proxy_async();  // the tensor reductions read through the async proxy
  __syncwarp();
  if (lane == 0) {
#pragma unroll
    for (int x = 0; x < kBoxes; ++x)
      tma_reduce_add_4d(dq_map, smem_u32(boxes + x * kBoxBytes), col0 + 32 * x, i0 + 16 * wq, h,
                        b);
    bulk_commit();
  }
}

// reduce_dq_rows from the warp's own boxes of a consumer's staging area
// `sdq`, which the warp alone reuses: it first waits until the previous
// step's reductions have read them.
template <int DH>
__device__ __forceinline__ void add_dq_rows(const CUtensorMap* dq_map, const float (&dq)[DH / 2],
                                            uint8_t* sdq, int b, int h, int i0, int col0, int wq,
                                            int lane) {
  constexpr int kBoxes = DH / 32, kBoxBytes = 32 * 16 * 4;
  uint8_t* boxes = sdq + wq * kBoxes * kBoxBytes;
  if (lane == 0) bulk_wait_read<0>();  // the last step's reductions have read the boxes
  __syncwarp();
  reduce_dq_rows<DH>(dq_map, dq, boxes, b, h, i0, col0, wq, lane);
}

// Adds a warp's 16 x 64 slice of dQ (rows i0 + 16 wq .. + 15, columns
// [col0, col0 + 64) of head h) to the float32 scratch where shared memory has
// room for only one 32 x 16 box per warp (bwd_ws_cluster_pair_kernel): two
// tensor reductions from the warp's box `box`, columns [col0, col0 + 32)
// then the other 32, each once the one before has read the box. With float4
// atomics instead, the next step's first instructions waited until the
// memory pipe had read the atomics' source registers (the kernel's largest
// stall, 15% of the samples at D = 256 T = 8192 causal on an H100), and the
// backward took 7-9% longer (docs/cuda.md).
__device__ __forceinline__ void add_dq_rows_one_box(const CUtensorMap* dq_map, const float (&dq)[32],
                                                    uint8_t* box, int b, int h, int i0, int col0,
                                                    int wq, int lane) {
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    if (lane == 0) bulk_wait_read<0>();  // the last reduction has read the box
    __syncwarp();
    reduce_dq_rows<32>(dq_map, *reinterpret_cast<const float(*)[16]>(&dq[16 * half]), box, b, h,
                       i0, col0 + 32 * half, wq, lane);
  }
}

// Adds a warp's 16 rows of a dQᵀ accumulator (64 head columns x NQ
// queries: columns col0 + 16 wq .. + 15 of query rows i0 .. i0 + NQ - 1 of
// head h) to the float32 scratch: the warp writes them into its box at `box`
// (NQ rows x 16 columns, 512-byte aligned, dq_box64_offset), once the
// previous step's reduction has read it, and one lane issues one tensor
// reduction (rows past T are skipped by the tensor map's bounds).
// Lanes l and l ^ 4 hold neighbouring head columns of the same queries; each
// pair swaps one value so that the even lane writes columns (2 m, 2 m + 1) of
// an even query and the odd lane those of the odd query next to it: one
// float2 store instead of two float stores, at two wavefronts each, so the
// box costs half the shared-memory wavefronts.
template <int NQ>
__device__ __forceinline__ void add_dq_columns(const CUtensorMap* dq_map, const float (&dqt)[NQ / 2],
                                               uint8_t* box, int b, int h, int i0, int col0,
                                               int wq, int lane) {
  const bool odd = (lane >> 2) & 1;
  const int col = (lane >> 2) & ~1;  // the pair's first column (+ 8 in the second half)
  if (lane == 0) bulk_wait_read<0>();  // the last step's reduction has read the box
  __syncwarp();
#pragma unroll
  for (int j = 0; j < NQ / 8; ++j) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      // Elements 2 half (even query) and 2 half + 1 (odd query), column
      // lane / 4 + 8 half.
      const float even_q = dqt[4 * j + 2 * half], odd_q = dqt[4 * j + 2 * half + 1];
      const float got = __shfl_xor_sync(0xffffffffu, odd ? even_q : odd_q, 4);
      const int q = acc_col(j, lane, odd ? 1 : 0);
      *reinterpret_cast<float2*>(box + dq_box64_offset(q, col + 8 * half)) =
          odd ? make_float2(got, odd_q) : make_float2(even_q, got);
    }
  }
  fence_proxy_async();  // the tensor reduction reads through the async proxy
  __syncwarp();
  if (lane == 0) {
    tma_reduce_add_4d(dq_map, smem_u32(box), col0 + 16 * wq, i0, h, b);
    bulk_commit();
  }
}

// Where the producer puts a block's tiles (shared addresses; the row
// statistics as pointers).
struct BwdTiles {
  uint32_t k, v, q, d_o, scores;
  float *l, *dsum;
};

// The producer warp (see the top of the file), for one key block ("unit";
// bwd_ws_kernel's folded blocks have two): K and V rows [j0, j0 + BK) of KV
// head kvh once, then each BQ-row query step's Q, dO, L, D into slot g %
// kStages, and (EB > 0) its staged score tile. g = g0 + it numbers the steps
// over the units (g0: the steps of the units before), so that every
// barrier's phases continue; loads: the K/V loads of the units before, whose
// K and V the consumers must be done with before these overwrite them. With
// staged scores it waits for its last copies before it returns.
template <int D, int BK, int EB, int BQ>
__device__ __forceinline__ void produce(const BwdTensorMaps& maps, const KParams& p,
                                        const BwdBarriers& bar, const BwdTiles& t,
                                        const QuerySteps<BQ>& steps, int b, int kvh, int j0,
                                        int lane, int g0 = 0, int loads = 0) {
  constexpr int kQBytes = BQ * D * 2, kKVBytes = BK * D * 2;
  if (loads > 0) mbar_wait(bar.kv_empty(), (loads - 1) & 1);
  if (lane == 0) {
    mbar_arrive_expect_tx(bar.kv_full(), 2 * kKVBytes);
    for (int cb = 0; cb < D / 64; ++cb) {
      tma_load_4d(t.k + cb * BK * 128, &maps.k, bar.kv_full(), 64 * cb, j0, kvh, b);
      tma_load_4d(t.v + cb * BK * 128, &maps.v, bar.kv_full(), 64 * cb, j0, kvh, b);
    }
  }
  // Slot s holds steps s, s + kStages, ...; its u-th refill (u >= 1) waits
  // for the u-th completion of its empty barrier, parity (u - 1) & 1.
  for (int it = 0; it < steps.total; ++it) {
    const int g = g0 + it;
    const int s = g % kStages, use = g / kStages;
    if (use > 0) mbar_wait(bar.empty(s), (use - 1) & 1);
    const int h = steps.head(it), i0 = steps.row0(it);
    // Written out rather than looped: a loop here changed how ptxas unrolled
    // the 64-row instances' producer.
    load_row_stats(p, b, h, i0, BQ, lane, t.l + s * BQ, t.dsum + s * BQ);
    load_row_stats(p, b, h, i0, BQ, lane + 32, t.l + s * BQ, t.dsum + s * BQ);
    if constexpr (BQ > 64) {
      load_row_stats(p, b, h, i0, BQ, lane + 64, t.l + s * BQ, t.dsum + s * BQ);
      load_row_stats(p, b, h, i0, BQ, lane + 96, t.l + s * BQ, t.dsum + s * BQ);
    }
    if (lane == 0) {
      mbar_arrive_expect_tx(bar.full(s), 2 * kQBytes);
      for (int cb = 0; cb < D / 64; ++cb) {
        tma_load_4d(t.q + s * kQBytes + cb * BQ * 128, &maps.q, bar.full(s), 64 * cb, i0, h, b);
        tma_load_4d(t.d_o + s * kQBytes + cb * BQ * 128, &maps.d_o, bar.full(s), 64 * cb, i0,
                    h, b);
      }
    } else {
      mbar_arrive(bar.full(s));  // after this lane's row statistics
    }
    if constexpr (EB > 0) {
      // The slot is free once both consumers have their step g - 1 Pᵀ.
      if (g > 0) mbar_wait(bar.scores_empty(), (g - 1) & 1);
      // 8 rows at a time: unrolled whole, the copies' addresses overflow the
      // producer's registers.
      constexpr int kRow = staged_row_bytes<BK, EB>();
#pragma unroll 1
      for (int r = 0; r < BQ; r += 8)
        stage_score_tile<8, BK, EB, 32>(p, b, h, t.scores + r * kRow, i0 + r, j0, lane);
      cp_async_mbar_arrive(bar.scores_full());
    }
  }
  // A thread's cp.async copies are not documented to survive its exit: wait
  // for the last step's (the consumers wait on their arrival anyway, and
  // before a next unit's K and V for more than that).
  if constexpr (EB > 0) cp_async_wait_all();
}

template <class E, int D, bool ATOMIC, int EB, int BQ>
__global__ void __launch_bounds__(kNT, 1)
    bwd_ws_kernel(const __grid_constant__ BwdTensorMaps maps, const KParams p, const int folded) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using L = BwdWsLayout<D, EB, BQ>;
  using Dq = DqSplit<D, BQ>;
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  const uint32_t base = (smem_u32(smem_raw) + 1023) & ~1023u;
  auto smem_ptr = [&](uint32_t addr) { return smem_raw + (addr - smem_u32(smem_raw)); };
  const uint32_t sK = base + L::kK, sV = base + L::kV, sQ = base + L::kQ, sdO = base + L::kDO;
  const uint32_t sdS = base + L::kDS;
  float* sL = reinterpret_cast<float*>(smem_ptr(base + L::kL));
  float* sDs = reinterpret_cast<float*>(smem_ptr(base + L::kDsum));
  const uint32_t sScore = base + L::kScore;
  const BwdBarriers bar{base + L::kBars};

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, wg = warp >> 2;
  const int b = blockIdx.z, kvh = blockIdx.y;
  // The block's key blocks (KeyBlockUnits). A step's number g counts on over
  // the units, so that every barrier's phases (Q/dO slots, dSᵀ buffers, the
  // staged score slot) do too; K and V have one buffer, refilled per unit.
  const KeyBlockUnits units(p, static_cast<int>(blockIdx.x), folded);
  // Unit `unit`'s first key and query steps, for the producer and consumers.
  auto start_unit = [&](int unit, HeadMask& hm, QuerySteps<BQ>& steps) {
    return units.start(unit, p, b, kvh, hm, steps);
  };

  if (tid == 0) bar.init();
  __syncthreads();  // the last block-wide barrier: producer threads exit early

  // Register budgets: the block starts with 168 per thread (384 threads, one
  // block per SM) and, as far as we can tell, a warpgroup's setmaxnreg.inc
  // takes only what the block's other warpgroups gave back, so the budgets
  // add up to 3 x 168. (With the producer at 32 and the consumers at 240, the
  // masked problems hung on an H200; at 24 they run.)
  if (wg == 0) {
    setmaxnreg_dec<24>();
    if (warp != 0) return;
    // Units without steps load nothing (the consumers skip them too).
    int g0 = 0, loads = 0;  // steps and K/V loads of the units before
    for (int unit = 0; unit < units.count; ++unit) {
      HeadMask hm;
      QuerySteps<BQ> steps;
      const int j0 = start_unit(unit, hm, steps);
      if (steps.total == 0) continue;
      produce<D, kBK, EB, BQ>(maps, p, bar, BwdTiles{sK, sV, sQ, sdO, sScore, sL, sDs}, steps,
                              b, kvh, j0, lane, g0, loads);
      g0 += steps.total;
      ++loads;
    }
    return;
  }

  setmaxnreg_inc<240>();
  // The warp's index as a uniform value (warp_index_uniform): its keys, dQ
  // columns and tile addresses, and so its wgmma descriptors, stay in uniform
  // registers through the step loop.
  const int uwarp = warp_index_uniform();
  const int c = (uwarp >> 2) - 1, wq = uwarp & 3;
  const int key_w0 = c * 64 + wq * 16;  // the warp's 16 keys, relative to j0
  uint8_t* sdq = smem_ptr(base + L::kDq + c * L::kDqBytes);

  float dk[D / 2], dv[D / 2], st[BQ / 2], dpt[BQ / 2];
#pragma unroll
  for (int i = 0; i < BQ / 2; ++i) st[i] = dpt[i] = 0.f;

  int g0 = 0, loads = 0;  // steps and K/V loads of the units before
  for (int unit = 0; unit < units.count; ++unit) {
    HeadMask hm;
    QuerySteps<BQ> steps;
    const int j0 = start_unit(unit, hm, steps);
    const int total = steps.total;
#pragma unroll
    for (int i = 0; i < D / 2; ++i) dk[i] = dv[i] = 0.f;

    // The previous step's dQ (atomic mode), this consumer's part of it
    // (DqSplit), in two halves. issue_dq_of waits for both halves of the
    // step's dSᵀ and issues the product (one commit group); add_dq_of, once
    // that group is done, releases the buffer and adds dQ to the scratch.
    // prev: the step's number in the unit (its head and rows); g0 + prev its
    // number over the units (its buffer).
    float dq[Dq::kTransposed ? BQ / 2 : Dq::kCols / 2];  // dQᵀ or dQ
    auto issue_dq_of = [&](int prev) {
      const int g = g0 + prev;
      const uint32_t cdS = sdS + (g & 1) * L::kDSBytes;
      mbar_wait(bar.ready(g & 1), (g >> 1) & 1);
      if constexpr (Dq::kTransposed) {
        issue_dq_transposed<E, BQ, kBK>(dq, cdS, sK, Dq::col0(c));
      } else {
        issue_dq<E, Dq::kCols, kBK>(dq, cdS, sK, Dq::col0(c), Dq::row0(c));
      }
    };
    auto add_dq_of = [&](int prev) {
      fence_regs(dq);
      mbar_arrive(bar.done((g0 + prev) & 1));
      if constexpr (Dq::kTransposed) {
        add_dq_columns<BQ>(&maps.dq_acc, dq, sdq + wq * (BQ * 16 * 4), b, steps.head(prev),
                           steps.row0(prev), Dq::col0(c), wq, lane);
      } else {
        add_dq_rows<Dq::kCols>(&maps.dq_acc, dq, sdq, b, steps.head(prev),
                               steps.row0(prev) + Dq::row0(c), Dq::col0(c), wq, lane);
      }
    };

    if (total > 0) mbar_wait(bar.kv_full(), loads & 1);
    for (int it = 0; it < total; ++it) {
      const int g = g0 + it;
      const int s = g % kStages;
      const int h = steps.head(it), i0 = steps.row0(it);
      hm.init(p, b, h, kLog2e);
      const uint32_t cQ = sQ + s * L::kQBytes, cdO = sdO + s * L::kQBytes;
      const float* cL = sL + s * BQ;
      const float* cDs = sDs + s * BQ;
      mbar_wait(bar.full(s), (g / kStages) & 1);

      // Sᵀ and dPᵀ for this consumer's 64 keys x the step's BQ queries; Pᵀ
      // and dV += Pᵀ dO go ahead while dPᵀ computes.
      issue_st_dpt<E, D, kBK, BQ, BQ>(st, dpt, sK, sV, c * 64, cQ, cdO);
      // L, and below D, are read into registers while the products run
      // (ThreadRowStats), so that the exponent's FFMAs do not wait for them.
      ThreadRowStats<BQ> row_l, row_d;
      row_l.load(cL, 0, lane);
      wgmma_wait<1>();
      fence_regs(st);
      const bool one_seg = hm.one_segment(p, b, i0, i0 + BQ, j0 + key_w0, j0 + key_w0 + 16);
      const bool full_tile =
          hm.tile_in_bounds<EB>(i0, i0 + BQ, j0 + key_w0, j0 + key_w0 + 16) && one_seg;
      if constexpr (EB > 0) mbar_wait(bar.scores_full(), g & 1);
      compute_pt<EB, L::kScoreRow, BQ>(st, hm, p.scale_log2, row_l, i0, j0, key_w0, 0, lane,
                                       full_tile, one_seg, smem_ptr(sScore));
      if constexpr (EB > 0) mbar_arrive(bar.scores_empty());

      // dSᵀ; in atomic mode also into this step's dSᵀ buffer, once both
      // consumers are done with its use two steps ago.
      if constexpr (BQ != kBwdBQ) {
        uint32_t pt[BQ / 4];  // Pᵀ, packed (pack_pairs says why)
        pack_pairs<E, BQ>(st, pt);
        issue_dv_packed<E, D, BQ>(dv, pt, cdO);
        row_d.load(cDs, 0, lane);
        wgmma_wait<1>();  // dPᵀ is done; dV may still run
        fence_regs(dpt);
        compute_dst_packed<E, BQ>(dpt, pt, row_d, 0, lane);
      } else {
        issue_dv<E, D, BQ>(dv, st, cdO);
        row_d.load(cDs, 0, lane);
        wgmma_wait<1>();  // dPᵀ is done; dV may still run
        fence_regs(dpt);
        compute_dst<BQ>(dpt, st, row_d, 0, lane);
      }
      if constexpr (ATOMIC) {
        if (g >= 2) mbar_wait(bar.done(g & 1), ((g >> 1) - 1) & 1);
        if constexpr (Dq::kTransposed) {
          store_query_major<E, BQ>(sdS + (g & 1) * L::kDSBytes, dpt, key_w0, lane);
        } else {
          store_key_major<E, kBK, BQ>(smem_ptr(sdS + (g & 1) * L::kDSBytes), dpt, key_w0, 0,
                                      lane);
        }
        fence_proxy_async();  // dQ's wgmma reads it through the async proxy
        mbar_arrive(bar.ready(g & 1));
      }

      issue_dk<E, D, BQ>(dk, dpt, cQ);
      if (ATOMIC && it > 0) {
        // The previous step's dQ product queues behind dK += dSᵀ Q, so the
        // tensor cores run the two back to back instead of this warpgroup
        // waiting for dK before it issues dQ.
        issue_dq_of(it - 1);
        wgmma_wait<1>();  // dK (and dV) done; dQ may still run
        fence_regs(dv);
        fence_regs(dk);
        mbar_arrive(bar.empty(s));  // this consumer is done with the slot's Q, dO, L, D
        wgmma_wait<0>();
        add_dq_of(it - 1);
      } else {
        wgmma_wait<0>();
        fence_regs(dv);
        fence_regs(dk);
        mbar_arrive(bar.empty(s));
      }
    }
    if (total > 0) {
      // The unit's last dQ reads K (dS K), so it comes before K and V are
      // released; then this thread reads neither again.
      if constexpr (ATOMIC) {
        issue_dq_of(total - 1);
        wgmma_wait<0>();
        add_dq_of(total - 1);
      }
      mbar_arrive(bar.kv_empty());
      ++loads;
    }
    // Zeros for a key block without steps (past every query, or every key
    // past its KV length).
    store_dk_dv<E, D>(p, dk, dv, b, kvh, j0 + c * 64, 0, wq, lane);
    g0 += total;
  }  // unit
  // The staging rows stay valid until the reductions are done (between
  // units, add_dq_rows waits for them to be read before rewriting them).
  if constexpr (ATOMIC) bulk_wait<0>();
#endif  // __CUDA_ARCH_FEAT_SM90_ALL: other targets get an empty kernel, never launched
}

// head_dim 256, split head (the deterministic mode, and where
// bwd_ws_cluster_pair_kernel's pair of blocks does not fit; kernel_choice.h,
// hopper_bwd_256). The decomposition
// cuDNN's D = 256 kernel uses (docs/cuda.md): a block owns 128 keys, as
// bwd_ws_kernel does at D = 128, but only one 128-column half of their dK,
// dV and of dQ; the grid has two blocks per key block, one per half, that
// both compute the full Sᵀ and dPᵀ (contracted over all 256 columns).
// That is 1.4x the tensor work of the problem, for dK and dV of 64 keys x
// 128 columns per consumer (what fits the registers) and a dQ of 64
// queries x 128 columns per 128 keys instead of per 64 (as with two
// consumers sharing 64 keys and splitting the head dim): half the float32 dQ
// traffic per product.
// Consumer c owns keys [64 c, 64 c + 64) and, per step, computes dQ columns
// [64 c, 64 c + 64) of the half over all 128 keys, a step late, as
// bwd_ws_kernel does (the dSᵀ buffers, "ready" and "done").
// Column blocks: the 64-column block at position x of every K, V, Q and dO
// tile is the operand's column block (x + 2 half) mod 4, so positions 0 and
// 1 are the half's own columns (dV, dK and dQ read those as at D = 128) and
// Sᵀ, dPᵀ reduce over all four in any order.
// Shared memory: K and V take 128 KB, so Q and dO have one slot each, and
// each slot is two parts with their own "full" and "empty" mbarriers, so
// that the producer refills each part once its last reader is done: the
// other half's columns after Sᵀ and dPᵀ, dO's own after dV += Pᵀ dO, Q's own
// after dK += dSᵀ Q. The consumers issue Sᵀ, dPᵀ over the parts in the order
// they land. dQ goes to the float32 scratch with float4 atomics
// (add_dq_tile_v4; a little faster than float2): no room is left for
// staging tensor reductions.
struct SplitHeadBarriers {
  // The four parts of a step's Q and dO, in the order their readers finish
  // and the producer refills them.
  enum Part { kQOther, kDOOther, kDOOwn, kQOwn, kParts };
  uint32_t base;
  __device__ __forceinline__ uint32_t kv_full() const { return base; }
  // The part landed (its bytes; for kQOther also the producer warp's 32
  // lanes' row statistics); every consumer thread is done with it.
  __device__ __forceinline__ uint32_t full(int part) const { return base + 8 * (1 + part); }
  __device__ __forceinline__ uint32_t empty(int part) const {
    return base + 8 * (1 + kParts + part);
  }
  // Both consumers wrote their keys of dSᵀ buffer u; both are done reading it.
  __device__ __forceinline__ uint32_t ready(int u) const { return base + 8 * (1 + 2 * kParts + u); }
  __device__ __forceinline__ uint32_t done(int u) const { return base + 8 * (3 + 2 * kParts + u); }
  static constexpr int kCount = 5 + 2 * kParts;
  __device__ __forceinline__ void init() const {
    mbar_init(kv_full(), 1);
    for (int part = 0; part < kParts; ++part) {
      mbar_init(full(part), part == kQOther ? 32 : 1);
      mbar_init(empty(part), kConsumers * 128);
    }
    for (int u = 0; u < 2; ++u) {
      mbar_init(ready(u), kConsumers * 128);
      mbar_init(done(u), kConsumers * 128);
    }
    fence_mbar_init();
  }
};

struct SplitHeadLayout {
  static constexpr int D = 256;
  static constexpr int kKVBytes = kBK * D * 2;     // K, or V: [128 keys][256]
  static constexpr int kQBytes = kBQ * D * 2;      // Q, or dO: [64 queries][256]
  static constexpr int kPartBytes = kQBytes / 2;   // two column blocks of Q or dO
  static constexpr int kDSBytes = kBK * kBQ * 2;   // one dSᵀ buffer: [128 keys][64 queries]
  static constexpr int kStatBytes = kBQ * 4;       // one stage of L, or D
  static constexpr int kK = 0, kV = kK + kKVBytes, kQ = kV + kKVBytes, kDO = kQ + kQBytes,
                       kDS = kDO + kQBytes, kL = kDS + 2 * kDSBytes,
                       kDsum = kL + 2 * kStatBytes, kBars = kDsum + 2 * kStatBytes;
  static constexpr int kSmemBytes = kBars + 8 * SplitHeadBarriers::kCount + 1024;  // + slack
  static_assert(kSmemBytes <= 227 * 1024, "more shared memory than a Hopper block has");
};

// The column-block placement of the D = 256 kernels whose block owns one
// half of the head dim: positions x0 and x0 + 1 of `tile` (blocks of rows x
// 64 columns) get the operand's column blocks (x + 2 half) mod 4, so that
// positions 0 and 1 hold the half's own columns. Rows [row, row + rows) of
// head h, batch b, completing on `full`; one thread issues them.
__device__ __forceinline__ void load_half_blocks(uint32_t tile, const CUtensorMap* map,
                                                 uint32_t full, int rows, int x0, int half,
                                                 int row, int h, int b) {
  for (int x = x0; x < x0 + 2; ++x)
    tma_load_4d(tile + x * rows * 128, map, full, 64 * ((x + 2 * half) & 3), row, h, b);
}

template <class E, bool ATOMIC>
__global__ void __launch_bounds__(kNT, 1)
    bwd_ws_split_head_kernel(const __grid_constant__ BwdTensorMaps maps, const KParams p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using L = SplitHeadLayout;
  using Bars = SplitHeadBarriers;
  constexpr int DH = 128;  // the half's columns
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  const uint32_t base = (smem_u32(smem_raw) + 1023) & ~1023u;
  auto smem_ptr = [&](uint32_t addr) { return smem_raw + (addr - smem_u32(smem_raw)); };
  const uint32_t sK = base + L::kK, sV = base + L::kV, sQ = base + L::kQ, sdO = base + L::kDO;
  const uint32_t sdS = base + L::kDS;
  float* sL = reinterpret_cast<float*>(smem_ptr(base + L::kL));
  float* sDs = reinterpret_cast<float*>(smem_ptr(base + L::kDsum));
  const Bars bar{base + L::kBars};

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, wg = warp >> 2;
  const int b = blockIdx.z, kvh = blockIdx.y, half = blockIdx.x & 1;
  const int j0 = (blockIdx.x >> 1) * kBK;
  HeadMask hm;
  QuerySteps<> steps;
  steps.init(p, hm, b, kvh, j0, kBK, StepOrder::kTilesDown);
  const int total = steps.total;

  if (tid == 0) bar.init();
  __syncthreads();  // the last block-wide barrier: producer threads exit early

  if (wg == 0) {
    setmaxnreg_dec<24>();
    if (warp != 0 || total == 0) return;
    // The producer warp: K and V once, then each step's four parts, each
    // once its previous use is done (the consumers finish them in part
    // order), and with the first part the step's L and D into stage it & 1.
    // A part is two column blocks: positions 2 x, 2 x + 1 of its tile.
    auto load_blocks = [&](uint32_t tile, const CUtensorMap* map, uint32_t full, int rows,
                           int x0, int row, int h) {
      load_half_blocks(tile, map, full, rows, x0, half, row, h, b);
    };
    if (lane == 0) {
      mbar_arrive_expect_tx(bar.kv_full(), 2 * L::kKVBytes);
      load_blocks(sK, &maps.k, bar.kv_full(), kBK, 0, j0, kvh);
      load_blocks(sK, &maps.k, bar.kv_full(), kBK, 2, j0, kvh);
      load_blocks(sV, &maps.v, bar.kv_full(), kBK, 0, j0, kvh);
      load_blocks(sV, &maps.v, bar.kv_full(), kBK, 2, j0, kvh);
    }
    for (int it = 0; it < total; ++it) {
      const int h = steps.head(it), i0 = steps.row0(it);
      for (int part = 0; part < Bars::kParts; ++part) {
        if (it > 0) mbar_wait(bar.empty(part), (it - 1) & 1);
        if (part == Bars::kQOther) {
          float *l = sL + (it & 1) * kBQ, *dsum = sDs + (it & 1) * kBQ;
          load_row_stats(p, b, h, i0, kBQ, lane, l, dsum);
          load_row_stats(p, b, h, i0, kBQ, lane + 32, l, dsum);
          if (lane != 0) mbar_arrive(bar.full(part));  // after this lane's statistics
        }
        if (lane == 0) {
          const bool is_q = part == Bars::kQOther || part == Bars::kQOwn;
          const bool own = part == Bars::kDOOwn || part == Bars::kQOwn;
          mbar_arrive_expect_tx(bar.full(part), L::kPartBytes);
          load_blocks(is_q ? sQ : sdO, is_q ? &maps.q : &maps.d_o, bar.full(part), kBQ,
                      own ? 0 : 2, i0, h);
        }
      }
    }
    return;
  }

  setmaxnreg_inc<240>();
  const int c = wg - 1, wq = warp & 3;
  const int key_w0 = c * 64 + wq * 16;  // the warp's 16 keys, relative to j0

  float dk[DH / 2], dv[DH / 2], st[kBQ / 2], dpt[kBQ / 2];
#pragma unroll
  for (int i = 0; i < DH / 2; ++i) dk[i] = dv[i] = 0.f;
#pragma unroll
  for (int i = 0; i < kBQ / 2; ++i) st[i] = dpt[i] = 0.f;

  // The previous step's dQ, columns [64 c, 64 c + 64) of the half, once both
  // consumers' keys of its dSᵀ are in.
  auto finish_dq = [&](int prev) {
    float dq[32];
    mbar_wait(bar.ready(prev & 1), (prev >> 1) & 1);
    issue_dq<E, 64, kBK>(dq, sdS + (prev & 1) * L::kDSBytes, sK, 64 * c);
    wgmma_wait<0>();
    fence_regs(dq);
    mbar_arrive(bar.done(prev & 1));
    add_dq_tile_v4<64>(p, dq, b, steps.head(prev), steps.row0(prev), DH * half + 64 * c, wq,
                       lane);
  };

  if (total > 0) mbar_wait(bar.kv_full(), 0);
  for (int it = 0; it < total; ++it) {
    // The step's row statistics stage and dSᵀ buffer, and the parity of the
    // parts' it-th fill.
    const int u = it & 1;
    const int h = steps.head(it), i0 = steps.row0(it);
    hm.init(p, b, h, kLog2e);

    // Sᵀ and dPᵀ in the order the parts land (reduction steps 8-15 are the
    // other half's columns, positions 2 and 3; 0-7 the own half's); Pᵀ is
    // computed while the second half of dPᵀ runs.
    fence_regs(st);
    fence_regs(dpt);
    wgmma_fence();
    mbar_wait(bar.full(Bars::kQOther), u);
    ThreadRowStats<kBQ> row_l, row_d;  // L and D, loaded while Sᵀ and dPᵀ run
    row_l.load(sL + u * kBQ, 0, lane);
    issue_score_ksteps<E, kBK, kBQ, kBQ, 8, 16, true>(st, sK, c * 64, sQ, 0);
    mbar_wait(bar.full(Bars::kDOOther), u);
    issue_score_ksteps<E, kBK, kBQ, kBQ, 8, 16, true>(dpt, sV, c * 64, sdO, 0);
    mbar_wait(bar.full(Bars::kQOwn), u);
    issue_score_ksteps<E, kBK, kBQ, kBQ, 0, 8, false>(st, sK, c * 64, sQ, 0);
    wgmma_commit();
    mbar_wait(bar.full(Bars::kDOOwn), u);
    issue_score_ksteps<E, kBK, kBQ, kBQ, 0, 8, false>(dpt, sV, c * 64, sdO, 0);
    wgmma_commit();
    wgmma_wait<1>();
    fence_regs(st);
    mbar_arrive(bar.empty(Bars::kQOther));
    mbar_arrive(bar.empty(Bars::kDOOther));

    const bool one_seg = hm.one_segment(p, b, i0, i0 + kBQ, j0 + key_w0, j0 + key_w0 + 16);
    const bool full_tile =
        hm.tile_in_bounds(i0, i0 + kBQ, j0 + key_w0, j0 + key_w0 + 16) && one_seg;
    row_d.load(sDs + u * kBQ, 0, lane);
    compute_pt<0, 0>(st, hm, p.scale_log2, row_l, i0, j0, key_w0, 0, lane, full_tile, one_seg,
                     nullptr);
    issue_dv<E, DH>(dv, st, sdO);
    wgmma_wait<1>();  // dPᵀ is done; dV may still run
    fence_regs(dpt);
    compute_dst(dpt, st, row_d, 0, lane);
    if constexpr (ATOMIC) {
      if (it >= 2) mbar_wait(bar.done(u), ((it >> 1) - 1) & 1);
      store_key_major<E, kBK>(smem_ptr(sdS + u * L::kDSBytes), dpt, key_w0, 0, lane);
      fence_proxy_async();  // dQ's wgmma reads it through the async proxy
      mbar_arrive(bar.ready(u));
    }
    issue_dk<E, DH>(dk, dpt, sQ);
    wgmma_wait<1>();
    fence_regs(dv);
    mbar_arrive(bar.empty(Bars::kDOOwn));
    wgmma_wait<0>();
    fence_regs(dk);
    mbar_arrive(bar.empty(Bars::kQOwn));

    if constexpr (ATOMIC) {
      if (it > 0) finish_dq(it - 1);
    }
  }
  if constexpr (ATOMIC) {
    if (total > 0) finish_dq(total - 1);
  }

  store_dk_dv<E, DH>(p, dk, dv, b, kvh, j0 + c * 64, DH * half, wq, lane);
#endif  // __CUDA_ARCH_FEAT_SM90_ALL: other targets get an empty kernel, never launched
}

// head_dim 256 by a pair of blocks that share the score products (the
// atomic mode; kernel_choice.h, hopper_bwd_256). It is the fastest D = 256
// backward here (docs/cuda.md has the figures).
// bwd_ws_split_head_kernel's two blocks of a key block each compute all of
// Sᵀ and dPᵀ (a reduction over the whole head dim) and use them for their
// half of dK, dV and dQ: per step 7 products of 128 keys x 64 queries x 128
// where the math needs 5. Here the two blocks are one cluster and split the
// score products instead: rank 0 computes Sᵀ = K Qᵀ and Pᵀ, rank 1
// dPᵀ = V dOᵀ, and each sends the other what it needs by bulk copies into
// the other's shared memory, each warp its 16 keys (2 KB) completing on a
// barrier there:
//   rank 0: Sᵀ -> Pᵀ -> Pᵀ (16-bit, in accumulator order) to rank 1;
//     dV += Pᵀ dO; then, for the step before (so that it never waits for
//     rank 1), dK += dSᵀ Q (both operands in shared memory) and dQ = dS K.
//   rank 1: dPᵀ; with rank 0's Pᵀ, dSᵀ = Pᵀ (dPᵀ - D) -> to rank 0;
//     dV += Pᵀ dO, dK += dSᵀ Q, dQ = dS K.
// Rank r keeps dK, dV and adds dQ (tensor reductions, add_dq_rows_one_box)
// for head-dim columns [128 r, 128 r + 128), and holds only what its
// products read: rank 0 K and Q whole (Q in two slots: a step's Q stays
// until its late dK) and dO's own half; rank 1 V and dO whole and K's and
// Q's own halves. Column blocks are placed as in
// bwd_ws_split_head_kernel (positions 0 and 1 of a whole tile are the
// block's own half).
// The producer refills three parts per step, each once its last reader is
// done: kOther (the score operand's other half: after the score product),
// kOwn (its own half: rank 0's after dK, rank 1's after dV) and kAux (the
// other operand's own half: rank 0's dO after dV, rank 1's Q after dK). Pᵀ
// and dSᵀ have two buffers each: "p_full" (rank 1) / "p_empty" (rank 0)
// pass the Pᵀ buffers, "ds_ready" (both) / "ds_done" (rank 1, where both
// blocks' readers arrive) the dSᵀ buffers.
struct PairBarriers {
  enum Part { kOther, kOwn, kAux, kParts };
  uint32_t base;
  __device__ __forceinline__ uint32_t kv_full() const { return base; }
  // Part `part` of score-operand slot s (rank 1 has one slot; kAux one).
  __device__ __forceinline__ uint32_t full(int part, int s = 0) const {
    return base + 8 * (1 + 2 * part + s);
  }
  __device__ __forceinline__ uint32_t empty(int part, int s = 0) const {
    return base + 8 * (1 + 2 * kParts + 2 * part + s);
  }
  __device__ __forceinline__ uint32_t ds_ready(int u) const {
    return base + 8 * (1 + 4 * kParts + u);
  }
  __device__ __forceinline__ uint32_t ds_done(int u) const {
    return base + 8 * (3 + 4 * kParts + u);
  }
  __device__ __forceinline__ uint32_t p_full(int u) const {
    return base + 8 * (5 + 4 * kParts + u);
  }
  __device__ __forceinline__ uint32_t p_empty(int u) const {
    return base + 8 * (7 + 4 * kParts + u);
  }
  // K and V (rank 1: and K's half) read for the last time: a folded
  // cluster's next key block may be loaded.
  __device__ __forceinline__ uint32_t kv_empty() const { return base + 8 * (9 + 4 * kParts); }
  static constexpr int kCount = 10 + 4 * kParts;
  // Local arrivals are per thread; those from the other block per warp (one
  // lane, after the warp's reads or writes).
  __device__ __forceinline__ void init(int rank) const {
    constexpr int kThreads = kConsumers * 128, kWarps = kConsumers * 4;
    mbar_init(kv_full(), 1);
    mbar_init(kv_empty(), kThreads);
    for (int part = 0; part < kParts; ++part) {
      for (int s = 0; s < 2; ++s) {
        mbar_init(full(part, s), part == kOther ? 32 : 1);
        mbar_init(empty(part, s), kThreads);
      }
    }
    for (int u = 0; u < 2; ++u) {
      mbar_init(ds_ready(u), rank == 0 ? kWarps : kThreads);  // rank 0: each with its bytes
      mbar_init(ds_done(u), kThreads + kWarps);               // rank 1 only
      mbar_init(p_full(u), kWarps);                           // rank 1 only, with the bytes
      mbar_init(p_empty(u), kWarps);                          // rank 0 only
    }
    fence_mbar_init();
  }
};

struct PairLayout {
  static constexpr int D = 256;
  static constexpr int kWholeKVBytes = kBK * D * 2;   // rank 0: K; rank 1: V
  static constexpr int kScoreOpBytes = kBQ * D * 2;   // one slot of Q (rank 0) or dO (rank 1)
  static constexpr int kHalfKVBytes = kBK * D;        // rank 1: K's own half
  static constexpr int kAuxBytes = kBQ * D;           // rank 0: dO's own half; rank 1: Q's
  static constexpr int kDSBytes = kBK * kBQ * 2;      // one dSᵀ buffer: [128 keys][64 queries]
  static constexpr int kPBytes = kBK * kBQ * 2;       // one Pᵀ buffer
  static constexpr int kStatBytes = kBQ * 4;          // one stage of L, or D
  // dQ staging: one 32 x 16 float box per consumer warp (add_dq_rows_one_box)
  static constexpr int kDqBoxBytes = 32 * 16 * 4, kDqBytes = kConsumers * 4 * kDqBoxBytes;
  static_assert(kHalfKVBytes == kScoreOpBytes, "rank 0's second Q slot is rank 1's half K");
  // kSlot1: rank 0's second Q slot, rank 1's half of K.
  static constexpr int kWholeKV = 0, kSlot0 = kWholeKV + kWholeKVBytes,
                       kSlot1 = kSlot0 + kScoreOpBytes, kAux = kSlot1 + kScoreOpBytes,
                       kDS = kAux + kAuxBytes, kP = kDS + 2 * kDSBytes, kDq = kP + 2 * kPBytes,
                       kL = kDq + kDqBytes, kDsum = kL + 2 * kStatBytes,
                       kBars = kDsum + 2 * kStatBytes;
  static constexpr int kSmemBytes = kBars + 8 * PairBarriers::kCount + 1024;  // + slack
  static_assert(kSmemBytes <= 227 * 1024, "more shared memory than a Hopper block has");
};

// Rank 0 sends Pᵀ as float16 whatever E is. P lies in [0, 1],
// where float16 keeps 3 more mantissa bits than bfloat16, and rank 1's
// dSᵀ = Pᵀ (dPᵀ - D) is then nearly as exact as from float32 Pᵀ
// (docs/cuda.md compares the errors).
// Where lane `lane` of consumer warp w (0 .. 7 over both consumers) of rank
// 0 puts 16 bytes v (0 .. 3) of its packed Pᵀ in a Pᵀ buffer, and rank 1's
// same lane reads them: each warp's 2 KB contiguous, for one bulk copy.
__device__ __forceinline__ uint32_t pair_p_offset(int w, int v, int lane) {
  return static_cast<uint32_t>(w * 2048 + v * 512 + lane * 16);
}

// Copies a warp's 2 KB at shared address `src` to the same place in the
// other block of the pair, completing on that block's `bar` (the same
// barrier's local address); lane 0 issues it, after the warp's writes
// (each writing lane has fenced for the async proxy).
__device__ __forceinline__ void send_warp_rows(uint32_t src, uint32_t bar, uint32_t other,
                                               int lane) {
  __syncwarp();
  if (lane == 0) {
    const uint32_t remote_bar = map_to_rank(bar, other);
    mbar_arrive_expect_tx_remote(remote_bar, 2048);
    bulk_copy_to_rank(map_to_rank(src, other), src, 2048, remote_bar);
    bulk_commit();
  }
}

template <class E>
__global__ void __launch_bounds__(kNT, 1)
    bwd_ws_cluster_pair_kernel(const __grid_constant__ BwdTensorMaps maps, const KParams p,
                               const int folded) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using L = PairLayout;
  using Bars = PairBarriers;
  constexpr int DH = 128;  // the block's own columns
  // Each reduction step's descriptors from its whole address (DescBuild).
  constexpr DescBuild kDescs = DescBuild::kPerStep;
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  const uint32_t base = (smem_u32(smem_raw) + 1023) & ~1023u;
  auto smem_ptr = [&](uint32_t addr) { return smem_raw + (addr - smem_u32(smem_raw)); };
  const uint32_t sWholeKV = base + L::kWholeKV, sAux = base + L::kAux;
  const uint32_t sdS = base + L::kDS, sP = base + L::kP;
  float* sL = reinterpret_cast<float*>(smem_ptr(base + L::kL));
  float* sDs = reinterpret_cast<float*>(smem_ptr(base + L::kDsum));
  const Bars bar{base + L::kBars};

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, wg = warp >> 2;
  const int b = blockIdx.z, kvh = blockIdx.y;
  const int rank = static_cast<int>(cluster_rank());  // also the half of the head dim
  const uint32_t other = rank ^ 1;
  // The cluster's key blocks (KeyBlockUnits), cluster m's. Both blocks of
  // the cluster walk the same units and steps; a step's number g counts on
  // over the units, so that every barrier's phases do too. Folded and
  // walked tile by tile, with T = S, nt query tiles of kBQ = 64 rows in all
  // and t counting whole tiles (every head of the group), cluster m is at
  // tile nt - 1 - t in its first unit (key block nkb - 1 - m: 2m + 2
  // tiles), then at tile t - 2 in its second (key block m, from tile 2m
  // on), so the clusters of a KV head read at most two tiles at a time.
  const KeyBlockUnits units(p, static_cast<int>(blockIdx.x >> 1), folded);
  // Unit `unit`'s first key and query steps, for the producer and consumers.
  auto start_unit = [&](int unit, HeadMask& hm, QuerySteps<>& steps) {
    return units.start(unit, p, b, kvh, hm, steps);
  };
  // Step g's score operand is in slot slot(g), filled for the use(g)-th
  // time: rank 0 alternates two slots, rank 1 has one.
  auto slot = [&](int g) { return rank == 0 ? g & 1 : 0; };
  auto use = [&](int g) { return rank == 0 ? g >> 1 : g; };
  auto slot_tile = [&](int s) { return base + (s == 0 ? L::kSlot0 : L::kSlot1); };
  const uint32_t sHalfK = base + L::kSlot1;  // rank 1

  if (tid == 0) bar.init(rank);
  // Both blocks' barriers are initialised before either block's threads
  // arrive on the other's; the last cluster-wide barrier before the end.
  cluster_sync();

  if (wg == 0) {
    setmaxnreg_dec<24>();
    // Exited threads do not hold up the cluster barrier at the end.
    if (warp != 0) return;
    // The producer warp, per unit with steps: rank 0's K (whole), rank 1's
    // V (whole) and K's own half, once the last unit's are read, then each
    // step's three parts, each once its previous use is done, and with
    // kOther the step's L and D into stage g & 1.
    auto load_blocks = [&](uint32_t tile, const CUtensorMap* map, uint32_t full, int rows,
                           int x0, int row, int h) {
      load_half_blocks(tile, map, full, rows, x0, rank, row, h, b);
    };
    const CUtensorMap* whole_kv = rank == 0 ? &maps.k : &maps.v;
    const CUtensorMap* score_op = rank == 0 ? &maps.q : &maps.d_o;
    const CUtensorMap* aux_op = rank == 0 ? &maps.d_o : &maps.q;
    constexpr int kPartBytes = kBQ * 128 * 2;  // two column blocks
    int g0 = 0, loads = 0;  // steps and K/V loads of the units before
    for (int unit = 0; unit < units.count; ++unit) {
      HeadMask hm;
      QuerySteps<> steps;
      const int j0 = start_unit(unit, hm, steps);
      if (steps.total == 0) continue;
      if (loads > 0) mbar_wait(bar.kv_empty(), (loads - 1) & 1);
      ++loads;
      if (lane == 0) {
        mbar_arrive_expect_tx(bar.kv_full(), L::kWholeKVBytes + (rank == 1 ? L::kHalfKVBytes : 0));
        load_blocks(sWholeKV, whole_kv, bar.kv_full(), kBK, 0, j0, kvh);
        load_blocks(sWholeKV, whole_kv, bar.kv_full(), kBK, 2, j0, kvh);
        if (rank == 1) load_blocks(sHalfK, &maps.k, bar.kv_full(), kBK, 0, j0, kvh);
      }
      for (int it = 0; it < steps.total; ++it) {
        const int g = g0 + it;
        const int h = steps.head(it), i0 = steps.row0(it);
        const int s = slot(g), n = use(g);
        if (n > 0) mbar_wait(bar.empty(Bars::kOther, s), (n - 1) & 1);
        float *l = sL + (g & 1) * kBQ, *dsum = sDs + (g & 1) * kBQ;
        load_row_stats(p, b, h, i0, kBQ, lane, l, dsum);
        load_row_stats(p, b, h, i0, kBQ, lane + 32, l, dsum);
        if (lane != 0) mbar_arrive(bar.full(Bars::kOther, s));  // after this lane's statistics
        if (lane == 0) {
          mbar_arrive_expect_tx(bar.full(Bars::kOther, s), kPartBytes);
          load_blocks(slot_tile(s), score_op, bar.full(Bars::kOther, s), kBQ, 2, i0, h);
        }
        if (n > 0) mbar_wait(bar.empty(Bars::kOwn, s), (n - 1) & 1);
        if (lane == 0) {
          mbar_arrive_expect_tx(bar.full(Bars::kOwn, s), kPartBytes);
          load_blocks(slot_tile(s), score_op, bar.full(Bars::kOwn, s), kBQ, 0, i0, h);
        }
        if (g > 0) mbar_wait(bar.empty(Bars::kAux), (g - 1) & 1);
        if (lane == 0) {
          mbar_arrive_expect_tx(bar.full(Bars::kAux), kPartBytes);
          load_blocks(sAux, aux_op, bar.full(Bars::kAux), kBQ, 0, i0, h);
        }
      }
      g0 += steps.total;
    }
    return;
  }

  setmaxnreg_inc<240>();
  const int c = wg - 1, wq = warp & 3, w = warp - 4;  // w: 0 .. 7 over both consumers
  const int key_w0 = c * 64 + wq * 16;  // the warp's 16 keys, relative to j0

  auto dq_box = [&] { return smem_ptr(base + L::kDq + w * L::kDqBoxBytes); };  // dQ staging
  float dk[DH / 2], dv[DH / 2], sc[kBQ / 2];  // sc: rank 0's Sᵀ, Pᵀ; rank 1's dPᵀ, dSᵀ
  uint32_t pt[kBQ / 4];                       // Pᵀ, packed (pack_pairs)
#pragma unroll
  for (int i = 0; i < kBQ / 2; ++i) sc[i] = 0.f;
  float dq[32];

  int g0 = 0, loads = 0;  // steps and K/V loads of the units before
  for (int unit = 0; unit < units.count; ++unit) {
    HeadMask hm;
    QuerySteps<> steps;
    const int j0 = start_unit(unit, hm, steps);
    const int total = steps.total;  // the same in both blocks
#pragma unroll
    for (int i = 0; i < DH / 2; ++i) dk[i] = dv[i] = 0.f;

    // Rank 0: dK += dSᵀ Q and dQ = dS K of step `prev` (issued as two commit
    // groups) once rank 1's dSᵀ has landed; then finish_late() waits for
    // them, frees what they read and adds dQ.
    auto issue_late = [&](int prev) {
      const uint32_t cdS = sdS + (prev & 1) * L::kDSBytes;
      mbar_wait(bar.ds_ready(prev & 1), (prev >> 1) & 1);
      fence_regs(dk);
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < kBQ / 16; ++kk)
        Wgmma<E, DH>::template ss<0, 1>(
            dk, desc_k_major<kBK, kDescs>(cdS, c * 64, kk),
            desc_mn_major<kBQ, kDescs>(slot_tile(slot(prev)), 0, kk), 1);
      wgmma_commit();
      issue_dq<E, 64, kBK, kDescs>(dq, cdS, sWholeKV, 64 * c);
    };
    auto finish_late = [&](int prev) {
      wgmma_wait<1>();
      fence_regs(dk);
      mbar_arrive(bar.empty(Bars::kOwn, slot(prev)));
      wgmma_wait<0>();
      fence_regs(dq);
      __syncwarp();
      if (lane == 0) mbar_arrive_remote(map_to_rank(bar.ds_done(prev & 1), other));
      add_dq_rows_one_box(&maps.dq_acc, dq, dq_box(), b, steps.head(prev - g0),
                          steps.row0(prev - g0), 64 * c, wq, lane);
    };

    if (total > 0) mbar_wait(bar.kv_full(), loads & 1);
    for (int it = 0; it < total; ++it) {
      // The step's row statistics stage, Pᵀ and dSᵀ buffer, and the parity of
      // the buffers' (g / 2)-th use.
      const int g = g0 + it;
      const int u = g & 1;
      const uint32_t use_parity = (g >> 1) & 1;
      const int h = steps.head(it), i0 = steps.row0(it);
      const int s = slot(g);
      const uint32_t parts_parity = use(g) & 1;
      const uint32_t score_tile = slot_tile(s);

      // The score product (rank 0 Sᵀ, rank 1 dPᵀ) in the order the parts land.
      fence_regs(sc);
      wgmma_fence();
      mbar_wait(bar.full(Bars::kOther, s), parts_parity);
      ThreadRowStats<kBQ> row_stat;  // rank 0: L; rank 1: D
      row_stat.load((rank == 0 ? sL : sDs) + u * kBQ, 0, lane);
      issue_score_ksteps<E, kBK, kBQ, kBQ, 8, 16, true, kDescs>(sc, sWholeKV, c * 64,
                                                                score_tile, 0);
      mbar_wait(bar.full(Bars::kOwn, s), parts_parity);
      issue_score_ksteps<E, kBK, kBQ, kBQ, 0, 8, false, kDescs>(sc, sWholeKV, c * 64,
                                                                score_tile, 0);
      wgmma_commit();
      wgmma_wait<0>();
      fence_regs(sc);
      mbar_arrive(bar.empty(Bars::kOther, s));

      if (rank == 0) {
        hm.init(p, b, h, kLog2e);
        const bool one_seg =
            hm.one_segment(p, b, i0, i0 + kBQ, j0 + key_w0, j0 + key_w0 + 16);
        const bool full_tile =
            hm.tile_in_bounds(i0, i0 + kBQ, j0 + key_w0, j0 + key_w0 + 16) && one_seg;
        compute_pt<0, 0>(sc, hm, p.scale_log2, row_stat, i0, j0, key_w0, 0, lane, full_tile,
                         one_seg, nullptr);
        pack_pairs<E, kBQ>(sc, pt);
        uint32_t p_sent[kBQ / 4];  // Pᵀ as float16 pairs (see above pair_p_offset)
        pack_pairs<__half, kBQ>(sc, p_sent);
        // Pᵀ to rank 1 through this block's buffer u: once rank 1 has read its
        // buffer u's previous Pᵀ, and this warp's copy from ours has.
        if (g >= 2) mbar_wait(bar.p_empty(u), use_parity ^ 1);
        if (lane == 0) bulk_wait_read<1>();
        __syncwarp();
        const uint32_t warp_p = sP + u * L::kPBytes + pair_p_offset(w, 0, 0);
        uint8_t* stage = smem_ptr(warp_p);
#pragma unroll
        for (int v = 0; v < 4; ++v)
          *reinterpret_cast<uint4*>(stage + pair_p_offset(0, v, lane)) =
              make_uint4(p_sent[4 * v], p_sent[4 * v + 1], p_sent[4 * v + 2], p_sent[4 * v + 3]);
        fence_proxy_async();  // the bulk copy reads them through the async proxy
        send_warp_rows(warp_p, bar.p_full(u), other, lane);

        mbar_wait(bar.full(Bars::kAux), g & 1);
        issue_dv_packed<E, DH, kBQ, kDescs>(dv, pt, sAux);
        if (it > 0) {
          issue_late(g - 1);
          wgmma_wait<2>();
        } else {
          wgmma_wait<0>();
        }
        fence_regs(dv);
        mbar_arrive(bar.empty(Bars::kAux));
        if (it > 0) finish_late(g - 1);
      } else {
        // Rank 0's Pᵀ of the step: dSᵀ from its float16 values, dV from them
        // rounded to E.
        mbar_wait(bar.p_full(u), use_parity);
        const uint8_t* local_p = smem_ptr(sP + u * L::kPBytes + pair_p_offset(w, 0, 0));
        uint32_t p_got[kBQ / 4];
#pragma unroll
        for (int v = 0; v < 4; ++v) {
          const uint4 x = *reinterpret_cast<const uint4*>(local_p + pair_p_offset(0, v, lane));
          p_got[4 * v] = x.x;
          p_got[4 * v + 1] = x.y;
          p_got[4 * v + 2] = x.z;
          p_got[4 * v + 3] = x.w;
        }
        compute_dst_packed<__half, kBQ>(sc, p_got, row_stat, 0, lane);
#pragma unroll
        for (int m = 0; m < kBQ / 4; ++m) {
          const float2 pair = Cvt<__half>::unpack(p_got[m]);
          pt[m] = Cvt<E>::pack(pair.x, pair.y);
        }
        __syncwarp();  // every lane has used its Pᵀ: the buffer may be refilled
        if (lane == 0) mbar_arrive_remote(map_to_rank(bar.p_empty(u), other));
        // dSᵀ into buffer u, once both blocks are done reading its use two
        // steps ago and this warp's copy of it to rank 0 has read it; then
        // each warp sends its 16 keys to rank 0's buffer u.
        const uint32_t cdS = sdS + u * L::kDSBytes;
        if (g >= 2) mbar_wait(bar.ds_done(u), use_parity ^ 1);
        if (lane == 0) bulk_wait_read<1>();
        __syncwarp();
        store_key_major<E, kBK>(smem_ptr(cdS), sc, key_w0, 0, lane);
        fence_proxy_async();  // this block's dQ wgmma and the bulk copy read them
        mbar_arrive(bar.ds_ready(u));
        send_warp_rows(cdS + key_w0 * 128, bar.ds_ready(u), other, lane);  // 128 bytes a key

        issue_dv_packed<E, DH, kBQ, kDescs>(dv, pt, score_tile);
        // Q's own half (kAux) has landed. Without this wait dK could read
        // the tile before its copy completed, and the producer could arm the
        // barrier for the next step while this step's copy was still
        // pending (an intermittent CUDA error).
        mbar_wait(bar.full(Bars::kAux), g & 1);
        issue_dk<E, DH, kBwdBQ, kDescs>(dk, sc, sAux);
        mbar_wait(bar.ds_ready(u), use_parity);  // both consumers' keys, for dQ
        issue_dq<E, 64, kBK, kDescs>(dq, cdS, sHalfK, 64 * c);
        wgmma_wait<2>();
        fence_regs(dv);
        mbar_arrive(bar.empty(Bars::kOwn));
        wgmma_wait<1>();
        fence_regs(dk);
        mbar_arrive(bar.empty(Bars::kAux));
        wgmma_wait<0>();
        fence_regs(dq);
        mbar_arrive(bar.ds_done(u));
        add_dq_rows_one_box(&maps.dq_acc, dq, dq_box(), b, h, i0, DH + 64 * c, wq, lane);
      }
    }
    if (total > 0) {
      if (rank == 0) {
        issue_late(g0 + total - 1);
        finish_late(g0 + total - 1);
      }
      mbar_arrive(bar.kv_empty());  // every product that reads K or V is done
      ++loads;
    }
    store_dk_dv<E, DH>(p, dk, dv, b, kvh, j0 + c * 64, DH * rank, wq, lane);
    g0 += total;
  }  // unit

  // Every arrival the other block makes here has landed before this block
  // leaves: the last two steps' (rank 0: rank 1 read those Pᵀ; rank 1: both
  // blocks read those dSᵀ), the phases nobody waited for yet.
  for (int g = max(g0 - 2, 0); g < g0; ++g)
    mbar_wait(rank == 0 ? bar.p_empty(g & 1) : bar.ds_done(g & 1), (g >> 1) & 1);
  if (lane == 0) bulk_wait<0>();  // this warp's copies to the other block are done
  // Neither block leaves while the other may still use its shared memory.
  cluster_sync();
#endif  // __CUDA_ARCH_FEAT_SM90_ALL: other targets get an empty kernel, never launched
}

// Tensor maps of the four operands: Q and dO in boxes of a query step's bq
// rows, K and V of a key block's bk.
inline cudaError_t make_bwd_maps(BwdTensorMaps* maps, const KParams& p, int bk, int bq) {
  const int D = p.D;
  if (make_seq_tensor_map(&maps->q, p.q, D, p.T, p.N, p.B, p.q_ss, p.q_hs, p.q_bs, bq) !=
          cudaSuccess ||
      make_seq_tensor_map(&maps->d_o, p.d_o, D, p.T, p.N, p.B, p.q_ss, p.q_hs, p.q_bs, bq) !=
          cudaSuccess ||
      make_seq_tensor_map(&maps->k, p.k, D, p.S, p.K, p.B, p.k_ss, p.k_hs, p.k_bs, bk) !=
          cudaSuccess ||
      make_seq_tensor_map(&maps->v, p.v, D, p.S, p.K, p.B, p.k_ss, p.k_hs, p.k_bs, bk) !=
          cudaSuccess)
    return cudaErrorNotSupported;
  return cudaSuccess;
}

template <class E, int D, bool ATOMIC, int EB = 0, int BQ = kBQ>
cudaError_t launch(const KParams& p, cudaStream_t stream) {
  auto* kernel = bwd_ws_kernel<E, D, ATOMIC, EB, BQ>;
  if (!has_sm90a_code(kernel)) return cudaErrorNotSupported;
  BwdTensorMaps maps;
  if (make_bwd_maps(&maps, p, kBK, BQ) != cudaSuccess) return cudaErrorNotSupported;
  // The dQ scratch in the boxes the kernel reduces: 16 x BQ (a warp's 16
  // columns of dQᵀ) or 32 x 16 (DqSplit).
  constexpr bool kTransposed = DqSplit<D, BQ>::kTransposed;
  if (ATOMIC && make_dq_acc_tensor_map(&maps.dq_acc, p.dq_acc, p.D, p.T, p.N, p.B,
                                       kTransposed ? BQ : 16, kTransposed ? 16 : 32) !=
                    cudaSuccess)
    return cudaErrorNotSupported;
  // Folded (kernel_choice.h), block m does key blocks nkb - 1 - m and m (the
  // kernel says in which order).
  const int nkb = (p.S + kBK - 1) / kBK;
  const int folded = hopper_bwd_folds_key_blocks(p) ? 1 : 0;
  dim3 grid(folded ? (nkb + 1) / 2 : nkb, p.K, p.B);
  return launch_with_smem(kernel, grid, kNT, BwdWsLayout<D, EB, BQ>::kSmemBytes, stream, maps,
                          p, folded);
}

template <class E, bool ATOMIC>
cudaError_t launch_split_head(const KParams& p, cudaStream_t stream) {
  auto* kernel = bwd_ws_split_head_kernel<E, ATOMIC>;
  if (!has_sm90a_code(kernel)) return cudaErrorNotSupported;
  BwdTensorMaps maps;
  if (make_bwd_maps(&maps, p, kBK, kBQ) != cudaSuccess) return cudaErrorNotSupported;
  dim3 grid(2 * ((p.S + kBK - 1) / kBK), p.K, p.B);  // two halves per key block, adjacent
  return launch_with_smem(kernel, grid, kNT, SplitHeadLayout::kSmemBytes, stream, maps, p);
}

// bwd_ws_cluster_pair_kernel: two blocks per key block, one cluster.
template <class E>
cudaError_t launch_cluster_pair(const KParams& p, cudaStream_t stream) {
  auto* kernel = bwd_ws_cluster_pair_kernel<E>;
  if (!has_sm90a_code(kernel)) return cudaErrorNotSupported;
  BwdTensorMaps maps;
  if (make_bwd_maps(&maps, p, kBK, kBQ) != cudaSuccess ||
      make_dq_acc_tensor_map(&maps.dq_acc, p.dq_acc, p.D, p.T, p.N, p.B) != cudaSuccess)
    return cudaErrorNotSupported;
  if (cudaError_t e = allow_smem(kernel, PairLayout::kSmemBytes); e != cudaSuccess) return e;
  cudaLaunchConfig_t config = {};
  // Folded (kernel_choice.h), cluster m does key blocks m and nkb - 1 - m
  // (the kernel says in which order), and the clusters of one head still
  // start together. Unfolded, SMs sat idle for 22% of the kernel's cycles at
  // GQA 16:2 T = 2048 causal (Nsight Compute, SM active cycles).
  const int nkb = (p.S + kBK - 1) / kBK;
  const int folded = hopper_bwd_folds_key_blocks(p) ? 1 : 0;
  config.gridDim = dim3(2 * (folded ? (nkb + 1) / 2 : nkb), p.K, p.B);  // a pair: adjacent blocks
  config.blockDim = dim3(kNT);
  config.dynamicSmemBytes = PairLayout::kSmemBytes;
  config.stream = stream;
  cudaLaunchAttribute cluster;
  cluster.id = cudaLaunchAttributeClusterDimension;
  cluster.val.clusterDim.x = 2;
  cluster.val.clusterDim.y = 1;
  cluster.val.clusterDim.z = 1;
  config.attrs = &cluster;
  config.numAttrs = 1;
  // A GPU (or a slice of one) where no pair of blocks fits: the caller falls
  // back to bwd_ws_split_head_kernel.
  int clusters = 0;
  if (cudaOccupancyMaxActiveClusters(&clusters, kernel, &config) != cudaSuccess ||
      clusters < 1) {
    cudaGetLastError();
    return cudaErrorNotSupported;
  }
  const cudaError_t e = cudaLaunchKernelEx(&config, kernel, maps, p, folded);
  if (e == cudaSuccess) record_launch(kernel);
  return e;
}

template <class E, bool ATOMIC>
cudaError_t launch_d(const KParams& p, cudaStream_t stream) {
  if (p.mask != nullptr || p.bias != nullptr) {
    return launch_staged_bwd(p, [&](auto d, auto eb) {
      return launch<E, decltype(d)::value, ATOMIC, decltype(eb)::value>(p, stream);
    });
  }
  switch (p.D) {
    case 64:
      static_assert(kBQWide == 128, "hopper_bwd_query_rows chooses between 64 and 128");
      return hopper_bwd_query_rows(p) == kBQWide ? launch<E, 64, ATOMIC, 0, kBQWide>(p, stream)
                                                 : launch<E, 64, ATOMIC>(p, stream);
    case 128:
      static_assert(kBQHead128 == 80, "hopper_bwd_query_rows chooses between 64 and 80");
      return hopper_bwd_query_rows(p) == kBQHead128
                 ? launch<E, 128, ATOMIC, 0, kBQHead128>(p, stream)
                 : launch<E, 128, ATOMIC>(p, stream);
    case 256:
      if constexpr (ATOMIC) {
        if (hopper_bwd_256(ATOMIC) == Hopper256Backward::kClusterPair) {
          // Where no pair of blocks fits the GPU: the split head.
          if (cudaError_t e = launch_cluster_pair<E>(p, stream); e != cudaErrorNotSupported)
            return e;
        }
      }
      return launch_split_head<E, ATOMIC>(p, stream);
    default: return cudaErrorNotSupported;
  }
}

}  // namespace

cudaError_t launch_bwd_hopper(const KParams& p, DType dtype, bool atomic_dq,
                              cudaStream_t stream) {
  if (dtype == DType::kBF16) {
    return atomic_dq ? launch_d<__nv_bfloat16, true>(p, stream)
                     : launch_d<__nv_bfloat16, false>(p, stream);
  }
  return atomic_dq ? launch_d<__half, true>(p, stream) : launch_d<__half, false>(p, stream);
}

}  // namespace fatrain::cuda
