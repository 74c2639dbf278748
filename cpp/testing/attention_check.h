// A standalone correctness check of one backend's kernels, shared by the C++
// tests of the CPU kernels (cpp/cpu/tests) and of the CUDA kernels
// (cpp/cuda/tests): random problems, a naive double-precision reference of
// the contract in attention_problem.h, and the comparisons.
//
// A backend runs the three entry points on operands in host memory (dense
// BTNH or BNTH tensors, so each one's element count follows from the
// problem: q, o, d_o, dq B*T*N*D; k, v, dk, dv B*S*K*D; lse B*N*T; dbias the
// product of bias.dims). Inputs are rounded to the tested dtype before the
// reference sees them, so reference and kernels read the same operands.
// Header-only, no framework; every failure is printed and counted.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "attention_problem.h"

namespace fatrain::testing {

// ---------------------------------------------------------------------------
// Element types.
// ---------------------------------------------------------------------------
inline float bf16_to_f(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline uint16_t f_to_bf16(float f) {  // round to nearest even; NaN stays NaN
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffff) > 0x7f800000) return (u >> 16) | 0x40;
  u += 0x7fff + ((u >> 16) & 1);
  return u >> 16;
}
inline float f16_to_f(uint16_t h) {
  int s = h >> 15, e = (h >> 10) & 31, m = h & 1023;
  double v;
  if (e == 31)
    v = m ? NAN : INFINITY;
  else if (e == 0)
    v = std::ldexp(static_cast<double>(m), -24);
  else
    v = std::ldexp(static_cast<double>(m + 1024), e - 25);
  return static_cast<float>(s ? -v : v);
}
inline uint16_t f_to_f16(float f) {  // round to nearest even on the half grid
  if (std::isnan(f)) return 0x7e00;
  uint16_t sign = std::signbit(f) ? 0x8000 : 0;
  double a = std::fabs(static_cast<double>(f));
  if (a >= 65520.0) return sign | 0x7c00;
  int e;
  std::frexp(a, &e);  // a = m * 2^e, m in [0.5, 1)
  int ulp_exp = e - 11;
  if (ulp_exp < -24) ulp_exp = -24;
  double ulp = std::ldexp(1.0, ulp_exp);
  double q = a / ulp;
  double fl = std::floor(q);
  double r = q - fl;
  double n = fl;
  if (r > 0.5 || (r == 0.5 && std::fmod(fl, 2.0) != 0.0)) n = fl + 1;
  double v = n * ulp;
  if (v == 0) return sign;
  if (v < std::ldexp(1.0, -14)) return sign | static_cast<uint16_t>(v / std::ldexp(1.0, -24));
  int ee;
  double mm = std::frexp(v, &ee);  // v = mm * 2^ee
  int hexp = ee - 1 + 15;
  if (hexp >= 31) return sign | 0x7c00;
  uint16_t mant = static_cast<uint16_t>((mm * 2 - 1) * 1024 + 0.5);
  return sign | (hexp << 10) | mant;
}
inline size_t dsize(DType d) { return d == DType::kF32 ? 4 : 2; }
inline float to_f(const void* p, DType d, int64_t i) {
  if (d == DType::kF32) return static_cast<const float*>(p)[i];
  uint16_t h = static_cast<const uint16_t*>(p)[i];
  return d == DType::kBF16 ? bf16_to_f(h) : f16_to_f(h);
}
inline void from_f(void* p, DType d, int64_t i, float v) {
  if (d == DType::kF32)
    static_cast<float*>(p)[i] = v;
  else
    static_cast<uint16_t*>(p)[i] = d == DType::kBF16 ? f_to_bf16(v) : f_to_f16(v);
}
inline const char* dname(DType d) {
  return d == DType::kF32 ? "f32" : d == DType::kBF16 ? "bf16" : "f16";
}

// ---------------------------------------------------------------------------
// Tensors in host memory.
// ---------------------------------------------------------------------------
struct Buf {
  std::vector<uint8_t> bytes;
  DType dt;
  int64_t n;
  Buf(DType d, int64_t count) : bytes(count * dsize(d)), dt(d), n(count) {}
  void* p() { return bytes.data(); }
  float get(int64_t i) const { return to_f(bytes.data(), dt, i); }
  void set(int64_t i, float v) { from_f(bytes.data(), dt, i, v); }
  void poison() {
    for (int64_t i = 0; i < n; ++i) set(i, NAN);
  }
};

