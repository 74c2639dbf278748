// The binary interface between jax_fatrain's Metal kernels and every host that
// dispatches them: the params structs, the function-constant and buffer indices,
// the tile sizes, and the list of compiled variants. It is valid MSL and valid
// C++17: the kernels (jax_fatrain/metal/*.metal) and the dispatch plan
// (cpp/metal/plan) include this one file, so the two cannot disagree.
//
// Kernel names, buffer indices 0-8, function constants 200/201/300/301, the
// 160-byte AttnParams and the 24-byte AttnMaskParams are those of mlx_native's
// `flash_attn_train.rs`; everything else extends that ABI.
#pragma once

#if defined(__METAL_VERSION__)
#include <metal_stdlib>
typedef long fatrain_abi_i64;
#define FATRAIN_ABI_BEGIN
#define FATRAIN_ABI_END
#define FATRAIN_ABI_CONST constant constexpr
#define FATRAIN_ABI_FN constexpr
#else
#include <cstdint>
typedef int64_t fatrain_abi_i64;
#define FATRAIN_ABI_BEGIN namespace fatrain::metal_abi {
#define FATRAIN_ABI_END }
#define FATRAIN_ABI_CONST inline constexpr
#define FATRAIN_ABI_FN inline constexpr
#endif

// ---------------------------------------------------------------------------
// Function constants. Attribute arguments must be integer literals after
// preprocessing, hence macros.
// ---------------------------------------------------------------------------
#define FATRAIN_FC_ALIGN_Q 200       // every query tile is full (no row guards)
#define FATRAIN_FC_ALIGN_K 201       // every key tile is full (no key guards)
#define FATRAIN_FC_HAS_MASK 300      // buffers 5 and 6 are bound
#define FATRAIN_FC_DO_CAUSAL 301     // top-left causal: query i sees keys j <= i
#define FATRAIN_FC_HAS_WINDOW 302    // buffer 9 is bound
#define FATRAIN_FC_HAS_Q_LENGTHS 303   // buffer 10 is bound
#define FATRAIN_FC_HAS_KV_LENGTHS 304  // buffer 11 is bound
#define FATRAIN_FC_HAS_SEGMENTS 305    // buffers 17 and 18 are bound

// ---------------------------------------------------------------------------
// Buffer indices (forward and backward share one numbering).
// ---------------------------------------------------------------------------
#define FATRAIN_BUF_Q 0
#define FATRAIN_BUF_K 1
#define FATRAIN_BUF_V 2
#define FATRAIN_BUF_O 3
#define FATRAIN_BUF_PARAMS 4       // AttnParams (setBytes)
#define FATRAIN_BUF_MASK_PARAMS 5  // AttnMaskParams (setBytes)
#define FATRAIN_BUF_MASK 6         // additive (Q's dtype) or bool mask
#define FATRAIN_BUF_L 8            // float32 [B, H_q, qL], natural log
#define FATRAIN_BUF_WINDOW 9       // WindowParams (setBytes)
#define FATRAIN_BUF_Q_LENGTHS 10   // int32 [B]
#define FATRAIN_BUF_KV_LENGTHS 11  // int32 [B]
#define FATRAIN_BUF_DO 12          // O's strides
#define FATRAIN_BUF_DELTA 13       // float32 [B, H_q, qL] = rowsum(dO * O)
#define FATRAIN_BUF_DQ 14          // Q's strides
#define FATRAIN_BUF_DK 15          // K's strides
#define FATRAIN_BUF_DV 16          // V's strides
#define FATRAIN_BUF_Q_SEGMENT_IDS 17   // int32 [B, qL], contiguous
#define FATRAIN_BUF_KV_SEGMENT_IDS 18  // int32 [B, kL], contiguous: query i sees key j
                                       // only if their segment ids are equal
#define FATRAIN_BUF_DQ_ACCUM 19         // float32 [nsplit, B, H_q, rows, D]: dQ / scale per
                                        // key-block split (fused backward; DqAccumParams)
#define FATRAIN_BUF_DQ_ACCUM_PARAMS 20  // DqAccumParams (setBytes)
// Threadgroup-memory binding (setThreadgroupMemoryLength) of the forward and dQ
// kernels' mask tile (see mask_tile_bytes).
#define FATRAIN_TG_MASK_TILE 0

// ---------------------------------------------------------------------------
// The compiled variants: kernel names are
//   flash_attn_train_fwd_{dtype}_d{D}[_boolmask]
//   flash_attn_train_bwd_compute_d_{dtype}
//   flash_attn_train_bwd_dq_{dtype}_d{D}[_boolmask]
//   flash_attn_train_bwd_dkdv_{dtype}_d{D}[_boolmask]
//   flash_attn_train_bwd_dkdv_dq_{dtype}_d{D}[_boolmask]
//   flash_attn_train_bwd_dq_reduce_{dtype}
// X(name, msl_type) and X(a, b, D): the kernels instantiate from these lists,
// the plan enumerates names from them.
// ---------------------------------------------------------------------------
#define FATRAIN_METAL_FOR_EACH_DTYPE(X) X(bf16, bfloat) X(f16, half) X(f32, float)
#define FATRAIN_METAL_FOR_EACH_HEAD_DIM(X, a, b) X(a, b, 64) X(a, b, 128) X(a, b, 256)

