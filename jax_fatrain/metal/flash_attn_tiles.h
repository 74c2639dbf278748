// Threadgroup-memory staging shared by the Metal attention kernels.
//
// A tile is `rows` rows of a [seq, head_dim] matrix held in threadgroup memory
// row-major with a padded row length LD = D + kTilePad elements. The pad
// shifts consecutive rows by 4 (16-bit) or 8 (f32) banks, so the 8x8
// simdgroup_load of a fragment - plain or transposed (K^T) - spreads its 64
// elements over all 32 banks instead of hitting a few banks 8 times.
//
// Loads and stores between device and threadgroup memory are cooperative: the
// kThreads threads of the threadgroup move 4-element vectors, vector v =
// thread + i * kThreads, row v / (D / 4); consecutive lanes read consecutive
// 8-byte (16-bit types) or 16-byte (f32) vectors along the head dim, so one
// simdgroup-wide load covers whole 128-byte cache lines, and each vector is
// one threadgroup store (or load) too. Device row starts must be 4-element
// aligned (the dispatch plan requires strides that are multiples of 4); tile
// rows are, since D and kTilePad are multiples of 4.
#pragma once

#include "flash_attn_common.h"

static constant constexpr const int kThreads = kThreadgroupThreads;
static constant constexpr const int kTilePad = 8;
// Two threadgroups per GPU core: Apple GPUs have about 60 KiB of threadgroup
// memory per core (Apple7-9), so a kernel uses at most 30 KiB.
static constant constexpr const int kMaxThreadgroupBytes = 30 * 1024;

// 4-element vector of T (bfloat4, half4, float4; bool4 for boolean masks).
template <typename T> struct Vec4Of;
template <> struct Vec4Of<bfloat> { typedef bfloat4 type; };
template <> struct Vec4Of<half> { typedef half4 type; };
template <> struct Vec4Of<float> { typedef float4 type; };
template <> struct Vec4Of<bool> { typedef bool4 type; };
template <typename T> using vec4_t = typename Vec4Of<T>::type;

// This thread's share of a [ROWS, D] tile in registers (ROWS * D / (4 *
// kThreads) vectors: 8 to 16 32-bit registers for the kernels' key tiles).
// A kernel issues the device loads of its next tile into these registers
// before the math on the current tiles (tile_fetch) and stores them to
// threadgroup memory after it (tile_put), so the loads' latency overlaps the
// math instead of stalling the threads that wait for them.
template <typename T, int ROWS, int D>
struct TileRegs {
  vec4_t<T> v[ROWS * D / (4 * kThreads)];
};

// Loads rows [row0, row0 + ROWS) of a device matrix (row stride `stride`
// elements, head dim contiguous) into registers; rows >= n_valid are zeros
// (never left uninitialised: a NaN in a padded row would reach the outputs
// through 0 * NaN).
template <typename T, int ROWS, int D>
inline void tile_fetch(thread TileRegs<T, ROWS, D>& r, const device T* src, long stride, int row0,
                       int n_valid, int tix) {
  typedef vec4_t<T> V;
  constexpr int kVecsPerRow = D / 4;
  static_assert((ROWS * kVecsPerRow) % kThreads == 0, "tile must split evenly over the threads");
#pragma clang loop unroll(full)
  for (int i = 0; i < ROWS * kVecsPerRow / kThreads; ++i) {
    const int v = i * kThreads + tix;
    const int row = v / kVecsPerRow;
    const int c = (v % kVecsPerRow) * 4;
    r.v[i] = V(T(0));
    if (row < n_valid) r.v[i] = *((const device V*)(src + (long(row0 + row) * stride + c)));
  }
}

// Stores fetched rows into the tile dst[ROWS][LD], one vector store each.
template <typename T, int ROWS, int D, int LD>
inline void tile_put(threadgroup T* dst, thread const TileRegs<T, ROWS, D>& r, int tix) {
  typedef vec4_t<T> V;
  constexpr int kVecsPerRow = D / 4;
  static_assert(LD % 4 == 0, "tile rows must be vector-aligned");
#pragma clang loop unroll(full)
  for (int i = 0; i < ROWS * kVecsPerRow / kThreads; ++i) {
    const int v = i * kThreads + tix;
    *((threadgroup V*)(dst + (v / kVecsPerRow) * LD + (v % kVecsPerRow) * 4)) = r.v[i];
  }
}

// tile_fetch and tile_put at once (tiles loaded before a barrier with no
// math to overlap: Q and dO).
template <typename T, int ROWS, int D, int LD>
inline void tile_load(threadgroup T* dst, const device T* src, long stride, int row0, int n_valid,
                      int tix) {
  TileRegs<T, ROWS, D> r;
  tile_fetch<T, ROWS, D>(r, src, stride, row0, n_valid, tix);
  tile_put<T, ROWS, D, LD>(dst, r, tix);
}

