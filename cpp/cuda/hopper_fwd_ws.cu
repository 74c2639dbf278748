// Hopper FlashAttention forward with a TMA producer and two consumer
// warpgroups that take turns on the tensor cores (FlashAttention-3's
// warp specialisation and ping-pong; sm_90a only).
//
// A persistent grid (kernel_choice.h, hopper_fwd_grid: one block per SM,
// except with three consumers): each block walks work items, (head, query
// block) pairs, heads outermost (FwdWalk below). Three warpgroups:
//   warpgroup 0, the producer: gives its registers back (setmaxnreg) and one
//     thread loads each item's Q, then its K and V tiles of BK keys into
//     kStages slots with bulk tensor copies (tma.cuh), each completing on
//     the slot's "full" mbarrier; before refilling a slot it waits on its
//     "empty" mbarrier, which every consumer thread arrives on once done
//     with it. The slots run on from one item into the next, so the next
//     item's first K tile, and then its Q (once the consumers' last
//     S = Q Kᵀ freed Q's slot), load while the consumers finish an item.
//   warpgroups 1 and 2, the consumers: query rows [64 c, 64 c + 64) of the
//     block each (c = warpgroup - 1): per key tile, S_t = Q K_tᵀ and
//     O += P_{t-1} V_{t-1} issued together, the softmax of S_t while the
//     second runs. Named barriers order their issues: consumer c
//     issues its products only after the other consumer issued its own, so
//     one warpgroup's softmax runs while the other's products do.
//   At D = 64 without a mask, bias or window (with causality from T = 4096
//     on), three consumers (192-row blocks) take turns round robin, as
//     FlashAttention-3 does at that head dim (kernel_choice.h,
//     hopper_fwd_consumers).
// Tiles past the sequence ends read as zeros (the tensor maps' bounds). A
// mask or 16-bit bias that qualifies for staging (KParams::staged) is copied
// a tile ahead by each consumer for its own 64 rows (cp.async, 16-byte
// chunks; no other warpgroup reads them, so a barrier over the consumer's own
// 128 threads orders the slots); otherwise each score reads its own.
#include "cuda/hopper_fwd_common.cuh"
#include "cuda/kernel_choice.h"
#include "cuda/launch.h"
#include "cuda/tma.cuh"
#include "cuda/wgmma.cuh"

namespace fatrain::cuda {
namespace {

constexpr int kStages = 2;

// A tile's place in the kStages-slot ring of K (or V) tiles: its slot and the
// parity of the slot's fill, stepped tile by tile. The fills of slot s are
// numbered u = 0, 1, ...; the consumers wait for fill u on the full barrier
// with parity u & 1 (phase), the producer for the consumers' release of fill
// u - 1 on the empty barrier with parity (u - 1) & 1 = phase ^ 1, which a
// fresh barrier, still in its first phase, reports as done for u = 0.
struct RingPos {
  uint32_t slot = 0, phase = 0;
  __device__ __forceinline__ void step() {
    if (++slot == kStages) {
      slot = 0;
      phase ^= 1u;
    }
  }
};

struct FwdTensorMaps {
  CUtensorMap q, k, v;
};

// EB: bytes per element of a staged mask (1) or bias (2), 0 for none.
// CONSUMERS: consumer warpgroups, 64 query rows each (2; 3 at D = 64, see
// hopper_fwd_consumers); with 3 the block has 512 threads and a consumer's
// register budget drops to 160 (the producer's 24 plus 3 x 160 fit the
// 4 x 128 the block starts with).
template <int D_, int BK_, int EB_ = 0, int CONSUMERS_ = 2>
struct WsTile {
  static constexpr int D = D_, BK = BK_, EB = EB_;
  static constexpr int kConsumers = CONSUMERS_, kBQ = 64 * kConsumers;
  static constexpr int kNT = 128 * (kConsumers + 1);
  static constexpr int kConsumerRegs = kConsumers == 2 ? 240 : 160;
  static_assert(kConsumers == 2 || (kConsumers == 3 && EB == 0),
                "three consumers: no room for staged score slots");
  static constexpr int kQBytes = kBQ * D * 2, kKVBytes = BK * D * 2;
  static constexpr int kScoreSlotBytes = EB == 0 ? 0 : kBQ * staged_row_bytes<BK, EB>();
  // Q; kStages slots of K and of V; 2 slots of staged scores; 2 + 4 kStages
  // mbarriers; alignment slack.
  static constexpr int kSmemBytes =
      kQBytes + 2 * kStages * kKVBytes + 2 * kScoreSlotBytes + 8 * (2 + 4 * kStages) + 1024;
  static_assert(kSmemBytes <= 227 * 1024, "more shared memory than a Hopper block has");
};

// The work items of the persistent forward (kernel_choice.h,
// hopper_fwd_folds_query_blocks): item w is head w / per_head (the heads of
// batch 0 first) and pair m = w % per_head of its query blocks. Unfolded, the
// item is query block blocks - 1 - m; folded, query block blocks - 1 - m and
// then block m (once where the two coincide). A block takes items
// blockIdx.x, blockIdx.x + gridDim.x, ...; its producer and its consumers
// walk the same sequence.
template <int kBQ>
struct FwdWalk {
  int blocks, per_head, items, heads;
  bool fold;
  int w;       // the current item
  bool second;  // folded: its second query block is the current one