FATRAIN_ABI_BEGIN

// Threads per threadgroup are (32, kSimdgroups, 1) in the forward, compute-D and
// dQ kernels (the dK/dV kernel: see bwd_dkdv_simdgroups below).
FATRAIN_ABI_CONST int kSimdgroups = 4;
// ... so kThreadgroupThreads = 32 * kSimdgroups threads: the bound those kernels
// declare as max_total_threads_per_threadgroup and the threadgroup size the
// plan dispatches them with.
FATRAIN_ABI_CONST int kThreadgroupThreads = 32 * kSimdgroups;

// The forward and dQ kernels stage each key step's mask (block_q query rows x
// block_k keys, additive in Q's dtype or bool) in the threadgroup memory the
// plan binds at FATRAIN_TG_MASK_TILE (setThreadgroupMemoryLength), so that problems
// without a mask do not pay for it in threadgroups resident per core. Rows are
// padded by 16 bytes to mask_tile_ld elements (the 8 rows of a fragment then
// start in different banks).
FATRAIN_ABI_FN int mask_tile_ld(int block_k, int mask_bytes) { return block_k + 16 / mask_bytes; }
FATRAIN_ABI_FN int mask_tile_bytes(int block_q, int block_k, int mask_bytes) {
  return block_q * mask_tile_ld(block_k, mask_bytes) * mask_bytes;
}
// Without a mask the binding still needs a length: the smallest Metal accepts.
FATRAIN_ABI_CONST int kNoMaskTileBytes = 16;

// Tile sizes per head dim and element size (bytes of Q/K/V's dtype). The
// forward and dQ kernels own block_q query rows per threadgroup and sweep the
// keys block_k at a time, with K and V tiles (and Q, dO) staged in
// threadgroup memory; a threadgroup's kSimdgroups simdgroups cover the
// block_q rows 8 at a time and split the head dim among the simdgroups that
// share 8 rows (kSimdgroups * 8 / block_q of them). The sizes are the largest
// that keep every variant within 30 KiB of threadgroup memory (two
// threadgroups per GPU core), the mask tile included, and about 64 live
// floats per lane (jax_fatrain/metal/README.md has the counts).
//
//              forward (block_q, block_k)   dQ (block_q, block_k)
//   head dim   16-bit      f32              16-bit      f32
//   64         32, 32      32, 16           32, 32      32, 16
//   128        32, 32      16, 16           32, 16      16, 8
//   256        16, 16       8,  8           16, 8        8, 8
FATRAIN_ABI_FN int fwd_block_q(int head_dim, int elem_bytes) {
  return head_dim <= 64 ? 32 : head_dim <= 128 ? (elem_bytes <= 2 ? 32 : 16)
                                               : (elem_bytes <= 2 ? 16 : 8);
}
FATRAIN_ABI_FN int fwd_block_k(int head_dim, int elem_bytes) {
  return head_dim <= 64 && elem_bytes > 2 ? 16 : fwd_block_q(head_dim, elem_bytes);
}
FATRAIN_ABI_FN int dq_block_q(int head_dim, int elem_bytes) {
  return fwd_block_q(head_dim, elem_bytes);
}
FATRAIN_ABI_FN int dq_block_k(int head_dim, int elem_bytes) {
  return head_dim <= 64 ? (elem_bytes <= 2 ? 32 : 16)
                        : (head_dim <= 128 && elem_bytes <= 2 ? 16 : 8);
}

// The dK/dV kernel (tiles per head dim and element size of Q/K/V in bytes;
// jax_fatrain/metal/README.md explains the choice): threadgroups of
// (32, bwd_dkdv_simdgroups, 1) threads own bwd_block_kv keys of one kv head
// and sweep the query rows bwd_dkdv_block_q at a time. Each simdgroup keeps
// dK and dV of 8 keys x bwd_dkdv_cols head-dim columns in registers; 16-bit
// inputs stage K and V in threadgroup memory (64 columns per simdgroup),
// float32 keeps its K and V columns in registers (32 columns per simdgroup).
//
// `fused`: the tiles of the fused dK/dV/dQ kernel, which has 8 simdgroups at
// every head dim. Its float32 dQ accumulator tile is read and written once per
// (key tile, query tile), so its accumulator traffic is inversely
// proportional to the keys per threadgroup: 64 keys at 16-bit D = 64 instead
// of the two-kernel form's 32 (whose 4 simdgroups keep its grid fine).
FATRAIN_ABI_FN int bwd_dkdv_simdgroups(int head_dim, int elem_bytes, bool fused = false) {
  return head_dim == 64 && elem_bytes == 2 && !fused ? 4 : 8;
}
FATRAIN_ABI_FN int bwd_dkdv_cols(int /*head_dim*/, int elem_bytes) {
  return elem_bytes == 4 ? 32 : 64;
}
FATRAIN_ABI_FN int bwd_block_kv(int head_dim, int elem_bytes, bool fused = false) {
  return 8 * bwd_dkdv_simdgroups(head_dim, elem_bytes, fused) * bwd_dkdv_cols(head_dim, elem_bytes) /
         head_dim;
}
FATRAIN_ABI_FN int bwd_dkdv_block_q(int head_dim, int /*elem_bytes*/) {
  return head_dim == 64 ? 16 : 8;
}
// Threads per threadgroup of the dK/dV kernels (both forms): the kernels'
// max_total_threads_per_threadgroup and the plan's threadgroup (32, N / 32, 1).
FATRAIN_ABI_FN int bwd_dkdv_threads(int head_dim, int elem_bytes, bool fused = false) {
  return 32 * bwd_dkdv_simdgroups(head_dim, elem_bytes, fused);
}
// Threadgroup memory the dK/dV kernels may use (two threadgroups per core on
// GPUs with about 60 KB per core); a variant takes a second query-tile
// buffer only where it fits.
FATRAIN_ABI_CONST int kBwdMaxThreadgroupBytes = 30 * 1024;