// [B, L, H, D] tensor with layout either BTNH (bnth = false) or BNTH.
struct Seq {
  Buf buf;
  int64_t B, L, H, D;
  bool bnth;
  Seq(DType d, int64_t b, int64_t l, int64_t h, int64_t dd, bool bn)
      : buf(d, b * l * h * dd), B(b), L(l), H(h), D(dd), bnth(bn) {}
  int64_t idx(int64_t b, int64_t t, int64_t h, int64_t d) const {
    return bnth ? ((b * H + h) * L + t) * D + d : ((b * L + t) * H + h) * D + d;
  }
  float at(int64_t b, int64_t t, int64_t h, int64_t d) const { return buf.get(idx(b, t, h, d)); }
  SeqTensor view() {
    SeqTensor s;
    s.data = buf.p();
    s.dtype = buf.dt;
    if (bnth) {
      s.batch_stride = H * L * D;
      s.head_stride = L * D;
      s.seq_stride = D;
    } else {
      s.batch_stride = L * H * D;
      s.seq_stride = H * D;
      s.head_stride = D;
    }
    return s;
  }
};

// ---------------------------------------------------------------------------
// Cases.
// ---------------------------------------------------------------------------
// Segment ids of packed sequences: kSorted documents whose ends fall inside
// tiles, kUnsorted ids drawn at random from three, kPadding sorted documents
// followed by padding rows and keys of ids no other side has (they see
// nothing).
enum class Segments { kNone, kSorted, kUnsorted, kPadding };

struct Case {
  std::string name;
  int64_t B = 1, N = 1, K = 1, T = 1, S = 1, D = 64;
  DType dt = DType::kF32;
  bool causal = false;
  int64_t wl = -1, wr = -1;
  bool qlens = false, kvlens = false;
  int64_t bias_dims[4] = {0, 0, 0, 0};  // 0: no bias; 1 broadcast, else the full extent
  DType bias_dt = DType::kF32;
  int64_t mask_dims[4] = {0, 0, 0, 0};
  bool bias_neg_inf = false;    // sprinkle -inf into the bias
  bool bnth = false;
  bool mask_full_rows = false;  // mask some query rows entirely
  Segments segments = Segments::kNone;
  int64_t documents = 5;        // sorted segment ids: documents per sequence
};

// Relative (Frobenius) error bounds against the double-precision reference.
struct Tolerance {
  double out, lse_abs, grad, bias_grad;
};

// Runs the entry points of one backend on host operands. Each returns
// nullptr or an error message that stays valid until the next call.
// `backward_reruns` more backward and bias-gradient runs are compared with
// the first bit for bit (0 where the backend promises no reproducibility);
// run r of backward/bias_grad is the r-th of them (0 the first).
class Backend {
 public:
  virtual ~Backend() = default;
  virtual Tolerance tolerance(DType dtype) const = 0;
  virtual int backward_reruns() const = 0;
  virtual const char* forward(const AttentionProblem& p, const ForwardOperands& ops) = 0;
  virtual const char* backward(const AttentionProblem& p, const BackwardOperands& ops,
                               int run) = 0;
  virtual const char* bias_grad(const AttentionProblem& p, const BiasGradOperands& ops,
                                int run) = 0;
};

// The failures of the checks so far.
inline int& failures() {
  static int count = 0;
  return count;
}
inline bool check(bool ok, const std::string& what) {
  if (!ok) {
    std::printf("  FAIL: %s\n", what.c_str());
    ++failures();
  }
  return ok;
}