// Copies tile rows [0, n_valid) to device rows [row0, row0 + n_valid).
template <typename T, int ROWS, int D, int LD>
inline void tile_store(device T* dst, long stride, int row0, int n_valid,
                       const threadgroup T* src, int tix) {
  typedef vec4_t<T> V;
  constexpr int kVecsPerRow = D / 4;
  static_assert((ROWS * kVecsPerRow) % kThreads == 0, "tile must split evenly over the threads");
  static_assert(LD % 4 == 0, "tile rows must be vector-aligned");
#pragma clang loop unroll(full)
  for (int i = 0; i < ROWS * kVecsPerRow / kThreads; ++i) {
    const int v = i * kThreads + tix;
    const int r = v / kVecsPerRow;
    const int c = (v % kVecsPerRow) * 4;
    if (r < n_valid) {
      *((device V*)(dst + (long(row0 + r) * stride + c))) =
          *((const threadgroup V*)(src + r * LD + c));
    }
  }
}

inline long min64(long a, long b) { return a < b ? a : b; }
inline long max64(long a, long b) { return a > b ? a : b; }

// The keys [x, y) that query rows [row_first, row_last] can see through
// causal / window / length limits (y <= x: none). Masks are not considered.
template <typename MaskT, bool kBoolMask>
inline int2 visible_keys(thread const ScoreCtx<MaskT, kBoolMask>& c, int row_first, int row_last) {
  if (row_first >= c.q_limit) return int2(0, 0);
  row_last = min(row_last, c.q_limit - 1);
  // 64-bit bounds: row + window may exceed the int range.
  long begin = 0;
  long end = c.k_limit;
  if (c.causal) end = min64(end, long(row_last) + c.ql_off + 1);
  if (c.window && c.window_right >= 0) end = min64(end, long(row_last) + c.window_right + 1);
  if (c.window && c.window_left >= 0) begin = max64(begin, long(row_first) - c.window_left);
  return int2(int(begin), int(max64(begin, end)));
}

// The score operands of one key step, staged in threadgroup memory once per
// step so that scores read them there instead of from device memory per
// element: the mask of the BQ query rows x BK keys (the tile of
// flash_attn_abi.h's mask_tile_bytes, bound at FATRAIN_TG_MASK_TILE) and the
// BK keys' segment ids (BK * 4 bytes). The dK/dV kernels stage the mask tile
// of each (query head, query tile) the same way (mask_tile_fetch / put).

// This thread's share of a mask tile in registers: BQ query rows x BK keys
// as 4-element vectors, NT threads (the dK/dV kernels have more than
// kThreads). Fetched with a K, V (or Q, dO) tile, stored after the math that
// follows.
template <typename MaskT, int BQ, int BK, int NT = kThreads>
struct MaskTileRegs {
  vec4_t<MaskT> mask[(BQ * BK / 4 + NT - 1) / NT];
};

// This thread's share of a key step's score operands in registers: the mask
// tile and one key's segment id.
template <typename MaskT, int BQ, int BK>
struct ScoreTileRegs {
  MaskTileRegs<MaskT, BQ, BK> m;
  int kv_id;  // the segment id of key kb + tix (threads tix < BK)
};

// Loads the mask of query rows [q0, q0 + BQ) x keys [kb, kb + BK) (when
// c.use_mask) with 4-element vectors, consecutive threads on consecutive
// vectors along a row. Vectors whose keys no row of theirs can see (lengths,
// causal, window), and those past the limits, are zeros and not read; where
// rows are not 4-element aligned (odd strides of a broadcast mask) or the
// keys end inside a vector, its elements are read one by one.
template <typename MaskT, bool kBoolMask, int BQ, int BK, int NT = kThreads>
inline void mask_tile_fetch(thread MaskTileRegs<MaskT, BQ, BK, NT>& r,
                            thread const ScoreCtx<MaskT, kBoolMask>& c, int q0, int kb, int tix) {
  typedef vec4_t<MaskT> V;
  constexpr int kVecs = BQ * BK / 4;
  constexpr int kPerThread = (kVecs + NT - 1) / NT;
  static_assert(BK % 4 == 0, "mask tile shape");
  if (c.use_mask) {
#pragma clang loop unroll(full)
    for (int i = 0; i < kPerThread; ++i) {
      const int v = i * NT + tix;
      const int q = q0 + v / (BK / 4);
      const int k = kb + (v % (BK / 4)) * 4;
      const int2 seen = visible_keys(c, q, q);  // keys row q can see (none past q_limit)
      if (kVecs % NT != 0 && v >= kVecs) {
        // No vector for this thread (mask_tile_put skips it too).
      } else if (k < seen.y && k + 4 > seen.x) {
        const device MaskT* src = c.mask + (c.mask_base + long(q) * c.mask_row_stride + k);
        if (c.mask_vec4 && k + 4 <= c.k_limit) {
          r.mask[i] = *((const device V*)src);
        } else {
          r.mask[i] = V(MaskT(0));
#pragma clang loop unroll(full)
          for (int e = 0; e < 4; ++e) {
            if (k + e < c.k_limit) r.mask[i][e] = src[e];
          }
        }
      } else {
        r.mask[i] = V(MaskT(0));
      }
    }
  }
}