// Fused backward (flash_attn_train_bwd_dkdv_dq + flash_attn_train_bwd_dq_reduce):
// the dK/dV kernel also accumulates dS K into float32 dQ accumulators, one per
// split of the key blocks; split s belongs to threadgroup (s, h_kv, b) alone.
// Accumulator rows per (split, batch, query head): qL rounded up to
// kDqAccumRowAlign (a multiple of every dK/dV query tile), so that a query
// tile never leaves its head's rows.
FATRAIN_ABI_CONST int kDqAccumRowAlign = 32;
FATRAIN_ABI_FN int dq_accum_rows(int q_len) {
  return (q_len + kDqAccumRowAlign - 1) / kDqAccumRowAlign * kDqAccumRowAlign;
}
// The reduce kernel: threadgroups of kBwdReduceThreads threads, each summing
// kBwdReduceRows query rows of one head over the splits.
FATRAIN_ABI_CONST int kBwdReduceThreads = 128;
FATRAIN_ABI_CONST int kBwdReduceRows = 32;

// The 160-byte params struct (MLX steel-attention layout plus softcapping).
struct AttnParams {
  int b;              // batch
  int h;              // query heads
  int d;              // head dim
  int ql;             // query length
  int kl;             // key length
  int gqa_factor;     // query heads per kv head
  float scale;        // applied to Q K^T in float32 (kernels fold in log2(e))
  float softcapping;  // 1.0 = disabled (the only supported value)
  int nq, nk, nq_aligned, nk_aligned, ql_rem, kl_rem;  // forward tile counts
  int ql_off;         // causal offset: query i sees key j <= i + ql_off
  int pad_;
  fatrain_abi_i64 q_strides[3];  // [batch, head, seq] element strides; head dim contiguous
  fatrain_abi_i64 k_strides[3];
  fatrain_abi_i64 v_strides[3];
  fatrain_abi_i64 o_strides[3];  // also dO's strides
};
static_assert(sizeof(AttnParams) == 160, "AttnParams must be 160 bytes");

struct AttnMaskParams {
  fatrain_abi_i64 m_strides[3];  // [batch, head, query] element strides (0 = broadcast); key stride 1
};
static_assert(sizeof(AttnMaskParams) == 24, "AttnMaskParams must be 24 bytes");

struct WindowParams {
  int window_left;   // query i sees key j only if j >= i - window_left (-1: unbounded)
  int window_right;  // ... and j <= i + window_right (-1: unbounded)
};
static_assert(sizeof(WindowParams) == 8, "WindowParams must be 8 bytes");

// The fused backward's dQ accumulators (buffer FATRAIN_BUF_DQ_ACCUM): nsplit
// splits of B x H_q x rows x D floats, rows = dq_accum_rows(qL).
struct DqAccumParams {
  int nsplit;           // = the fused kernel's grid x
  int rows;
  int causal_block_kv;  // causal: the fused kernel's key tile (see dq_split_first_row); else 0
  int pad_;
};
static_assert(sizeof(DqAccumParams) == 16, "DqAccumParams must be 16 bytes");

// The first accumulator row that split s writes: with causal_block_kv > 0
// (causal problems), the first key of split s is s * causal_block_kv (its
// first key tile, pass 0 of the fused kernel's walk; later passes take later
// tiles) and query i sees key j only if j <= i + ql_off, so no key of the
// split is visible to the rows above first key - ql_off: the fused kernel
// leaves them unwritten and the reduce does not read them. Rounded down to
// kDqAccumRowAlign (= kBwdReduceRows), so that a reduce block is wholly in or
// out; non-decreasing in s, so the splits a row block sums are a prefix.
FATRAIN_ABI_FN int dq_split_first_row(int split, int causal_block_kv, int ql_off) {
  const int first = split * causal_block_kv - ql_off;
  return first <= 0 ? 0 : first / kDqAccumRowAlign * kDqAccumRowAlign;
}
static_assert(kDqAccumRowAlign % kBwdReduceRows == 0, "a reduce block is wholly in or out of a split");

FATRAIN_ABI_END
