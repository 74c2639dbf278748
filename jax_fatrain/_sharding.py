"""Sharded execution: each device runs the kernels on its own shard.

Without a partitioning rule XLA treats an FFI call as opaque: it gathers every
operand onto every device and runs the whole attention there. This module wraps
each stage (forward, backward, bias_grad) of every implementation in
``jax.experimental.custom_partitioning``:

* a Shardy ``sharding_rule`` (the einsum-like string, built per call from the
  operand shapes) tells the propagation pass how the dims of q/k/v/bias/mask/
  lengths/o/lse relate, so shardings flow through the op in both directions;
* the ``partition`` callback looks at the shardings XLA settled on, picks the
  operand/result shardings we support and returns the per-device function.

What the per-device function does:

* **Batch / heads** (dim 0, and the head dim of the layout): every device runs
  the unchanged kernel on its shard; no collective at all, forward or backward.
  GQA: query head ``n`` uses kv head ``n // G`` (``G = N // K``), so sharding
  the heads over ``P`` devices keeps whole groups together when ``K % P == 0``
  (kv heads are sharded the same way). When ``P % K == 0`` (a group is split
  over several devices, e.g. ``K = 1``) k/v are replicated over the head axes
  and each device slices out the one kv head its query heads use; the backward
  then sums the dK/dV of the devices sharing a kv head (an all-reduce over the
  head axes of k/v-sized arrays). Any other combination falls back to
  replicated heads (XLA gathers q over the head axes).
* **Sequence** (the T dim of q / S dim of k and v): ring attention over the
  mesh axes that shard the sequence. K/V blocks travel around the ring with
  ``lax.ppermute`` (in the backward together with their dK/dV partial sums);
  partial outputs are merged through the logsumexp. Causal attention is load
  balanced with a zig-zag layout: the user's contiguous shards are permuted
  inside the op (two collective-permutes of half shards per tensor) so that
  device ``d`` holds sequence blocks ``d`` and ``2P-1-d``, and the results are
  permuted back. Each ring step calls the unchanged kernels on local blocks.
* Operands whose dims are broadcast (size 1 bias/mask dims) are replicated on
  those dims; full-size dims follow the batch/head sharding of q; lengths
  follow the batch sharding; segment ids follow the batch and sequence
  sharding of q (query ids) and k (key ids), and in ring attention the key
  ids travel around the ring with their K/V blocks. The head dim H is never
  split.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec

from jax_fatrain._config import AttentionConfig

# Measurement/debugging switch: when True, stages are not partitioned (XLA
# gathers the operands and runs the whole attention on every device). Read at
# trace time.
DISABLED = False

# Operand roles, by position (the stage operands of _op.py): forward has the
# first 7 and then the two segment-id roles, backward and bias_grad all 10 and
# then the segment ids.
_ROLES = ("q", "kv", "kv", "bias", "mask", "len", "len", "q", "lse", "q")
_SEGMENT_ROLES = ("qseg", "kvseg")
_BIAS, _MASK = 3, 4


def _roles(n_operands: int) -> tuple[str, ...]:
  return _ROLES[:n_operands - 2] + _SEGMENT_ROLES


def _call(impl, stage: str, config: AttentionConfig, *operands):
  """The implementation's stage on stage operands (segment ids last, passed
  as keywords only when given)."""
  *rest, q_seg, kv_seg = operands
  segments = {} if q_seg is None else dict(q_segment_ids=q_seg, kv_segment_ids=kv_seg)
  return getattr(impl, stage)(*rest, config=config, **segments)


def partitioned(impl, stage: str, config: AttentionConfig) -> Callable:
  """``fn(*operands)`` (None for absent ones) that partitions over a mesh."""
  plain = functools.partial(_call, impl, stage, config)

  def call(*operands):
    if DISABLED:
      return plain(*operands)
    present = tuple(x is not None for x in operands)
    dense = tuple(x for x in operands if x is not None)
    return _custom(impl, stage, config, present)(*dense)

  return call


def _expand(present, dense):
  it = iter(dense)
  return [next(it) if p else None for p in present]


@functools.lru_cache(maxsize=None)
def _custom(impl, stage: str, config: AttentionConfig, present: tuple[bool, ...]):
  plain = functools.partial(_call, impl, stage, config)

  @custom_partitioning
  def fn(*dense):
    return plain(*_expand(present, dense))

  def rule(mesh, operand_types, result_types):
    del mesh, result_types
    from jax._src.lib.mlir import ir  # pylint: disable=import-outside-toplevel
    shapes = [tuple(ir.RankedTensorType(t).shape) for t in operand_types]
    return _sharding_rule(stage, config, present, shapes)

  def partition(mesh, arg_shapes, result_shape):
    return _partition(impl, stage, config, present, mesh, arg_shapes, result_shape)

  fn.def_partition(partition=partition, sharding_rule=rule, decode_shardings=False,
                   infer_sharding_from_operands=functools.partial(
                       _infer, impl, stage, config, present))
  return fn


# ---------------------------------------------------------------------------
# Shardy rule.
# ---------------------------------------------------------------------------


def _sharding_rule(stage, config, present, shapes):
  full = _expand(present, shapes)
  q, k = full[0], full[1]
  seq, head = config.seq_axis, config.head_axis
  n, kh = q[head], k[head]
  g = n // kh
  # Query and kv heads are separate factors on purpose: a compound "(k g)"
  # makes Shardy split a mesh axis into sub-axes when K is not divisible by
  # it, which the partition callback cannot decode. The callback enforces the
  # GQA relation itself (see _make_plan).
  heads = "n"
  kv_heads = "n" if g == 1 else "k"

  def layout(b, s, h):
    dims = [b, None, None, "h"]
    dims[seq], dims[head] = s, h
    return " ".join(dims)

  q_map = layout("b", "t", heads)
  kv_map = layout("b", "s", kv_heads)
  lse_map = f"b {heads} t"
  unique = iter(f"u{i}" for i in range(64))

  def score_map(shape):
    names = ("b", heads, "t", "s")
    return " ".join(nm if d != 1 or f == 1 else next(unique)
                    for nm, d, f in zip(names, shape, (q[0], n, q[seq], k[seq])))

  maps = []
  bias_map = None
  roles = _roles(len(full))
  for i, x in enumerate(full):
    if x is None:
      continue
    role = roles[i]
    if role == "qseg":
      maps.append("b t")
    elif role == "kvseg":
      maps.append("b s")
    elif role == "q":
      maps.append(q_map)
    elif role == "kv":
      maps.append(kv_map)
    elif role == "lse":
      maps.append(lse_map)
    elif role == "len":
      maps.append("b")
    else:
      m = score_map(x)
      if i == _BIAS:
        bias_map = m
      maps.append(m)
  if stage == "forward":
    results = f"{q_map}, {lse_map}"
  elif stage == "backward":
    results = f"{q_map}, {kv_map}, {kv_map}"
  else:
    results = bias_map
  kwargs = {}
  if stage == "bias_grad":
    used = set(results.split())
    # Factors that vanish in dbias (in order of appearance: Shardy wants the
    # special factors sorted by index).
    kwargs["reduction_factors"] = tuple(dict.fromkeys(
        f for f in " ".join(maps).replace(",", " ").split() if f not in used))
  return f"{', '.join(maps)} -> {results}", kwargs


# ---------------------------------------------------------------------------
# The partition plan.
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Plan:
  batch: tuple[str, ...]
  heads: tuple[str, ...]
  seq: tuple[str, ...]
  head_mode: str          # "none", "split" (kv heads sharded too), "slice"
  mesh_shape: tuple[tuple[str, int], ...]

  def size(self, axes):
    shape = dict(self.mesh_shape)
    return math.prod(shape[a] for a in axes)


def _axes_of(entry) -> tuple[str, ...]:
  if entry is None:
    return ()
  if isinstance(entry, (tuple, list)):
    return tuple(entry)
  return (entry,)


def _entry(axes):
  if not axes:
    return None
  return axes[0] if len(axes) == 1 else tuple(axes)


def _spec_of(x, ndim, mesh):
  """The PartitionSpec of an operand over `mesh`, or None if it has none."""
  sharding = getattr(x, "sharding", None)
  if isinstance(sharding, NamedSharding):
    spec = tuple(sharding.spec)
  else:
    # decode_shardings=False: we decode here so that a sharding which is not
    # a plain PartitionSpec of the mesh (e.g. over a sub-axis) falls back to
    # running replicated instead of failing inside the partitioner.
    try:
      from jax._src import sharding_impls  # pylint: disable=import-outside-toplevel
      hlo = sharding._to_xla_hlo_sharding(ndim)
      spec = tuple(sharding_impls.parse_flatten_op_sharding(hlo, mesh)[0])
    except Exception:  # pylint: disable=broad-except
      return None
  return spec + (None,) * (ndim - len(spec))


def _make_plan(config, present, mesh, shapes) -> _Plan | None:
  full = _expand(present, shapes)
  q, k = full[0], full[1]
  q_spec, k_spec = _spec_of(q, 4, mesh), _spec_of(k, 4, mesh)
  if q_spec is None or k_spec is None:
    return None
  seq_ax, head_ax = config.seq_axis, config.head_axis
  mesh_shape = tuple(mesh.shape.items())
  sizes = dict(mesh_shape)
  size = lambda axes: math.prod(sizes[a] for a in axes)
  b, t, n = q.shape[0], q.shape[seq_ax], q.shape[head_ax]
  s, kh = k.shape[seq_ax], k.shape[head_ax]

  batch = _axes_of(q_spec[0])
  if b % size(batch):
    batch = ()
  heads = _axes_of(q_spec[head_ax])
  if n % size(heads):
    heads = ()
  seq = _axes_of(q_spec[seq_ax]) or _axes_of(k_spec[seq_ax])
  seq = tuple(a for a in seq if a not in batch and a not in heads)

  ph = size(heads)
  if ph == 1:
    head_mode = "none"
  elif kh % ph == 0:
    head_mode = "split"
  elif ph % kh == 0:
    head_mode = "slice"
  else:
    heads, head_mode = (), "none"

  ps = size(seq)
  if ps > 1:
    problems = []
    if any(full[i] is not None for i in range(3, 7)):
      problems.append("bias, mask and sequence lengths")
    if config.window_left >= 0 or config.window_right >= 0:
      problems.append("local_window_size")
    if config.is_causal and t != s:
      problems.append(f"causal attention with query length {t} != key length {s}")
    if problems:
      raise NotImplementedError(
          f"jax_fatrain: sequence-sharded (ring) attention over mesh axes {seq} "
          f"does not support {', '.join(problems)}. Shard over batch/heads only, "
          "or replicate the sequence axis of query/key/value.")
    blocks = 2 * ps if config.is_causal else ps
    if t % blocks or s % blocks:
      raise NotImplementedError(
          f"jax_fatrain: sequence-sharded (ring) attention over {ps} devices needs "
          f"query and key lengths divisible by {blocks}"
          f"{' (2 blocks per device for causal load balance)' if config.is_causal else ''}"
          f"; got {t} and {s}. Pad the sequence.")
  return _Plan(batch, heads, seq, head_mode, mesh_shape)


def _specs(plan: _Plan, config, present, shapes, stage):
  """(operand specs, result specs) for the plan."""
  full = _expand(present, shapes)
  q = full[0]
  seq_ax, head_ax = config.seq_axis, config.head_axis
  b, n = q.shape[0], q.shape[head_ax]

  def layout(heads):
    dims = [_entry(plan.batch), None, None, None]
    dims[seq_ax], dims[head_ax] = _entry(plan.seq), _entry(heads)
    return PartitionSpec(*dims)

  q_spec = layout(plan.heads)
  kv_spec = layout(plan.heads if plan.head_mode == "split" else ())
  lse_spec = PartitionSpec(_entry(plan.batch), _entry(plan.heads), _entry(plan.seq))

  def score_spec(x):
    bb, nb = x.shape[0], x.shape[1]
    return PartitionSpec(_entry(plan.batch) if bb == b and bb != 1 else None,
                         _entry(plan.heads) if nb == n and nb != 1 else None,
                         None, None)

  args = []
  roles = _roles(len(full))
  seg_spec = PartitionSpec(_entry(plan.batch), _entry(plan.seq))
  for i, x in enumerate(full):
    if x is None:
      continue
    role = roles[i]
    if role in ("bias", "mask"):
      args.append(score_spec(x))
    else:
      args.append({"q": q_spec, "kv": kv_spec, "lse": lse_spec,
                   "len": PartitionSpec(_entry(plan.batch)),
                   "qseg": seg_spec, "kvseg": seg_spec}[role])
  if stage == "forward":
    results = (q_spec, lse_spec)
  elif stage == "backward":
    results = (q_spec, kv_spec, kv_spec)
  else:
    results = score_spec(full[_BIAS])
  return args, results


def _infer(impl, stage, config, present, mesh, arg_shapes, result_shape):
  """Result shardings for the GSPMD propagation (jax_use_shardy_partitioner=False)."""
  del impl, result_shape
  plan = _make_plan(config, present, mesh, arg_shapes)
  if plan is None:
    plan = _Plan((), (), (), "none", tuple(mesh.shape.items()))
  _, results = _specs(plan, config, present, arg_shapes, stage)
  return jax.tree.map(lambda s: NamedSharding(mesh, s), results,
                      is_leaf=lambda s: isinstance(s, PartitionSpec))


def _partition(impl, stage, config, present, mesh, arg_shapes, result_shape):
  del result_shape
  plan = _make_plan(config, present, mesh, arg_shapes)
  if plan is None:   # shardings that name no mesh axes: run replicated
    plan = _Plan((), (), (), "none", tuple(mesh.shape.items()))
  args, results = _specs(plan, config, present, arg_shapes, stage)
  named = lambda s: NamedSharding(mesh, s)
  arg_shardings = tuple(named(s) for s in args)
  if isinstance(results, tuple):
    result_shardings = tuple(named(s) for s in results)
  else:
    result_shardings = named(results)
  full_shapes = _expand(present, arg_shapes)

  def lower(*dense):
    ops = _expand(present, dense)
    return _local(impl, stage, config, plan, full_shapes, ops)

  return mesh, lower, result_shardings, arg_shardings


# ---------------------------------------------------------------------------
# Per-device computation.
# ---------------------------------------------------------------------------


def _local(impl, stage, config, plan: _Plan, full_shapes, ops):
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
    out = _call(impl, stage, config, *ops)

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
    bias = full_shapes[_BIAS]   # global shape: which dims are broadcast
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


def _to_zigzag(x, axis, plan: _Plan):
  p = plan.size(plan.seq)
  perm0, perm1 = _zigzag_perms(p)
  x0, x1 = _halves(x, axis)
  r0 = lax.ppermute(x0, plan.seq, perm0)   # even sub-blocks
  r1 = lax.ppermute(x1, plan.seq, perm1)   # odd sub-blocks
  # Device d holds sub-blocks d and 2p-1-d: the even one comes first iff d is even.
  even = lax.axis_index(plan.seq) % 2 == 0
  return jnp.concatenate([jnp.where(even, r0, r1), jnp.where(even, r1, r0)], axis)


def _from_zigzag(x, axis, plan: _Plan):
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
    return _call(impl, "forward", cfg, q, k, v, None, None, None, None, q_seg, kv_seg)
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
    grads = _call(impl, "backward", cfg, q, k, v, None, None, None, None, o, lse, d_o, q_seg,
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