// One forward, backward and (with a bias) bias gradient of `c` on `backend`,
// each against the reference; prints one line per case.
inline void run_case(const Case& c, Backend& backend) {
  std::mt19937_64 rng(std::hash<std::string>()(c.name));
  std::normal_distribution<float> nd(0.0f, 1.0f);
  const int64_t B = c.B, N = c.N, K = c.K, T = c.T, S = c.S, D = c.D;
  const int64_t G = N / K;
  Seq q(c.dt, B, T, N, D, c.bnth), k(c.dt, B, S, K, D, c.bnth), v(c.dt, B, S, K, D, c.bnth);
  Seq o(c.dt, B, T, N, D, c.bnth), dO(c.dt, B, T, N, D, c.bnth);
  for (int64_t i = 0; i < q.buf.n; ++i) q.buf.set(i, nd(rng));
  for (int64_t i = 0; i < k.buf.n; ++i) k.buf.set(i, nd(rng));
  for (int64_t i = 0; i < v.buf.n; ++i) v.buf.set(i, nd(rng));
  for (int64_t i = 0; i < dO.buf.n; ++i) dO.buf.set(i, nd(rng));
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));

  AttentionProblem p;
  p.batch = B;
  p.q_heads = N;
  p.kv_heads = K;
  p.q_len = T;
  p.kv_len = S;
  p.head_dim = D;
  p.scale = scale;
  p.causal = c.causal;
  p.window_left = c.wl;
  p.window_right = c.wr;
  std::vector<int32_t> qlen(B), kvlen(B);
  for (int64_t b = 0; b < B; ++b) {
    qlen[b] = static_cast<int32_t>(b == 0 ? T : std::max<int64_t>(1, T - 7 * b - 3));
    kvlen[b] = static_cast<int32_t>(b == 0 ? std::max<int64_t>(1, S - 5) : (b == 1 ? 0 : S / 2));
  }
  if (c.qlens) p.q_lengths = qlen.data();
  if (c.kvlens) p.kv_lengths = kvlen.data();

  // Segment ids: sorted, c.documents per sequence (ends not on tile
  // boundaries); with padding the final len / 8 ids of each side are replaced
  // by a padding id (-1 for queries, -2 for keys), so those rows see nothing.
  std::vector<int32_t> qseg, kvseg;
  const bool has_seg = c.segments != Segments::kNone;
  if (has_seg) {
    std::uniform_int_distribution<int32_t> pick(0, 2);
    auto fill = [&](std::vector<int32_t>& ids, int64_t len, int32_t pad_id) {
      ids.resize(B * len);
      for (int64_t b = 0; b < B; ++b)
        for (int64_t t = 0; t < len; ++t) {
          int32_t id = static_cast<int32_t>((t * c.documents + b) / len);
          if (c.segments == Segments::kUnsorted) id = pick(rng);
          if (c.segments == Segments::kPadding && t >= len - len / 8) id = pad_id;
          ids[b * len + t] = id;
        }
    };
    fill(qseg, T, -1);
    fill(kvseg, S, -2);
    p.q_segment_ids = qseg.data();
    p.kv_segment_ids = kvseg.data();
  }

  const int64_t full[4] = {B, N, T, S};
  // Bias.
  Buf bias(c.bias_dt, 1);
  int64_t bd[4] = {1, 1, 1, 1};
  const bool has_bias = c.bias_dims[0] != 0;
  if (has_bias) {
    for (int d = 0; d < 4; ++d) bd[d] = c.bias_dims[d] == 1 ? 1 : full[d];
    int64_t count = bd[0] * bd[1] * bd[2] * bd[3];
    bias = Buf(c.bias_dt, count);
    for (int64_t i = 0; i < count; ++i) {
      float x = nd(rng);
      if (c.bias_neg_inf && (i % 7 == 3)) x = -INFINITY;
      bias.set(i, x);
    }
    p.bias.data = bias.p();
    p.bias.dtype = c.bias_dt;
    int64_t stride = 1;
    for (int d = 3; d >= 0; --d) {
      p.bias.dims[d] = bd[d];
      p.bias.strides[d] = bd[d] == 1 ? 0 : stride;
      stride *= bd[d];
    }
  }
  // Mask.
  std::vector<uint8_t> mask;
  int64_t md[4] = {1, 1, 1, 1};
  const bool has_mask = c.mask_dims[0] != 0;
  if (has_mask) {
    for (int d = 0; d < 4; ++d) md[d] = c.mask_dims[d] == 1 ? 1 : full[d];
    int64_t count = md[0] * md[1] * md[2] * md[3];
    mask.resize(count);
    std::bernoulli_distribution keep(0.7);
    for (int64_t i = 0; i < count; ++i) mask[i] = keep(rng) ? 1 : 0;
    if (c.mask_full_rows && md[2] == T) {
      // Query rows 2 and T-1 see nothing (in every broadcast slice).
      for (int64_t a = 0; a < md[0] * md[1]; ++a)
        for (int64_t j = 0; j < md[3]; ++j) {
          mask[(a * md[2] + 2 % T) * md[3] + j] = 0;
          mask[(a * md[2] + T - 1) * md[3] + j] = 0;
        }
    }
    p.mask.data = mask.data();
    p.mask.dtype = DType::kBool;
    int64_t stride = 1;
    for (int d = 3; d >= 0; --d) {
      p.mask.dims[d] = md[d];
      p.mask.strides[d] = md[d] == 1 ? 0 : stride;
      stride *= md[d];
    }
  }
  auto bias_index = [&](int64_t b, int64_t n, int64_t i, int64_t j) -> int64_t {
    return (((bd[0] == 1 ? 0 : b) * bd[1] + (bd[1] == 1 ? 0 : n)) * bd[2] +
            (bd[2] == 1 ? 0 : i)) * bd[3] + (bd[3] == 1 ? 0 : j);
  };
  auto bias_at = [&](int64_t b, int64_t n, int64_t i, int64_t j) -> double {
    return has_bias ? bias.get(bias_index(b, n, i, j)) : 0.0;
  };
  auto visible = [&](int64_t b, int64_t n, int64_t i, int64_t j) -> bool {
    if (has_mask) {
      int64_t idx = (((md[0] == 1 ? 0 : b) * md[1] + (md[1] == 1 ? 0 : n)) * md[2] +
                     (md[2] == 1 ? 0 : i)) * md[3] + (md[3] == 1 ? 0 : j);
      if (!mask[idx]) return false;
    }
    if (c.causal && j > i) return false;
    if (c.wl >= 0 && j < i - c.wl) return false;
    if (c.wr >= 0 && j > i + c.wr) return false;
    if (c.kvlens && j >= kvlen[b]) return false;
    if (c.qlens && i >= qlen[b]) return false;
    if (has_seg && qseg[b * T + i] != kvseg[b * S + j]) return false;
    return true;
  };

  // ---- Reference (double) ----
  std::vector<double> rO(B * T * N * D, 0.0), rL(B * N * T, -INFINITY);
  std::vector<double> rdQ(B * T * N * D, 0.0), rdK(B * S * K * D, 0.0), rdV(B * S * K * D, 0.0);
  std::vector<double> rdB(has_bias ? bias.n : 1, 0.0), rdBabs(has_bias ? bias.n : 1, 0.0);
  std::vector<char> row_dead(B * N * T, 0);
  {
    std::vector<double> s(S), pr(S);
    for (int64_t b = 0; b < B; ++b)
      for (int64_t n = 0; n < N; ++n) {
        int64_t kh = n / G;
        for (int64_t i = 0; i < T; ++i) {
          double m = -INFINITY;
          for (int64_t j = 0; j < S; ++j) {
            if (!visible(b, n, i, j)) {
              s[j] = -INFINITY;
              continue;
            }
            double dot = 0;
            for (int64_t d = 0; d < D; ++d) dot += double(q.at(b, i, n, d)) * k.at(b, j, kh, d);
            s[j] = double(scale) * dot + bias_at(b, n, i, j);
            m = std::max(m, s[j]);
          }
          if (m == -INFINITY) {
            row_dead[(b * N + n) * T + i] = 1;
            continue;
          }
          double l = 0;
          for (int64_t j = 0; j < S; ++j) l += (pr[j] = s[j] == -INFINITY ? 0.0 : std::exp(s[j] - m));
          rL[(b * N + n) * T + i] = m + std::log(l);
          double* orow = &rO[((b * T + i) * N + n) * D];
          for (int64_t j = 0; j < S; ++j) {
            pr[j] /= l;
            if (pr[j] != 0)
              for (int64_t d = 0; d < D; ++d) orow[d] += pr[j] * v.at(b, j, kh, d);
          }
          double Dr = 0;
          for (int64_t d = 0; d < D; ++d) Dr += double(dO.at(b, i, n, d)) * orow[d];
          double* dq = &rdQ[((b * T + i) * N + n) * D];
          for (int64_t j = 0; j < S; ++j) {
            if (pr[j] == 0) continue;
            double dp = 0;
            for (int64_t d = 0; d < D; ++d) dp += double(dO.at(b, i, n, d)) * v.at(b, j, kh, d);
            double ds = pr[j] * (dp - Dr);
            double* dk = &rdK[((b * S + j) * K + kh) * D];
            double* dv = &rdV[((b * S + j) * K + kh) * D];
            for (int64_t d = 0; d < D; ++d) {
              dq[d] += scale * ds * k.at(b, j, kh, d);
              dk[d] += scale * ds * q.at(b, i, n, d);
              dv[d] += pr[j] * dO.at(b, i, n, d);
            }
            if (has_bias) {
              rdB[bias_index(b, n, i, j)] += ds;
              rdBabs[bias_index(b, n, i, j)] += std::fabs(ds);
            }
          }
        }
      }
  }

  auto rel_err = [](const std::vector<double>& ref, auto get, int64_t n, bool* finite) {
    double num = 0, den = 0;
    *finite = true;
    for (int64_t i = 0; i < n; ++i) {
      double x = get(i);
      if (!std::isfinite(x)) *finite = false;
      num += (x - ref[i]) * (x - ref[i]);
      den += ref[i] * ref[i];
    }
    return std::sqrt(num / (den > 0 ? den : 1.0));
  };
  const Tolerance tol = backend.tolerance(c.dt);
  char msg[256];

  // ---- Forward ----
  std::vector<float> lse(B * N * T);
  o.buf.poison();
  std::fill(lse.begin(), lse.end(), NAN);
  ForwardOperands fo;
  fo.q = q.view();
  fo.k = k.view();
  fo.v = v.view();
  fo.o = o.view();
  fo.lse = lse.data();
  const char* err = backend.forward(p, fo);
  if (!check(err == nullptr, c.name + ": forward error " + (err ? err : ""))) return;
  // O in the reference's BTNH order.
  auto o_get = [&](int64_t idx) {
    int64_t d = idx % D, n = (idx / D) % N, i = (idx / (D * N)) % T, b = idx / (D * N * T);
    return double(o.at(b, i, n, d));
  };
  bool fin;
  double eo = rel_err(rO, o_get, rO.size(), &fin);
  double el = 0;
  bool lse_ok = true;
  for (int64_t r = 0; r < B * N * T; ++r) {
    if (row_dead[r]) {
      if (!(lse[r] == -INFINITY)) lse_ok = false;
    } else {
      if (!std::isfinite(lse[r])) lse_ok = false;
      el = std::max(el, std::fabs(lse[r] - rL[r]));
    }
  }
  std::snprintf(msg, sizeof msg, "%s: fwd O rel err %.3g (tol %.3g), finite=%d, L max abs err %.3g",
                c.name.c_str(), eo, tol.out, fin, el);
  check(fin && eo < tol.out && lse_ok && el < tol.lse_abs, msg);
  // Rows that see no key: O exactly 0.
  bool dead_zero = true;
  int64_t ndead = 0;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t n = 0; n < N; ++n)
      for (int64_t i = 0; i < T; ++i)
        if (row_dead[(b * N + n) * T + i]) {
          ++ndead;
          for (int64_t d = 0; d < D; ++d)
            if (o.at(b, i, n, d) != 0.0f) dead_zero = false;
        }
  check(dead_zero, c.name + ": fully masked rows must have O == 0");

  // ---- Backward ----
  Seq dq(c.dt, B, T, N, D, c.bnth), dk(c.dt, B, S, K, D, c.bnth), dv(c.dt, B, S, K, D, c.bnth);
  BackwardOperands bo;
  bo.q = q.view();
  bo.k = k.view();
  bo.v = v.view();
  bo.o = o.view();
  bo.d_o = dO.view();
  bo.lse = lse.data();
  bo.dq = dq.view();
  bo.dk = dk.view();
  bo.dv = dv.view();
  dq.buf.poison();
  dk.buf.poison();
  dv.buf.poison();
  err = backend.backward(p, bo, 0);
  if (!check(err == nullptr, c.name + ": backward error " + (err ? err : ""))) return;
  auto seq_get = [D](Seq& t, int64_t H) {
    return [&t, H, D, L = t.L](int64_t idx) {
      int64_t d = idx % D, n = (idx / D) % H, i = (idx / (D * H)) % L, b = idx / (D * H * L);
      return double(t.at(b, i, n, d));
    };
  };
  bool f1, f2, f3;
  double e1 = rel_err(rdQ, seq_get(dq, N), rdQ.size(), &f1);
  double e2 = rel_err(rdK, seq_get(dk, K), rdK.size(), &f2);
  double e3 = rel_err(rdV, seq_get(dv, K), rdV.size(), &f3);
  std::snprintf(msg, sizeof msg, "%s: bwd rel err dq %.3g dk %.3g dv %.3g (tol %.3g) finite=%d%d%d",
                c.name.c_str(), e1, e2, e3, tol.grad, f1, f2, f3);
  check(f1 && f2 && f3 && e1 < tol.grad && e2 < tol.grad && e3 < tol.grad, msg);
  bool dead_grad_zero = true;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t n = 0; n < N; ++n)
      for (int64_t i = 0; i < T; ++i)
        if (row_dead[(b * N + n) * T + i])
          for (int64_t d = 0; d < D; ++d)
            if (dq.at(b, i, n, d) != 0.0f) dead_grad_zero = false;
  check(dead_grad_zero, c.name + ": fully masked rows must have dQ == 0");

  // Reruns: bit for bit the first backward.
  for (int run = 1; run <= backend.backward_reruns(); ++run) {
    Seq dq2(c.dt, B, T, N, D, c.bnth), dk2(c.dt, B, S, K, D, c.bnth), dv2(c.dt, B, S, K, D, c.bnth);
    BackwardOperands b2 = bo;
    b2.dq = dq2.view();
    b2.dk = dk2.view();
    b2.dv = dv2.view();
    dq2.buf.poison();
    dk2.buf.poison();
    dv2.buf.poison();
    err = backend.backward(p, b2, run);
    check(err == nullptr, c.name + ": backward rerun error " + (err ? err : ""));
    const bool same = dq2.buf.bytes == dq.buf.bytes && dk2.buf.bytes == dk.buf.bytes &&
                      dv2.buf.bytes == dv.buf.bytes;
    check(same, c.name + ": backward run " + std::to_string(run) + " differs bit for bit");
  }

  // ---- Bias gradient ----
  if (has_bias) {
    std::vector<float> db(bias.n);
    std::fill(db.begin(), db.end(), NAN);
    BiasGradOperands go;
    go.q = q.view();
    go.k = k.view();
    go.v = v.view();
    go.o = o.view();
    go.d_o = dO.view();
    go.lse = lse.data();
    go.dbias = db.data();
    err = backend.bias_grad(p, go, 0);
    if (check(err == nullptr, c.name + ": bias grad error " + (err ? err : ""))) {
      bool fb;
      double eb = rel_err(rdB, [&](int64_t i) { return double(db[i]); }, bias.n, &fb);
      // Summing dS over a whole softmax row gives ~0 analytically (D = sum P dP),
      // so measure the error against the norm of the summed magnitudes too.
      double nref = 0, nabs = 0;
      for (int64_t i = 0; i < bias.n; ++i) {
        nref += rdB[i] * rdB[i];
        nabs += rdBabs[i] * rdBabs[i];
      }
      if (nref < 1e-4 * nabs) eb *= std::sqrt(nref / (1e-4 * nabs));
      std::snprintf(msg, sizeof msg, "%s: dbias rel err %.3g (tol %.3g) finite=%d", c.name.c_str(),
                    eb, tol.bias_grad, fb);
      check(fb && eb < tol.bias_grad, msg);
      for (int run = 1; run <= backend.backward_reruns(); ++run) {
        std::vector<float> db2(bias.n, NAN);
        go.dbias = db2.data();
        err = backend.bias_grad(p, go, run);
        check(err == nullptr && std::memcmp(db.data(), db2.data(), db.size() * 4) == 0,
              c.name + ": dbias run " + std::to_string(run) + " differs bit for bit");
      }
    }
  }
  std::printf("  ok-ish %-44s %s O %.2e dq %.2e dk %.2e dv %.2e dead=%lld\n", c.name.c_str(),
              dname(c.dt), eo, e1, e2, e3, static_cast<long long>(ndead));
}

