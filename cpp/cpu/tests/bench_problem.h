// The problem the CPU benchmarks time: B = 1, N = 8 heads (no GQA), T = S,
// head dim D, causal or not, q, k, v and dO drawn from a normal distribution
// (seed 1) in dtype dt and [B, T, N, D] layout, with the forward's and the
// backward's operands over them.
#pragma once

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "../attention_cpu.h"
#include "testing/attention_check.h"

struct BenchProblem {
  static constexpr int64_t kB = 1, kN = 8;
  fatrain::testing::Seq q, k, v, o, dO, dq, dk, dv;
  std::vector<float> lse;
  fatrain::AttentionProblem p;
  fatrain::ForwardOperands fo;
  fatrain::BackwardOperands bo;

  BenchProblem(fatrain::DType dt, int64_t T, int64_t D, bool causal)
      : q(dt, kB, T, kN, D, false), k(dt, kB, T, kN, D, false), v(dt, kB, T, kN, D, false),
        o(dt, kB, T, kN, D, false), dO(dt, kB, T, kN, D, false), dq(dt, kB, T, kN, D, false),
        dk(dt, kB, T, kN, D, false), dv(dt, kB, T, kN, D, false), lse(kB * kN * T) {
    std::mt19937_64 rng(1);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    for (fatrain::testing::Seq* x : {&q, &k, &v, &dO})
      for (int64_t i = 0; i < x->buf.n; ++i) x->buf.set(i, nd(rng));
    p.batch = kB;
    p.q_heads = kN;
    p.kv_heads = kN;
    p.q_len = T;
    p.kv_len = T;
    p.head_dim = D;
    p.scale = 1.0f / std::sqrt(float(D));
    p.causal = causal;
    fo.q = q.view(); fo.k = k.view(); fo.v = v.view(); fo.o = o.view(); fo.lse = lse.data();
    bo.q = q.view(); bo.k = k.view(); bo.v = v.view(); bo.o = o.view(); bo.d_o = dO.view();
    bo.lse = lse.data(); bo.dq = dq.view(); bo.dk = dk.view(); bo.dv = dv.view();
  }
  BenchProblem(const BenchProblem&) = delete;
  BenchProblem& operator=(const BenchProblem&) = delete;
};