  __device__ __forceinline__ explicit FwdWalk(const KParams& p) {
    blocks = (p.T + kBQ - 1) / kBQ;
    fold = hopper_fwd_folds_query_blocks(p);
    per_head = fold ? (blocks + 1) / 2 : blocks;
    heads = p.N;
    items = p.B * p.N * per_head;
    w = blockIdx.x;
    second = false;
  }
  __device__ __forceinline__ bool valid() const { return w < items; }
  // The current query block: batch b, head n, first row i0.
  __device__ __forceinline__ void get(int* b, int* n, int* i0) const {
    const int head = w / per_head, m = w - head * per_head;
    *b = head / heads;
    *n = head - *b * heads;
    *i0 = (second ? m : blocks - 1 - m) * kBQ;
  }
  __device__ __forceinline__ void advance() {
    const int m = w % per_head;
    if (fold && !second && m != blocks - 1 - m) {
      second = true;
    } else {
      second = false;
      w += gridDim.x;
    }
  }
};

// Tile::EB > 0: the mask or bias is staged (see the top of the file).
// LOADED (with EB = 0): a mask or bias is read one score at a time; neither:
// the problem has no mask or bias. SEGS: the problem may have segment ids
// (launch_e chooses: false only where it has none, so that such problems
// skip the per-tile segment test).
template <class E, class Tile, bool LOADED, bool SEGS>
__global__ void __launch_bounds__(Tile::kNT, 1)
    fwd_ws_kernel(const __grid_constant__ FwdTensorMaps maps, const KParams p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr int D = Tile::D, BK = Tile::BK, EB = Tile::EB;
  constexpr int kConsumers = Tile::kConsumers, kBQ = Tile::kBQ;
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  const uint32_t sQ = (smem_u32(smem_raw) + 1023) & ~1023u;
  const uint32_t sK = sQ + Tile::kQBytes;
  const uint32_t sV = sK + kStages * Tile::kKVBytes;
  const uint32_t sScore = sV + kStages * Tile::kKVBytes;  // 2 slots, when EB > 0
  const uint32_t bars = sScore + 2 * Tile::kScoreSlotBytes;
  const uint32_t q_full = bars, q_empty = bars + 8;
  auto k_full = [&](uint32_t s) { return bars + 8 * (2 + s); };
  auto v_full = [&](uint32_t s) { return bars + 8 * (2 + kStages + s); };
  auto k_empty = [&](uint32_t s) { return bars + 8 * (2 + 2 * kStages + s); };
  auto v_empty = [&](uint32_t s) { return bars + 8 * (2 + 3 * kStages + s); };

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int wg = warp >> 2;

  if (tid == 0) {
    mbar_init(q_full, 1);
    mbar_init(q_empty, kConsumers * 128);
    for (int s = 0; s < kStages; ++s) {
      mbar_init(k_full(s), 1);
      mbar_init(v_full(s), 1);
      mbar_init(k_empty(s), kConsumers * 128);
      mbar_init(v_empty(s), kConsumers * 128);
    }
    fence_mbar_init();
  }
  __syncthreads();  // the last block-wide barrier: producer threads exit early

  if (wg == 0) {
    setmaxnreg_dec<24>();
    if (tid != 0) return;
    // The K and V rings run on across the block's items (RingPos); Q's one
    // slot is filled once per item (item counts them).
    RingPos kpos, vpos;
    auto load_k = [&](int j0, int kvh, int b) {
      const uint32_t s = kpos.slot;
      mbar_wait(k_empty(s), kpos.phase ^ 1u);
      mbar_arrive_expect_tx(k_full(s), Tile::kKVBytes);
      for (int cb = 0; cb < D / 64; ++cb)
        tma_load_4d(sK + s * Tile::kKVBytes + cb * BK * 128, &maps.k, k_full(s), 64 * cb, j0,
                    kvh, b);
      kpos.step();
    };
    auto load_v = [&](int j0, int kvh, int b) {
      const uint32_t s = vpos.slot;
      mbar_wait(v_empty(s), vpos.phase ^ 1u);
      mbar_arrive_expect_tx(v_full(s), Tile::kKVBytes);
      for (int cb = 0; cb < D / 64; ++cb)
        tma_load_4d(sV + s * Tile::kKVBytes + cb * BK * 128, &maps.v, v_full(s), 64 * cb, j0,
                    kvh, b);
      vpos.step();
    };
    int item = 0;
    for (FwdWalk<kBQ> walk(p); walk.valid(); walk.advance(), ++item) {
      int b, n, i0;
      walk.get(&b, &n, &i0);
      const int kvh = n / (p.N / p.K);
      HeadMask hm;
      hm.init(p, b, n, kLog2e);
      int t_begin, n_tiles;
      hm.key_tiles(p, b, i0, min(i0 + kBQ, p.T), BK, &t_begin, &n_tiles);
      // The item's first K tile goes before its Q: K's slot frees as the
      // consumers finish the previous item's second-to-last tile, Q's only
      // after their last S = Q Kᵀ.
      if (n_tiles > 0) load_k(t_begin * BK, kvh, b);
      if (item > 0) mbar_wait(q_empty, (item - 1) & 1);
      mbar_arrive_expect_tx(q_full, Tile::kQBytes);
      for (int cb = 0; cb < D / 64; ++cb)
        tma_load_4d(sQ + cb * kBQ * 128, &maps.q, q_full, 64 * cb, i0, n, b);
      for (int t = 0; t < n_tiles; ++t) {
        const int j0 = (t_begin + t) * BK;
        if (t > 0) load_k(j0, kvh, b);
        load_v(j0, kvh, b);
      }
    }
    return;
  }

  setmaxnreg_inc<Tile::kConsumerRegs>();
  // Named barriers 1 .. kConsumers: the consumers' turns.
  constexpr int kTurnBarrier0 = 1;
  // The warp's index as a uniform value (warp_index_uniform), so that Q's
  // wgmma descriptors stay in uniform registers through the tile loop.
  const int uwarp = warp_index_uniform();
  const int c = (uwarp >> 2) - 1, wq = uwarp & 3;
  // Consumer c issues after consumer c - 1 (round robin): it waits on its
  // own turn barrier and arrives on the next consumer's.
  const int my_turn = kTurnBarrier0 + c;
  const int next_turn = kConsumers == 2          ? kTurnBarrier0 + 1 - c
                         : c + 1 == kConsumers ? kTurnBarrier0
                                                  : kTurnBarrier0 + c + 1;
  // The turns run on across items, tile after tile. Consumer 0 issues first;
  // every later issue waits for the previous consumer's. Each issue arrives
  // on the next consumer's barrier, and the last consumer arrives once ahead
  // on consumer 0's, so consumer 0 takes one extra turn after its last item
  // to absorb the last consumer's last arrival.
  if (c == kConsumers - 1) named_bar_arrive(kTurnBarrier0, 2 * 128);

  // Staged scores: this consumer's 64 rows of tile t sit in slot t & 1;
  // tile t + 1 is copied while tile t computes.
  constexpr int kStageBarrier0 = kTurnBarrier0 + kConsumers;  // then one per consumer
  const int consumer_tid = tid - 128 * wg;

  // The step-0 descriptors of this consumer's 64 rows of Q and of ring slot
  // 0's K and V tiles, built once: a tile's are these moved on by its slot's
  // offset (desc_advance), and each reduction step's by the step's.
  // Read through a shuffle (uniform_value), so that ptxas keeps them in
  // uniform registers rather than rebuilding them from the shared-memory
  // base before every tile's products.
  const uint64_t q_desc = uniform_value(desc_k_major<kBQ>(sQ, c * 64, 0));
  const uint64_t k_desc = uniform_value(desc_k_major<BK>(sK, 0, 0));
  const uint64_t v_desc = uniform_value(desc_mn_major<BK>(sV, 0, 0));

  RingPos pos;  // the ring position of the next K tile, run on across items
  int item = 0;
  for (FwdWalk<kBQ> walk(p); walk.valid(); walk.advance(), ++item) {
    int b, n, i0;
    walk.get(&b, &n, &i0);
    HeadMask hm;
    hm.init(p, b, n, kLog2e);
    int t_begin, n_tiles;
    hm.key_tiles(p, b, i0, min(i0 + kBQ, p.T), BK, &t_begin, &n_tiles);
    const int warp_row0 = i0 + c * 64 + wq * 16;  // the warp's 16 rows
    const int row0 = warp_row0 + (lane >> 2);     // this thread's rows: row0, row0 + 8

    // The key tiles that need no bounds for this warp's 16 rows (tile
    // t_begin + t for t in [full_first, full_first + full_count)).
    int full_lo, full_hi;
    hm.full_key_tiles<EB>(warp_row0, warp_row0 + 16, BK, &full_lo, &full_hi);
    const int full_first = full_lo - t_begin;
    const uint32_t full_count = static_cast<uint32_t>(max(full_hi - full_lo, 0));

    float o[D / 2], s[BK / 2];
    uint32_t pv[BK / 4];
    float m[2], l[2];
    init_fwd_state<D, BK>(o, s, pv, m, l);

    auto stage_scores = [&](int t) {
      if constexpr (EB > 0)
        stage_score_tile<64, BK, EB, 128>(
            p, b, n,
            sScore + (t & 1) * Tile::kScoreSlotBytes + c * 64 * staged_row_bytes<BK, EB>(),
            i0 + c * 64, (t_begin + t) * BK, consumer_tid);
    };
    if constexpr (EB > 0) {
      // Every thread of this consumer is done reading the previous item's
      // slots.
      if (item > 0) named_bar_sync(kStageBarrier0 + c, 128);
      if (n_tiles > 0) stage_scores(0);
      cp_async_commit();
    }

    mbar_wait(q_full, item & 1);
    if (n_tiles == 0) mbar_arrive(q_empty);
    RingPos prev;  // tile t - 1's (V's) ring position, for t > 0
    for (int t = 0; t < n_tiles; ++t) {
      const int j0 = (t_begin + t) * BK;
      const uint32_t s_cur = pos.slot, s_prev = prev.slot;
      // Read before the products, so that the table reads' latency hides
      // behind them.
      const bool one_seg = !SEGS || hm.one_segment(p, b, warp_row0, warp_row0 + 16, j0, j0 + BK);
      if constexpr (EB > 0) {
        cp_async_wait<0>();
        // This consumer's copies of tile t landed, and its threads are all done
        // with tile t - 1's slot, which tile t + 1 now takes.
        named_bar_sync(kStageBarrier0 + c, 128);
        if (t + 1 < n_tiles) stage_scores(t + 1);
        cp_async_commit();
      }
      mbar_wait(k_full(s_cur), pos.phase);
      if (t > 0) mbar_wait(v_full(s_prev), prev.phase);

      named_bar_sync(my_turn, 2 * 128);
      fence_regs(s);
      fence_regs(o);
      fence_regs(pv);
      wgmma_fence();
      issue_qk<E, D, BK, kBQ>(s, q_desc, desc_advance(k_desc, s_cur * (Tile::kKVBytes / 16)));
      // (No branch may sit between the issue and the wait other than this one:
      // ptxas serialises wgmma across compiler-inserted fences in divergent code.)
      if (t > 0) {
        issue_pv<E, D, BK>(o, pv, desc_advance(v_desc, s_prev * (Tile::kKVBytes / 16)));
        named_bar_arrive(next_turn, 2 * 128);
        wgmma_wait<1>();
      } else {
        named_bar_arrive(next_turn, 2 * 128);
        wgmma_wait<0>();
      }
      fence_regs(s);
      mbar_arrive(k_empty(s_cur));  // S_t is done with K_t
      if (t == n_tiles - 1) mbar_arrive(q_empty);  // and the item's last with Q

      const bool full = static_cast<uint32_t>(t - full_first) < full_count && one_seg;
      float alpha[2];
      const uint8_t* staged_row0 = nullptr;
      if constexpr (EB > 0)
        staged_row0 = smem_raw + (sScore + (t & 1) * Tile::kScoreSlotBytes - smem_u32(smem_raw)) +
                      (row0 - i0) * staged_row_bytes<BK, EB>();
      online_softmax_tile<BK, EB, LOADED>(s, m, l, alpha, hm, p.scale_log2, full, one_seg, row0,
                                          j0, lane, staged_row0);

      wgmma_wait<0>();
      fence_regs(o);
      fence_regs(pv);
      if (t > 0) mbar_arrive(v_empty(s_prev));  // O += P V is done with V_{t-1}
      rescale_o_keep_p<E, D, BK>(o, alpha, s, pv);
      prev = pos;
      pos.step();
    }
    if (n_tiles > 0) {
      const uint32_t s_last = prev.slot;
      mbar_wait(v_full(s_last), prev.phase);
      fence_regs(o);
      fence_regs(pv);
      wgmma_fence();
      issue_pv<E, D, BK>(o, pv, desc_advance(v_desc, s_last * (Tile::kKVBytes / 16)));
      wgmma_wait<0>();
      fence_regs(o);
      fence_regs(pv);
      mbar_arrive(v_empty(s_last));
    }
    store_o_lse<E, D>(p, o, m, l, b, n, row0, lane);
  }
  if (c == 0) named_bar_sync(kTurnBarrier0, 2 * 128);
#endif  // __CUDA_ARCH_FEAT_SM90_ALL: other targets get an empty kernel, never launched
}

template <class E, class Tile, bool LOADED, bool SEGS>
cudaError_t launch(const KParams& p, cudaStream_t stream) {
  auto* kernel = fwd_ws_kernel<E, Tile, LOADED, SEGS>;
  if (!has_sm90a_code(kernel)) return cudaErrorNotSupported;
  FwdTensorMaps maps;
  const int D = Tile::D;
  constexpr int kBQ = Tile::kBQ;
  if (make_seq_tensor_map(&maps.q, p.q, D, p.T, p.N, p.B, p.q_ss, p.q_hs, p.q_bs, kBQ) !=
          cudaSuccess ||
      make_seq_tensor_map(&maps.k, p.k, D, p.S, p.K, p.B, p.k_ss, p.k_hs, p.k_bs, Tile::BK) !=
          cudaSuccess ||
      make_seq_tensor_map(&maps.v, p.v, D, p.S, p.K, p.B, p.k_ss, p.k_hs, p.k_bs, Tile::BK) !=
          cudaSuccess)
    return cudaErrorNotSupported;
  const int64_t blocks = (p.T + kBQ - 1) / kBQ;
  const int64_t items = static_cast<int64_t>(p.B) * p.N *
                        (hopper_fwd_folds_query_blocks(p) ? (blocks + 1) / 2 : blocks);
  if (items > INT_MAX) return cudaErrorNotSupported;
  int device = 0, sms = 0;
  if (cudaError_t e = cudaGetDevice(&device); e != cudaSuccess) return e;
  if (cudaError_t e = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
      e != cudaSuccess)
    return e;
  const dim3 grid(hopper_fwd_grid(p, items, sms));
  return launch_with_smem(kernel, grid, Tile::kNT, Tile::kSmemBytes, stream, maps, p);
}

// The tiles hopper_fwd_consumers and hopper_fwd_key_tile choose.
template <class E, bool LOADED, bool SEGS>
cudaError_t launch_d(const KParams& p, cudaStream_t stream) {
  switch (p.D) {
    case 64:
      if constexpr (!LOADED) {
        if (hopper_fwd_consumers(p) == 3)
          return launch<E, WsTile<64, 128, 0, 3>, false, SEGS>(p, stream);
      }
      return launch<E, WsTile<64, 128>, LOADED, SEGS>(p, stream);
    case 128:
      if constexpr (!LOADED) {
        if (hopper_fwd_key_tile(p, false) == 176)
          return launch<E, WsTile<128, 176>, false, SEGS>(p, stream);
      }
      return launch<E, WsTile<128, 128>, LOADED, SEGS>(p, stream);
    case 256:
      if constexpr (!LOADED) {
        if (hopper_fwd_key_tile(p, false) == 80)
          return launch<E, WsTile<256, 80>, false, SEGS>(p, stream);
      }
      return launch<E, WsTile<256, 64>, LOADED, SEGS>(p, stream);
    default: return cudaErrorNotSupported;
  }
}

// A staged mask or bias: the default tiles where its two slots fit in shared
// memory; a bias at D = 128 takes 64-key tiles (two 128 x 128 bias slots do
// not fit beside 128-key K and V stages), and at D = 256 only a mask fits, so
// a bias there is read one score at a time. Never with segment ids
// (staged_score_bytes in attention_cuda.cu stages nothing then).
template <class E>
cudaError_t launch_staged(const KParams& p, cudaStream_t stream) {
  if (p.staged == 1 && p.D == 64) return launch<E, WsTile<64, 128, 1>, false, false>(p, stream);
  if (p.staged == 2 && p.D == 64) return launch<E, WsTile<64, 128, 2>, false, false>(p, stream);
  if (p.staged == 1 && p.D == 128) return launch<E, WsTile<128, 128, 1>, false, false>(p, stream);
  if (p.staged == 2 && p.D == 128) return launch<E, WsTile<128, 64, 2>, false, false>(p, stream);
  if (p.staged == 1 && p.D == 256) return launch<E, WsTile<256, 64, 1>, false, false>(p, stream);
  return launch_d<E, true, true>(p, stream);
}

// The instances, chosen here alone: a staged mask or bias; a mask or bias
// read score by score, segment ids tested at run time (one instance per
// tile); else without a mask or bias, one instance for problems with segment
// ids and one, whose tiles skip the segment test, for problems without.
template <class E>
cudaError_t launch_e(const KParams& p, cudaStream_t stream) {
  if (p.staged != 0) return launch_staged<E>(p, stream);
  if (fwd_needs_general_softmax(p)) return launch_d<E, true, true>(p, stream);
  return p.q_seg != nullptr ? launch_d<E, false, true>(p, stream)
                            : launch_d<E, false, false>(p, stream);
}

}  // namespace

cudaError_t launch_fwd_hopper(const KParams& p, DType dtype, cudaStream_t stream) {
  return dtype == DType::kBF16 ? launch_e<__nv_bfloat16>(p, stream)
                               : launch_e<__half>(p, stream);
}

}  // namespace fatrain::cuda