// The cases every backend runs: each dtype with causality, GQA, T != S,
// biases and masks of several broadcast patterns, windows, lengths, the BNTH
// layout and head dims 1 to 256; then packed sequences (segment ids).
inline std::vector<Case> standard_cases() {
  std::vector<Case> cs;
  auto add = [&](Case c) { cs.push_back(c); };
  for (DType dt : {DType::kF32, DType::kBF16, DType::kF16}) {
    std::string sfx = std::string("_") + dname(dt);
    {
      Case c;
      c.name = "causal_gqa2_d64" + sfx;
      c.B = 2; c.N = 4; c.K = 2; c.T = 77; c.S = 77; c.D = 64; c.causal = true; c.dt = dt;
      add(c);
    }
    {
      Case c;
      c.name = "nocausal_gqa8_d32_TneS" + sfx;
      c.B = 1; c.N = 8; c.K = 1; c.T = 130; c.S = 95; c.D = 32; c.dt = dt;
      add(c);
    }
    {
      Case c;
      c.name = "bias_B1TS_d80_bnth" + sfx;
      c.B = 2; c.N = 2; c.K = 2; c.T = 65; c.S = 200; c.D = 80; c.dt = dt; c.bnth = true;
      c.bias_dims[0] = 2; c.bias_dims[1] = 1; c.bias_dims[2] = 2; c.bias_dims[3] = 2;
      add(c);
    }
    {
      Case c;
      c.name = "window_mask_d128" + sfx;
      c.B = 1; c.N = 2; c.K = 1; c.T = 150; c.S = 140; c.D = 128; c.dt = dt; c.wl = 20; c.wr = 5;
      c.mask_dims[0] = 1; c.mask_dims[1] = 2; c.mask_dims[2] = 2; c.mask_dims[3] = 2;
      c.mask_full_rows = true;
      add(c);
    }
    {
      Case c;
      c.name = "causal_lengths_d256" + sfx;
      c.B = 3; c.N = 2; c.K = 1; c.T = 100; c.S = 90; c.D = 256; c.dt = dt; c.causal = true;
      c.qlens = true; c.kvlens = true;
      add(c);
    }
  }
  {
    Case c;
    c.name = "bias_1N1S_bf16bias_gqa2_d256";
    c.B = 1; c.N = 4; c.K = 2; c.T = 70; c.S = 129; c.D = 256; c.causal = true;
    c.bias_dims[0] = 1; c.bias_dims[1] = 2; c.bias_dims[2] = 1; c.bias_dims[3] = 2;
    c.bias_dt = DType::kBF16;
    add(c);
  }
  {
    Case c;
    c.name = "bias_scalar_f16bias";
    c.B = 2; c.N = 2; c.K = 1; c.T = 33; c.S = 47; c.D = 48; c.dt = DType::kBF16;
    c.bias_dims[0] = 1; c.bias_dims[1] = 1; c.bias_dims[2] = 1; c.bias_dims[3] = 1;
    c.bias_dt = DType::kF16;
    add(c);
  }
  {
    Case c;
    c.name = "bias_BNT1_lengths";
    c.B = 2; c.N = 2; c.K = 2; c.T = 66; c.S = 70; c.D = 64; c.qlens = true; c.kvlens = true;
    c.bias_dims[0] = 2; c.bias_dims[1] = 2; c.bias_dims[2] = 2; c.bias_dims[3] = 1;
    add(c);
  }
  {
    Case c;
    c.name = "bias_full_neginf_mask_causal";
    c.B = 2; c.N = 2; c.K = 1; c.T = 80; c.S = 80; c.D = 64; c.causal = true;
    c.bias_dims[0] = 2; c.bias_dims[1] = 2; c.bias_dims[2] = 2; c.bias_dims[3] = 2;
    c.bias_neg_inf = true;
    c.mask_dims[0] = 2; c.mask_dims[1] = 1; c.mask_dims[2] = 2; c.mask_dims[3] = 2;
    c.mask_full_rows = true;
    add(c);
  }
  {
    Case c;
    c.name = "bias_11TS_causal_TgtS";
    c.B = 1; c.N = 2; c.K = 2; c.T = 200; c.S = 64; c.D = 64; c.causal = true;
    c.bias_dims[0] = 1; c.bias_dims[1] = 1; c.bias_dims[2] = 2; c.bias_dims[3] = 2;
    add(c);
  }
  {
    Case c;
    c.name = "causal_TltS_window_left";
    c.B = 1; c.N = 2; c.K = 1; c.T = 64; c.S = 300; c.D = 64; c.causal = true; c.wl = 3;
    add(c);
  }
  {
    Case c;
    c.name = "tiny_d1";
    c.B = 1; c.N = 1; c.K = 1; c.T = 1; c.S = 1; c.D = 1;
    add(c);
  }
  {
    Case c;
    c.name = "small_d3_f16";
    c.B = 1; c.N = 3; c.K = 3; c.T = 5; c.S = 17; c.D = 3; c.dt = DType::kF16; c.causal = true;
    add(c);
  }
  {
    Case c;
    c.name = "d200_window_right_only";
    c.B = 1; c.N = 2; c.K = 2; c.T = 129; c.S = 129; c.D = 200; c.wr = 0; c.wl = -1;
    add(c);
  }
  {
    Case c;
    c.name = "exact_tiles_causal_d64";
    c.B = 1; c.N = 2; c.K = 1; c.T = 128; c.S = 128; c.D = 64; c.causal = true;
    add(c);
  }
  // Multi-tile problems at the tensor-core head dims, with tile edges that
  // are not whole.
  {
    Case c;
    c.name = "causal_gqa4_d128_multitile";
    c.B = 1; c.N = 4; c.K = 1; c.T = 300; c.S = 330; c.D = 128; c.dt = DType::kBF16;
    c.causal = true;
    add(c);
  }
  {
    // Not causal, with lengths: the D = 128 kernels' query steps end inside
    // a tile and past the query length.
    Case c;
    c.name = "lengths_gqa2_d128_multitile_f16";
    c.B = 3; c.N = 4; c.K = 2; c.T = 333; c.S = 270; c.D = 128; c.dt = DType::kF16;
    c.qlens = true; c.kvlens = true;
    add(c);
  }
  {
    Case c;
    c.name = "causal_gqa2_d256_multitile";
    c.B = 1; c.N = 4; c.K = 2; c.T = 200; c.S = 330; c.D = 256; c.dt = DType::kBF16;
    c.causal = true;
    add(c);
  }
  // More keys than one 1,024-key group of the AMX forward: the running max
  // and the output rescaled between groups, a last group partly filled.
  {
    Case c;
    c.name = "long_keys_d64_bf16";
    c.B = 1; c.N = 2; c.K = 1; c.T = 70; c.S = 2200; c.D = 64; c.dt = DType::kBF16;
    add(c);
  }
  // Queries enough for the CUDA forward's three-consumer kernel at D = 64
  // without causality (kernel_choice.h, hopper_fwd_consumers: T >= 2048),
  // the last of its 192-row blocks partly past T.
  {
    Case c;
    c.name = "long_queries_d64_bf16";
    c.B = 1; c.N = 2; c.K = 1; c.T = 2100; c.S = 130; c.D = 64; c.dt = DType::kBF16;
    add(c);
  }
  // Packed sequences: B, N, K, T = S or T, S, D, dtype, causality, layout.
  auto packed = [&](const char* name, int64_t B, int64_t N, int64_t K, int64_t T, int64_t S,
                    int64_t D, DType dt, bool causal, Segments segments, int64_t documents) {
    Case c;
    c.name = name;
    c.B = B; c.N = N; c.K = K; c.T = T; c.S = S; c.D = D; c.dt = dt;
    c.causal = causal; c.segments = segments; c.documents = documents;
    add(c);
  };
  packed("segments_sorted_causal_d128", 2, 4, 2, 200, 200, 128, DType::kBF16, true,
         Segments::kSorted, 5);
  // Documents of 350 tokens: tiles inside one document skip the per-score
  // compare, runs longer than the kernels' record, T not a multiple of 16.
  packed("segments_long_causal_gqa4_d128", 2, 4, 1, 700, 700, 128, DType::kBF16, true,
         Segments::kSorted, 2);
  packed("segments_unsorted_d64", 1, 2, 1, 180, 150, 64, DType::kF16, false,
         Segments::kUnsorted, 5);
  packed("segments_padding_causal_d256", 1, 4, 1, 150, 150, 256, DType::kBF16, true,
         Segments::kPadding, 5);
  {
    Case c;
    c.name = "segments_sorted_bias_d64_f32";
    c.B = 2; c.N = 2; c.K = 1; c.T = 90; c.S = 110; c.D = 64; c.segments = Segments::kSorted;
    c.bias_dims[0] = 1; c.bias_dims[1] = 2; c.bias_dims[2] = 2; c.bias_dims[3] = 2;
    add(c);
  }
  return cs;
}

}  // namespace fatrain::testing
