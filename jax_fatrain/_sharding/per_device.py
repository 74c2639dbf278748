"""What each device runs on its shard: the unchanged kernels when the batch or
the heads are sharded, ring attention when the sequence is."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jax import lax

from jax_fatrain._sharding.operands import BIAS, call
from jax_fatrain._sharding.placement import Plan


def local(impl, stage, config, plan: Plan, full_shapes, ops):
  """The stage on this device's shards `ops` (None for absent operands);
  `full_shapes` are the global operand shapes."""
  head_ax = config.head_axis
  q_full, k_full = full_shapes[0], full_shapes[1]
  n, kh = q_full.shape[head_ax], k_full.shape[head_ax]
  g = n // kh
  kv_head = None
  if plan.head_mode == "slice":
    n_local = n // plan.size(plan.heads)
    kv_head = (lax.axis_index(plan.heads) * n_local) // g
    ops[1], ops[2] = (lax.dynamic_slice_in_dim(x, kv_head, 1, axis=head_ax)
                      for x in (ops[1], ops[2]))

  if plan.seq and plan.size(plan.seq) > 1:
    segments = ops[-2:]
    if stage == "forward":
      out = _ring_forward(impl, config, plan, *ops[:3], *segments)
    elif stage == "backward":
      out = _ring_backward(impl, config, plan, *ops[:3], *ops[7:10], *segments)
    else:  # unreachable: bias is rejected by _make_plan
      raise NotImplementedError("bias gradient with a sharded sequence")
  else:
    out = call(impl, stage, config, *ops)

  if stage == "backward" and kv_head is not None:
    dq, dk, dv = out

    def scatter(x):
      shape = list(x.shape)
      shape[head_ax] = kh
      full = jnp.zeros(shape, x.dtype)
      full = lax.dynamic_update_slice_in_dim(full, x, kv_head, axis=head_ax)
      return lax.psum(full, plan.heads)
    out = (dq, scatter(dk), scatter(dv))
  if stage == "bias_grad":
    bias = full_shapes[BIAS]   # global shape: which dims are broadcast
    axes = ()
    if bias.shape[0] == 1:
      axes += plan.batch
    if bias.shape[1] == 1:
      axes += plan.heads
    if axes:
      out = lax.psum(out, axes)
  return out


def _slice(x, axis, start, stop):
  return lax.slice_in_dim(x, start, stop, axis=axis)


def _halves(x, axis):
  h = x.shape[axis] // 2
  return _slice(x, axis, 0, h), _slice(x, axis, h, 2 * h)


def _zigzag_perms(p):
  """Sub-block g (of 2p; contiguous: device g // 2, half g % 2) goes to
  device g (half 0) when g < p, else to device 2p-1-g (half 1)."""
  dst = lambda g: g if g < p else 2 * p - 1 - g
  return [[(s, dst(2 * s + e)) for s in range(p)] for e in (0, 1)]


def _to_zigzag(x, axis, plan: Plan):
  p = plan.size(plan.seq)
  perm0, perm1 = _zigzag_perms(p)
  x0, x1 = _halves(x, axis)
  r0 = lax.ppermute(x0, plan.seq, perm0)   # even sub-blocks
  r1 = lax.ppermute(x1, plan.seq, perm1)   # odd sub-blocks
  # Device d holds sub-blocks d and 2p-1-d: the even one comes first iff d is even.
  even = lax.axis_index(plan.seq) % 2 == 0
  return jnp.concatenate([jnp.where(even, r0, r1), jnp.where(even, r1, r0)], axis)


def _from_zigzag(x, axis, plan: Plan):
  p = plan.size(plan.seq)
  perm0, perm1 = _zigzag_perms(p)
  inverse = lambda perm: [(d, s) for s, d in perm]
  a, b = _halves(x, axis)
  even = lax.axis_index(plan.seq) % 2 == 0
  c0 = lax.ppermute(jnp.where(even, a, b), plan.seq, inverse(perm0))
  c1 = lax.ppermute(jnp.where(even, b, a), plan.seq, inverse(perm1))
  return jnp.concatenate([c0, c1], axis)


def _lse_as_o(w, layout):
  """[b, n, t] -> broadcastable against an o of the layout."""
  if layout == "BTNH":
    return jnp.swapaxes(w, 1, 2)[..., None]
  return w[..., None]


def _merge(o, lse, o_s, lse_s, layout):
  """Combines two partial softmax results (o in float32) through their lse."""
  m = jnp.maximum(lse, lse_s)
  finite = jnp.isfinite(m)
  m0 = jnp.where(finite, m, 0.0)
  w1, w2 = jnp.exp(lse - m0), jnp.exp(lse_s - m0)
  total = w1 + w2
  inv = jnp.where(total > 0, 1.0 / jnp.where(total > 0, total, 1.0), 0.0)
  new_lse = jnp.where(finite & (total > 0), m0 + jnp.log(jnp.where(total > 0, total, 1.0)),
                      -jnp.inf)
  o = (o * _lse_as_o(w1 * inv, layout)
       + o_s.astype(jnp.float32) * _lse_as_o(w2 * inv, layout))
  return o, new_lse


def _ring_perm(p):
  return [(i, (i + 1) % p) for i in range(p)]


def _seg_halves(x):
  """Halves of [b, t] segment ids (None stays None)."""
  return (None, None) if x is None else _halves(x, 1)


def _ring_forward(impl, config, plan, q, k, v, q_seg=None, kv_seg=None):
  p = plan.size(plan.seq)
  sa, layout, causal = config.seq_axis, config.layout, config.is_causal
  full_cfg = dataclasses.replace(config, is_causal=False)
  perm = _ring_perm(p)

  def fwd(q, k, v, q_seg, kv_seg, cfg):
    return call(impl, "forward", cfg, q, k, v, None, None, None, None, q_seg, kv_seg)
  if causal:
    q, k, v = (_to_zigzag(x, sa, plan) for x in (q, k, v))
    if q_seg is not None:
      q_seg, kv_seg = (_to_zigzag(x, 1, plan) for x in (q_seg, kv_seg))
  d = lax.axis_index(plan.seq)
  # Step 0: the device's own kv blocks (the diagonal; with the zig-zag layout a
  # top-left causal mask on the local [d; 2p-1-d] blocks is exactly right).
  o, lse = fwd(q, k, v, q_seg, kv_seg, config)
  o = o.astype(jnp.float32)

  # Key segment ids (when given) travel with their K/V blocks.
  def body(r, carry):
    k, v, kv_seg, o, lse = carry
    k, v = lax.ppermute(k, plan.seq, perm), lax.ppermute(v, plan.seq, perm)
    if kv_seg is not None:
      kv_seg = lax.ppermute(kv_seg, plan.seq, perm)
    if not causal:
      o, lse = _merge(o, lse, *fwd(q, k, v, q_seg, kv_seg, full_cfg), layout)
      return k, v, kv_seg, o, lse

    # The kv blocks now held came from device j = d - r (mod p).
    def below(o, lse):   # j < d: all local queries see kv block j (the first half)
      kh, vh = _halves(k, sa)[0], _halves(v, sa)[0]
      return _merge(o, lse, *fwd(q, kh, vh, q_seg, _seg_halves(kv_seg)[0], full_cfg),
                    layout)

    def above(o, lse):   # j > d: only block 2p-1-d sees both kv blocks
      q1 = _halves(q, sa)[1]
      o_s, lse_s = fwd(q1, k, v, _seg_halves(q_seg)[1], kv_seg, full_cfg)
      o0, o1 = _halves(o, sa)
      l0, l1 = _halves(lse, 2)
      o1, l1 = _merge(o1, l1, o_s, lse_s, layout)
      return jnp.concatenate([o0, o1], sa), jnp.concatenate([l0, l1], 2)

    o, lse = lax.cond(r <= d, below, above, o, lse)
    return k, v, kv_seg, o, lse

  _, _, _, o, lse = lax.fori_loop(1, p, body, (k, v, kv_seg, o, lse))
  o = o.astype(q.dtype)
  if causal:
    o, lse = _from_zigzag(o, sa, plan), _from_zigzag(lse, 2, plan)
  return o, lse


def _ring_backward(impl, config, plan, q, k, v, o, lse, d_o, q_seg=None, kv_seg=None):
  p = plan.size(plan.seq)
  sa, causal = config.seq_axis, config.is_causal
  full_cfg = dataclasses.replace(config, is_causal=False)
  perm = _ring_perm(p)
  dtypes = (q.dtype, k.dtype, v.dtype)

  def bwd(q, k, v, o, lse, d_o, q_seg, kv_seg, cfg):
    grads = call(impl, "backward", cfg, q, k, v, None, None, None, None, o, lse, d_o, q_seg,
                  kv_seg)
    return tuple(g.astype(jnp.float32) for g in grads)

  if causal:
    q, k, v, o, d_o = (_to_zigzag(x, sa, plan) for x in (q, k, v, o, d_o))
    lse = _to_zigzag(lse, 2, plan)
    if q_seg is not None:
      q_seg, kv_seg = (_to_zigzag(x, 1, plan) for x in (q_seg, kv_seg))
  d = lax.axis_index(plan.seq)
  dq, dk, dv = bwd(q, k, v, o, lse, d_o, q_seg, kv_seg, config)

  def body(r, carry):
    k, v, kv_seg, dk, dv, dq = carry
    # dK/dV partial sums (and key segment ids) travel with their K/V blocks.
    k, v, dk, dv = (lax.ppermute(x, plan.seq, perm) for x in (k, v, dk, dv))
    if kv_seg is not None:
      kv_seg = lax.ppermute(kv_seg, plan.seq, perm)
    if not causal:
      dq_s, dk_s, dv_s = bwd(q, k, v, o, lse, d_o, q_seg, kv_seg, full_cfg)
      return k, v, kv_seg, dk + dk_s, dv + dv_s, dq + dq_s

    def below(dq, dk, dv):   # j < d: all queries against the first kv half
      kh, vh = _halves(k, sa)[0], _halves(v, sa)[0]
      dq_s, dk_s, dv_s = bwd(q, kh, vh, o, lse, d_o, q_seg, _seg_halves(kv_seg)[0],
                             full_cfg)
      (dk0, dk1), (dv0, dv1) = _halves(dk, sa), _halves(dv, sa)
      return (dq + dq_s, jnp.concatenate([dk0 + dk_s, dk1], sa),
              jnp.concatenate([dv0 + dv_s, dv1], sa))

    def above(dq, dk, dv):   # j > d: the second query half against both kv halves
      q1, o1, do1 = (_halves(x, sa)[1] for x in (q, o, d_o))
      l1 = _halves(lse, 2)[1]
      dq_s, dk_s, dv_s = bwd(q1, k, v, o1, l1, do1, _seg_halves(q_seg)[1], kv_seg, full_cfg)
      dq0, dq1 = _halves(dq, sa)
      return jnp.concatenate([dq0, dq1 + dq_s], sa), dk + dk_s, dv + dv_s

    dq, dk, dv = lax.cond(r <= d, below, above, dq, dk, dv)
    return k, v, kv_seg, dk, dv, dq

  _, _, _, dk, dv, dq = lax.fori_loop(1, p, body, (k, v, kv_seg, dk, dv, dq))
  # One more hop brings each dK/dV accumulator back to the device owning its block.
  dk, dv = lax.ppermute(dk, plan.seq, perm), lax.ppermute(dv, plan.seq, perm)
  if causal:
    dq, dk, dv = (_from_zigzag(x, sa, plan) for x in (dq, dk, dv))
  return tuple(x.astype(t) for x, t in zip((dq, dk, dv), dtypes))
