// Dispatch plan of the Metal backend; see plan.h.

#include "metal/plan/plan.h"

#include <algorithm>
#include <cstring>

namespace fatrain::metal_plan {

namespace {

namespace abi = fatrain::metal_abi;

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

size_t dtype_size(DType t) {
  switch (t) {
    case DType::kF32:
    case DType::kI32: return 4;
    case DType::kBF16:
    case DType::kF16: return 2;
    case DType::kBool: return 1;
  }
  return 1;
}

// The one score operand the kernels take (bias or mask), or null.
const ScoreTensor* score_operand(const Problem& p) {
  if (p.bias.data != nullptr) return &p.bias;
  if (p.mask.data != nullptr) return &p.mask;
  return nullptr;
}

template <class T>
Binding bytes_binding(int index, const T& value) {
  Binding b;
  b.index = index;
  b.is_bytes = true;
  b.bytes.resize(sizeof(T));
  std::memcpy(b.bytes.data(), &value, sizeof(T));
  return b;
}

Binding buffer(int index, Role role) {
  Binding b;
  b.index = index;
  b.role = role;
  return b;
}

// The operands both backward tile kernels (dQ, dK/dV) read, bound in this order.
void bind_backward_inputs(Dispatch* d) {
  for (auto [i, r] : {std::pair{FATRAIN_BUF_Q, Role::kQ}, {FATRAIN_BUF_K, Role::kK},
                      {FATRAIN_BUF_V, Role::kV}, {FATRAIN_BUF_L, Role::kL},
                      {FATRAIN_BUF_DO, Role::kDO}, {FATRAIN_BUF_DELTA, Role::kDelta}}) {
    d->bindings.push_back(buffer(i, r));
  }
}

AttnParams make_params(const Problem& p) {
  AttnParams a{};
  a.b = int32_t(p.batch);
  a.h = int32_t(p.q_heads);
  a.d = int32_t(p.head_dim);
  a.ql = int32_t(p.q_len);
  a.kl = int32_t(p.kv_len);
  a.gqa_factor = int32_t(p.q_heads / p.kv_heads);
  a.scale = p.scale;
  a.softcapping = 1.0f;  // disabled (flash_attn_train.rs always passes 1.0)
  const int es = int(dtype_size(p.dtype));
  const int bq = abi::fwd_block_q(int(p.head_dim), es);
  const int bk = abi::fwd_block_k(int(p.head_dim), es);
  a.nq = int32_t(ceil_div(p.q_len, bq));
  a.nk = int32_t(ceil_div(p.kv_len, bk));
  a.nq_aligned = int32_t(p.q_len / bq);
  a.nk_aligned = int32_t(p.kv_len / bk);
  a.ql_rem = int32_t(p.q_len % bq);
  a.kl_rem = int32_t(p.kv_len % bk);
  a.ql_off = 0;  // top-left causal alignment
  a.pad_ = 0;
  const Strides* s[4] = {&p.q, &p.k, &p.v, &p.o};
  int64_t* out[4] = {a.q_strides, a.k_strides, a.v_strides, a.o_strides};
  for (int i = 0; i < 4; ++i) {
    out[i][0] = s[i]->batch;
    out[i][1] = s[i]->head;
    out[i][2] = s[i]->seq;
  }
  return a;
}

// Function constants and the optional bindings shared by the attention kernels.
void add_common(const Problem& p, bool align_q, bool align_k, Dispatch* d) {
  const ScoreTensor* score = score_operand(p);
  const bool has_window = p.window_left >= 0 || p.window_right >= 0;
  const bool has_q_lengths = p.q_lengths != nullptr;
  const bool has_kv_lengths = p.kv_lengths != nullptr;
  const bool has_segments = p.q_segment_ids != nullptr;
  d->constants = {{FATRAIN_FC_ALIGN_Q, align_q},
                  {FATRAIN_FC_ALIGN_K, align_k},
                  {FATRAIN_FC_HAS_MASK, score != nullptr},
                  {FATRAIN_FC_DO_CAUSAL, p.causal},
                  {FATRAIN_FC_HAS_WINDOW, has_window},
                  {FATRAIN_FC_HAS_Q_LENGTHS, has_q_lengths},
                  {FATRAIN_FC_HAS_KV_LENGTHS, has_kv_lengths},
                  {FATRAIN_FC_HAS_SEGMENTS, has_segments}};
  d->bindings.push_back(bytes_binding(FATRAIN_BUF_PARAMS, make_params(p)));
  if (score != nullptr) {
    AttnMaskParams m{};
    m.m_strides[0] = score->strides[0];
    m.m_strides[1] = score->strides[1];
    m.m_strides[2] = score->strides[2];
    d->bindings.push_back(bytes_binding(FATRAIN_BUF_MASK_PARAMS, m));
    d->bindings.push_back(buffer(FATRAIN_BUF_MASK, Role::kMask));
  }
  if (has_window) {
    WindowParams w{int32_t(p.window_left < 0 ? -1 : p.window_left),
                   int32_t(p.window_right < 0 ? -1 : p.window_right)};
    d->bindings.push_back(bytes_binding(FATRAIN_BUF_WINDOW, w));
  }
  if (has_q_lengths) d->bindings.push_back(buffer(FATRAIN_BUF_Q_LENGTHS, Role::kQLengths));
  if (has_kv_lengths) d->bindings.push_back(buffer(FATRAIN_BUF_KV_LENGTHS, Role::kKVLengths));
  if (has_segments) {
    d->bindings.push_back(buffer(FATRAIN_BUF_Q_SEGMENT_IDS, Role::kQSegmentIds));
    d->bindings.push_back(buffer(FATRAIN_BUF_KV_SEGMENT_IDS, Role::kKVSegmentIds));
  }
}

std::string variant(const char* op, const Problem& p) {
  std::string name = std::string("flash_attn_train_") + op + "_" + dtype_name(p.dtype) + "_d" +
                     std::to_string(p.head_dim);
  if (p.mask.data != nullptr) name += "_boolmask";
  return name;
}

void set_size(uint32_t* dst, int64_t x, int64_t y, int64_t z) {
  dst[0] = uint32_t(x);
  dst[1] = uint32_t(y);
  dst[2] = uint32_t(z);
}

}  // namespace

const char* role_name(Role role) {
  switch (role) {
    case Role::kQ: return "Q";
    case Role::kK: return "K";
    case Role::kV: return "V";
    case Role::kO: return "O";
    case Role::kL: return "L";
    case Role::kMask: return "mask";
    case Role::kQLengths: return "q_lengths";
    case Role::kKVLengths: return "kv_lengths";
    case Role::kDO: return "dO";
    case Role::kDelta: return "Delta";
    case Role::kDQ: return "dQ";
    case Role::kDK: return "dK";
    case Role::kDV: return "dV";
    case Role::kQSegmentIds: return "q_segment_ids";
    case Role::kKVSegmentIds: return "kv_segment_ids";
    case Role::kDQAccum: return "dQ_accum";
  }
  return "?";
}

const char* dtype_name(DType t) {
  switch (t) {
    case DType::kF32: return "f32";
    case DType::kBF16: return "bf16";
    case DType::kF16: return "f16";
    case DType::kBool: return "bool";
    case DType::kI32: return "i32";
  }
  return "?";
}

std::vector<std::string> all_kernel_names() {
  // The lists the kernels instantiate from (flash_attn_abi.h).
  std::vector<std::string> dtypes, dims;
#define FATRAIN_ADD_DTYPE(name, msl_type) dtypes.push_back(#name);
#define FATRAIN_ADD_DIM(a, b, D) dims.push_back(#D);
  FATRAIN_METAL_FOR_EACH_DTYPE(FATRAIN_ADD_DTYPE)
  FATRAIN_METAL_FOR_EACH_HEAD_DIM(FATRAIN_ADD_DIM, _, _)
#undef FATRAIN_ADD_DTYPE
#undef FATRAIN_ADD_DIM
  std::vector<std::string> names;
  for (const std::string& dt : dtypes) {
    names.push_back("flash_attn_train_bwd_compute_d_" + dt);
    names.push_back("flash_attn_train_bwd_dq_reduce_" + dt);
    for (const std::string& d : dims) {
      for (const char* op : {"fwd", "bwd_dq", "bwd_dkdv", "bwd_dkdv_dq"}) {
        for (const char* suffix : {"", "_boolmask"}) {
          names.push_back(std::string("flash_attn_train_") + op + "_" + dt + "_d" + d + suffix);
        }
      }
    }
  }
  return names;
}

std::string validate(const Problem& p) {
  const std::string pre = "metal: ";
  if (p.batch <= 0) return pre + "batch must be > 0";
  if (p.q_heads <= 0) return pre + "n_q_heads must be > 0";
  if (p.kv_heads <= 0) return pre + "n_kv_heads must be > 0";
  if (p.q_heads % p.kv_heads != 0) {
    return pre + "n_q_heads (" + std::to_string(p.q_heads) +
           ") must be divisible by n_kv_heads (" + std::to_string(p.kv_heads) + ")";
  }
  if (p.q_len <= 0) return pre + "q_seq_len must be > 0";
  if (p.kv_len <= 0) return pre + "k_seq_len must be > 0";
  if (p.head_dim != 64 && p.head_dim != 128 && p.head_dim != 256) {
    return pre + "head_dim must be 64, 128 or 256 (the compiled kernel variants), got " +
           std::to_string(p.head_dim);
  }
  if (p.dtype != DType::kF32 && p.dtype != DType::kBF16 && p.dtype != DType::kF16) {
    return pre + "Q/K/V must be float32, bfloat16 or float16";
  }
  const int64_t int_max = 2147483647;
  if (p.batch > 65535 || p.q_heads > 65535 || p.q_len > int_max || p.kv_len > int_max) {
    return pre + "problem too large for the kernels' 32-bit sizes and grid";
  }
  if (p.window_left > int_max || p.window_right > int_max) {
    return pre + "local window too large";
  }
  for (const Strides* s : {&p.q, &p.k, &p.v, &p.o}) {
    if (s->batch % 4 != 0 || s->head % 4 != 0 || s->seq % 4 != 0) {
      return pre + "Q/K/V/O strides must be multiples of 4 elements (the kernels load "
                   "4-element vectors)";
    }
  }
  if (p.bias.data != nullptr && p.mask.data != nullptr) {
    return pre + "bias and mask must be folded into one operand before the call";
  }
  if (p.bias.data != nullptr && p.bias.dtype != p.dtype) {
    return pre + std::string("an additive mask must have the dtype of Q (") + dtype_name(p.dtype) +
           "), got " + dtype_name(p.bias.dtype);
  }
  if (p.mask.data != nullptr && p.mask.dtype != DType::kBool) {
    return pre + "a boolean mask must have dtype bool";
  }
  if (const ScoreTensor* score = score_operand(p)) {
    const int64_t full[4] = {p.batch, p.q_heads, p.q_len, p.kv_len};
    for (int i = 0; i < 4; ++i) {
      if (score->dims[i] != 1 && score->dims[i] != full[i]) {
        return pre + "the mask does not broadcast to [B, N, T, S]";
      }
    }
    if (score->dims[3] != p.kv_len || (p.kv_len > 1 && score->strides[3] != 1)) {
      return pre +
             "the mask must be contiguous along the key axis (a mask broadcast over keys "
             "has to be expanded to [.., S] first)";
    }
  }
  if ((p.q_segment_ids == nullptr) != (p.kv_segment_ids == nullptr)) {
    return pre + "q_segment_ids and kv_segment_ids must be given together";
  }
  return "";
}

uint64_t required_bytes(const Problem& p, Role role) {
  auto span = [&](const Strides& s, int64_t heads, int64_t len) -> uint64_t {
    return uint64_t((p.batch - 1) * s.batch + (heads - 1) * s.head + (len - 1) * s.seq +
                    p.head_dim) *
           dtype_size(p.dtype);
  };
  switch (role) {
    case Role::kQ:
    case Role::kDQ: return span(p.q, p.q_heads, p.q_len);
    case Role::kO:
    case Role::kDO: return span(p.o, p.q_heads, p.q_len);
    case Role::kK:
    case Role::kDK: return span(p.k, p.kv_heads, p.kv_len);
    case Role::kV:
    case Role::kDV: return span(p.v, p.kv_heads, p.kv_len);
    case Role::kL:
    case Role::kDelta: return uint64_t(p.batch * p.q_heads * p.q_len) * 4;
    case Role::kQLengths:
    case Role::kKVLengths: return uint64_t(p.batch) * 4;
    case Role::kQSegmentIds: return uint64_t(p.batch * p.q_len) * 4;
    case Role::kKVSegmentIds: return uint64_t(p.batch * p.kv_len) * 4;
    case Role::kDQAccum:
      return uint64_t(p.batch * p.q_heads) * uint64_t(abi::dq_accum_rows(int(p.q_len))) *
             uint64_t(p.head_dim) * 4;
    case Role::kMask: {
      const ScoreTensor* score = score_operand(p);
      if (score == nullptr) return 0;
      int64_t last = 0;
      for (int i = 0; i < 4; ++i) last += (score->dims[i] - 1) * score->strides[i];
      return uint64_t(last + 1) * dtype_size(score->dtype);
    }
  }
  return 0;
}

namespace {

// Threadgroup memory for the forward and dQ kernels' mask tile: the tile of
// a masked problem, else the smallest binding Metal accepts.
uint32_t mask_tile_length(const Problem& p, int block_q, int block_k) {
  const ScoreTensor* score = score_operand(p);
  if (score == nullptr) return uint32_t(abi::kNoMaskTileBytes);
  const int bytes = abi::mask_tile_bytes(block_q, block_k, int(dtype_size(score->dtype)));
  return uint32_t((bytes + 15) / 16 * 16);
}

}  // namespace

std::string plan_forward(const Problem& p, Plan* plan) {
  if (std::string e = validate(p); !e.empty()) return e;
  plan->scratch.clear();
  plan->dispatches.clear();
  Dispatch d;
  d.kernel = variant("fwd", p);
  const int es = int(dtype_size(p.dtype));
  const int bq = abi::fwd_block_q(int(p.head_dim), es);
  const int bk = abi::fwd_block_k(int(p.head_dim), es);
  add_common(p, p.q_len % bq == 0, p.kv_len % bk == 0, &d);
  for (auto [i, r] : {std::pair{FATRAIN_BUF_Q, Role::kQ}, {FATRAIN_BUF_K, Role::kK},
                      {FATRAIN_BUF_V, Role::kV}, {FATRAIN_BUF_O, Role::kO},
                      {FATRAIN_BUF_L, Role::kL}}) {
    d.bindings.push_back(buffer(i, r));
  }
  d.threadgroup_memory_length = mask_tile_length(p, bq, bk);
  set_size(d.grid, ceil_div(p.q_len, bq), p.q_heads, p.batch);
  set_size(d.threadgroup, kSimdgroupWidth, abi::kThreadgroupThreads / kSimdgroupWidth, 1);
  plan->dispatches.push_back(std::move(d));
  return "";
}

int backward_splits(const Problem& p, const BackwardOptions& options) {
  const int d = int(p.head_dim), es = int(dtype_size(p.dtype));
  const int block_kv = abi::bwd_block_kv(d, es, /*fused=*/true);
  const int64_t tiles = ceil_div(p.kv_len, block_kv);
  const uint64_t split_bytes = required_bytes(p, Role::kDQAccum);
  const uint64_t by_budget = split_bytes > 0 ? options.scratch_budget / split_bytes : 0;
  if (by_budget < 1) return 0;
  const int64_t cap = std::min<int64_t>(tiles, int64_t(std::min<uint64_t>(by_budget, 65535)));
  if (options.force_nsplit > 0) return int(std::min<int64_t>(options.force_nsplit, cap));
  const int64_t n =
      std::min<int64_t>(ceil_div(backward_target_threadgroups(options.gpu_cores, block_kv),
                                 p.batch * p.kv_heads),
                        cap);
  // The fewest splits with the same longest walk: ceil(tiles / n) key tiles.
  return int(ceil_div(tiles, ceil_div(tiles, n)));
}

std::string plan_backward(const Problem& p, Plan* plan, const BackwardOptions& options) {
  if (std::string e = validate(p); !e.empty()) return e;
  plan->scratch.clear();
  plan->dispatches.clear();
  plan->scratch.push_back({Role::kDelta, required_bytes(p, Role::kDelta)});

  Dispatch cd;
  cd.kernel = std::string("flash_attn_train_bwd_compute_d_") + dtype_name(p.dtype);
  cd.bindings.push_back(bytes_binding(FATRAIN_BUF_PARAMS, make_params(p)));
  cd.bindings.push_back(buffer(FATRAIN_BUF_O, Role::kO));
  cd.bindings.push_back(buffer(FATRAIN_BUF_DO, Role::kDO));
  cd.bindings.push_back(buffer(FATRAIN_BUF_DELTA, Role::kDelta));
  // 8 rows per simdgroup.
  set_size(cd.grid, ceil_div(p.q_len, 8 * abi::kSimdgroups), p.q_heads, p.batch);
  set_size(cd.threadgroup, kSimdgroupWidth, abi::kThreadgroupThreads / kSimdgroupWidth, 1);
  plan->dispatches.push_back(std::move(cd));

  const int d = int(p.head_dim), es = int(dtype_size(p.dtype));
  // dK/dV (both forms): its own tiles (per head dim and element size), hence
  // its own alignment constants.
  const int dkdv_bq = abi::bwd_dkdv_block_q(d, es);
  auto dkdv_dispatch = [&](const char* op, bool fused) {
    Dispatch k;
    k.kernel = variant(op, p);
    add_common(p, p.q_len % dkdv_bq == 0, p.kv_len % abi::bwd_block_kv(d, es, fused) == 0, &k);
    bind_backward_inputs(&k);
    k.bindings.push_back(buffer(FATRAIN_BUF_DK, Role::kDK));
    k.bindings.push_back(buffer(FATRAIN_BUF_DV, Role::kDV));
    set_size(k.threadgroup, kSimdgroupWidth, abi::bwd_dkdv_threads(d, es, fused) / kSimdgroupWidth,
             1);
    return k;
  };

  if (const int nsplit = backward_splits(p, options); nsplit > 0) {
    // Fused: dK, dV and the dQ accumulators in one kernel, then the reduce.
    const uint64_t split_bytes = required_bytes(p, Role::kDQAccum);
    plan->scratch.push_back({Role::kDQAccum, split_bytes * uint64_t(nsplit)});
    abi::DqAccumParams acc{};
    acc.nsplit = nsplit;
    acc.rows = abi::dq_accum_rows(int(p.q_len));
    acc.causal_block_kv = p.causal ? abi::bwd_block_kv(d, es, /*fused=*/true) : 0;
    Dispatch fused = dkdv_dispatch("bwd_dkdv_dq", true);
    fused.bindings.push_back(buffer(FATRAIN_BUF_DQ_ACCUM, Role::kDQAccum));
    fused.bindings.push_back(bytes_binding(FATRAIN_BUF_DQ_ACCUM_PARAMS, acc));
    set_size(fused.grid, nsplit, p.kv_heads, p.batch);
    plan->dispatches.push_back(std::move(fused));

    Dispatch reduce;
    reduce.kernel = std::string("flash_attn_train_bwd_dq_reduce_") + dtype_name(p.dtype);
    reduce.bindings.push_back(bytes_binding(FATRAIN_BUF_PARAMS, make_params(p)));
    reduce.bindings.push_back(buffer(FATRAIN_BUF_DQ, Role::kDQ));
    reduce.bindings.push_back(buffer(FATRAIN_BUF_DQ_ACCUM, Role::kDQAccum));
    reduce.bindings.push_back(bytes_binding(FATRAIN_BUF_DQ_ACCUM_PARAMS, acc));
    set_size(reduce.grid, ceil_div(p.q_len, abi::kBwdReduceRows), p.q_heads, p.batch);
    set_size(reduce.threadgroup, abi::kBwdReduceThreads, 1, 1);
    plan->dispatches.push_back(std::move(reduce));
    return "";
  }

  const int dq_bq = abi::dq_block_q(d, es), dq_bk = abi::dq_block_k(d, es);
  Dispatch dq;
  dq.kernel = variant("bwd_dq", p);
  add_common(p, p.q_len % dq_bq == 0, p.kv_len % dq_bk == 0, &dq);
  bind_backward_inputs(&dq);
  dq.bindings.push_back(buffer(FATRAIN_BUF_DQ, Role::kDQ));
  dq.threadgroup_memory_length = mask_tile_length(p, dq_bq, dq_bk);
  set_size(dq.grid, ceil_div(p.q_len, dq_bq), p.q_heads, p.batch);
  set_size(dq.threadgroup, kSimdgroupWidth, abi::kThreadgroupThreads / kSimdgroupWidth, 1);
  plan->dispatches.push_back(std::move(dq));

  Dispatch dkdv = dkdv_dispatch("bwd_dkdv", false);
  set_size(dkdv.grid, ceil_div(p.kv_len, abi::bwd_block_kv(d, es)), p.kv_heads, p.batch);
  plan->dispatches.push_back(std::move(dkdv));
  return "";
}

}  // namespace fatrain::metal_plan