// Stores a fetched mask tile into ms[BQ][LDM], one vector store each.
template <typename MaskT, bool kBoolMask, int BQ, int BK, int LDM, int NT = kThreads>
inline void mask_tile_put(threadgroup MaskT* ms, thread const MaskTileRegs<MaskT, BQ, BK, NT>& r,
                          thread const ScoreCtx<MaskT, kBoolMask>& c, int tix) {
  typedef vec4_t<MaskT> V;
  constexpr int kVecs = BQ * BK / 4;
  static_assert(LDM % 4 == 0, "mask tile rows must be vector-aligned");
  if (c.use_mask) {
#pragma clang loop unroll(full)
    for (int i = 0; i < (kVecs + NT - 1) / NT; ++i) {
      const int v = i * NT + tix;
      if (kVecs % NT == 0 || v < kVecs) {
        *((threadgroup V*)(ms + (v / (BK / 4)) * LDM + (v % (BK / 4)) * 4)) = r.mask[i];
      }
    }
  }
}

// The mask tile (mask_tile_fetch) and key kb + tix's segment id (c.segments).
template <typename MaskT, bool kBoolMask, int BQ, int BK>
inline void score_tile_fetch(thread ScoreTileRegs<MaskT, BQ, BK>& r,
                             thread const ScoreCtx<MaskT, kBoolMask>& c, int q0, int kb, int tix) {
  static_assert(BK <= kThreads, "one key id per thread");
  mask_tile_fetch<MaskT, kBoolMask, BQ, BK>(r.m, c, q0, kb, tix);
  r.kv_id = 0;
  if (c.segments && tix < BK && kb + tix < c.k_limit) r.kv_id = c.kv_seg[kb + tix];
}

// Stores fetched score operands: the mask tile ms[BQ][LDM], the ids kv_ids[BK].
template <typename MaskT, bool kBoolMask, int BQ, int BK, int LDM>
inline void score_tile_put(threadgroup MaskT* ms, threadgroup int* kv_ids,
                           thread const ScoreTileRegs<MaskT, BQ, BK>& r,
                           thread const ScoreCtx<MaskT, kBoolMask>& c, int tix) {
  mask_tile_put<MaskT, kBoolMask, BQ, BK, LDM>(ms, r.m, c, tix);
  if (c.segments && tix < BK) kv_ids[tix] = r.kv_id;
}

// Segment ids: the smallest and largest of ids[first .. first + n) (1 <= n
// <= 32), each lane reading one; uniform across the simdgroup, so every
// simdgroup of a threadgroup computes the same range without a barrier.
inline int2 segment_range_of(int id) { return int2(simd_min(id), simd_max(id)); }
inline int2 segment_range(const device int* ids, int first, int n, uint lane) {
  return segment_range_of(ids[first + int(lane) % n]);
}

// The same for n <= 32 * N ids, N reads per lane.
template <int N>
inline int2 segment_range_wide(const device int* ids, int first, int n, uint lane) {
  int2 r = segment_range(ids, first, min(n, 32), lane);
  for (int i = 1; i < N; ++i) {
    if (32 * i < n) {  // uniform: every lane joins the reductions
      const int2 x = segment_range(ids, first + 32 * i, min(n - 32 * i, 32), lane);
      r = int2(min(r.x, x.x), max(r.y, x.y));
    }
  }
  return r;
}

// Whether two id ranges overlap: tiles whose ranges do not share no id.
inline bool ranges_meet(int2 a, int2 b) { return a.x <= b.y && b.x <= a.y; }

// Narrows the tiles [*first, *stop) of length `step` (*first a multiple of
// step) to those from the first to the last whose segment ids meet `ids_of`
// (the range of the other side's tile): any order of ids is handled, tiles
// in between are kept (the caller skips the math of those that do not meet),
// and for sorted ids (documents one after another) the kept range is exactly
// the tiles that meet. `limit` is the other side's length (tiles end there).
inline void narrow_to_segments(const device int* ids, int2 ids_of, int step, int limit,
                               thread int* first, thread int* stop, uint lane) {
  while (*first < *stop &&
         !ranges_meet(ids_of, segment_range(ids, *first, min(step, limit - *first), lane))) {
    *first += step;
  }
  if (*first >= *stop) return;
  int last = *first + ((*stop - 1 - *first) / step) * step;
  while (last > *first &&
         !ranges_meet(ids_of, segment_range(ids, last, min(step, limit - last), lane))) {
    last -= step;
  }
  *stop = min(*stop, last + step);
}

// Row statistics of a score fragment: each row lives on the 4 lanes that
// differ in lane bits 0 and 3.
inline float row_max4(float x) {
  x = max(x, simd_shuffle_xor(x, ushort(1)));
  return max(x, simd_shuffle_xor(x, ushort(8)));
}
inline float row_sum4(float x) {
  x += simd_shuffle_xor(x, ushort(1));
  return x + simd_shuffle_xor(x, ushort(8));
}
