"""Packed sequences: the segment-id arguments around the kernels.

Values and gradients of every implementation against jax.nn with the
equivalent boolean mask run in the shared suite (test_attention.CASES, the
``seg_*`` cases); here: argument checks, rank-3 calls, the [B, H, L, D]
pair, vmap, no cotangent for the ids, and the Flax adapter.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_fatrain
from attention_cases import (IMPLEMENTATIONS, Case, jax_nn_kwargs, make_inputs,
                             relative_error, segment_ids)

Q = jnp.ones((2, 8, 4, 16), jnp.float32)
KV = jnp.ones((2, 10, 2, 16), jnp.float32)
QS = jnp.zeros((2, 8), jnp.int32)
KS = jnp.zeros((2, 10), jnp.int32)


def call(**changes):
  args = dict(query=Q, key=KV, value=KV, implementation="cpu", q_segment_ids=QS,
              kv_segment_ids=KS)
  args.update(changes)
  return jax_fatrain.dot_product_attention(**args)


@pytest.mark.parametrize("changes, error, message", [
    (dict(kv_segment_ids=None), ValueError,
     r"q_segment_ids was given without kv_segment_ids: pass both"),
    (dict(q_segment_ids=None), ValueError,
     r"kv_segment_ids was given without q_segment_ids: pass both"),
    (dict(q_segment_ids=QS.astype(jnp.float32)), TypeError, r"q_segment_ids must be int32, got float32"),
    (dict(kv_segment_ids=KS.astype(jnp.int16)), TypeError, r"kv_segment_ids must be int32, got int16"),
    (dict(q_segment_ids=QS[:, :7]), ValueError,
     r"q_segment_ids must have shape \[B, T\] = \[2, 8\], got \(2, 7\)"),
    (dict(kv_segment_ids=KS[None]), ValueError,
     r"kv_segment_ids must have shape \[B, S\] = \[2, 10\], got \(1, 2, 10\)"),
    (dict(q_segment_ids=QS[0]), ValueError, r"q_segment_ids must have shape \[B, T\]"),
])
def test_bad_segment_ids_raise_at_trace_time(changes, error, message):
  with pytest.raises(error, match=message):
    call(**changes)
  with pytest.raises(error, match=message):
    jax.jit(lambda: call(**changes)).lower()


def test_bhld_pair_checks_segment_ids():
  q, kv = jnp.ones((2, 4, 8, 16)), jnp.ones((2, 2, 10, 16))
  with pytest.raises(ValueError, match=r"q_segment_ids must have shape \[B, T\] = \[2, 8\]"):
    jax_fatrain.flash_attn_train_fwd(q, kv, kv, scale=0.25, causal=False,
                                     q_segment_ids=KS, kv_segment_ids=KS)
  with pytest.raises(ValueError, match=r"kv_segment_ids was given without q_segment_ids"):
    jax_fatrain.flash_attn_train_bwd(q, kv, kv, q, jnp.zeros((2, 4, 8)), q, scale=0.25,
                                     causal=False, kv_segment_ids=KS)


def _packed(case: Case, seed: int):
  x = make_inputs(case, seed)
  return x, x.kwargs(case)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_unbatched_rank3_takes_rank1_ids(implementation):
  case = Case(batch=1, q_len=40, kv_len=40, is_causal=True, segments="sorted")
  x, kw = _packed(case, 2)
  got = jax_fatrain.dot_product_attention(
      x.q[0], x.k[0], x.v[0], is_causal=True, q_segment_ids=x.q_segment_ids[0],
      kv_segment_ids=x.kv_segment_ids[0], implementation=implementation)
  want = jax.nn.dot_product_attention(x.q, x.k, x.v, **jax_nn_kwargs(
      dict(is_causal=True, q_segment_ids=x.q_segment_ids, kv_segment_ids=x.kv_segment_ids)))
  assert got.shape == x.q.shape[1:]
  assert relative_error(got, want[0]) < 1e-4


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_bhld_pair_matches_the_op(implementation):
  """flash_attn_train_fwd/bwd with segment ids equal the op's values and gradients."""
  case = Case(q_len=70, kv_len=70, q_heads=4, kv_heads=2, is_causal=True, segments="sorted")
  x, kw = _packed(case, 4)
  ids = dict(q_segment_ids=x.q_segment_ids, kv_segment_ids=x.kv_segment_ids)
  scale = 1 / np.sqrt(case.head_dim)
  to_bhld = lambda a: jnp.swapaxes(a, 1, 2)
  q, k, v, ct = (to_bhld(a) for a in (x.q, x.k, x.v, x.cotangent))
  o, lse = jax_fatrain.flash_attn_train_fwd(q, k, v, scale=scale, causal=True,
                                            implementation=implementation, **ids)
  dq, dk, dv = jax_fatrain.flash_attn_train_bwd(q, k, v, o, lse, ct, scale=scale, causal=True,
                                                implementation=implementation, **ids)

  def loss(q, k, v):
    out = jax_fatrain.dot_product_attention(q, k, v, is_causal=True,
                                            implementation=implementation, **ids)
    return jnp.sum(out * x.cotangent)
  want_o = jax_fatrain.dot_product_attention(x.q, x.k, x.v, is_causal=True,
                                             implementation=implementation, **ids)
  grads = jax.grad(loss, argnums=(0, 1, 2))(x.q, x.k, x.v)
  assert relative_error(to_bhld(o), want_o) < 1e-6
  for got, want in zip((dq, dk, dv), grads):
    assert relative_error(to_bhld(got), want) < 1e-6


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_vmap_over_segment_ids(implementation):
  """Mapped ids (one packing per mapped element) fold into the batch like q."""
  case = Case(q_len=50, kv_len=50, is_causal=True, segments="sorted")
  xs = [make_inputs(case, seed=s) for s in range(3)]
  stack = lambda name: jnp.stack([getattr(x, name) for x in xs])
  q, q_seg, kv_seg, ct = (stack(n) for n in ("q", "q_segment_ids", "kv_segment_ids",
                                             "cotangent"))
  k, v = xs[0].k, xs[0].v
  attn = functools.partial(jax_fatrain.dot_product_attention, is_causal=True,
                           implementation=implementation)

  def loss(q, k, v, q_seg, kv_seg, ct):
    return jnp.sum(attn(q, k, v, q_segment_ids=q_seg, kv_segment_ids=kv_seg) * ct)
  grad = jax.grad(loss, argnums=(0, 1, 2))
  batched = jax.jit(jax.vmap(grad, in_axes=(0, None, None, 0, 0, 0)))(
      q, k, v, q_seg, kv_seg, ct)
  single_grad = jax.jit(grad)
  for i in range(3):
    single = single_grad(q[i], k, v, q_seg[i], kv_seg[i], ct[i])
    for got, want in zip(batched, single):
      assert relative_error(got[i], want) < 1e-5
  # Unmapped ids with a mapped query: the same packing for every element.
  packed = lambda q, q_seg, kv_seg: attn(q, k, v, q_segment_ids=q_seg, kv_segment_ids=kv_seg)
  out = jax.jit(jax.vmap(packed, in_axes=(0, None, None)))(q, q_seg[0], kv_seg[0])
  single_out = jax.jit(packed)
  for i in range(3):
    assert relative_error(out[i], single_out(q[i], q_seg[0], kv_seg[0])) < 1e-6


def test_segment_ids_get_no_cotangent():
  case = Case(q_len=20, kv_len=20, segments="unsorted")
  x = make_inputs(case, seed=1)

  def loss(q, q_seg, kv_seg):
    return jnp.sum(jax_fatrain.dot_product_attention(
        q, x.k, x.v, q_segment_ids=q_seg, kv_segment_ids=kv_seg, implementation="xla"))
  dq, d_qseg, d_kvseg = jax.jit(jax.grad(loss, argnums=(0, 1, 2), allow_int=True))(
      x.q, x.q_segment_ids, x.kv_segment_ids)
  assert d_qseg.dtype == jax.dtypes.float0 and d_kvseg.dtype == jax.dtypes.float0
  assert d_qseg.shape == x.q_segment_ids.shape
  assert np.all(np.isfinite(dq))


def test_one_segment_equals_no_segment_ids():
  """A single segment (any id value) changes nothing, bit for bit on cpu."""
  case = Case(q_len=90, kv_len=90, is_causal=True)
  x = make_inputs(case, seed=6)
  ids_q, ids_kv = jnp.full((2, 90), 7, jnp.int32), jnp.full((2, 90), 7, jnp.int32)
  for impl in IMPLEMENTATIONS:
    attn = functools.partial(jax_fatrain.dot_product_attention, is_causal=True,
                             implementation=impl)
    # The ids are arguments, not constants XLA could fold away.
    plain, packed = jax.jit(lambda q, k, v, q_seg, kv_seg: (
        attn(q, k, v), attn(q, k, v, q_segment_ids=q_seg, kv_segment_ids=kv_seg)))(
            x.q, x.k, x.v, ids_q, ids_kv)
    assert relative_error(packed, plain) < 1e-6, impl


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_flax_adapter_passes_segment_ids(implementation):
  """Per call, and bound once through attention_kwargs; two batch dims."""
  rng = np.random.default_rng(3)
  shape_q, shape_kv = (2, 3, 30, 4, 16), (2, 3, 30, 4, 16)
  q, k, v = (jnp.asarray(rng.standard_normal(s), jnp.float32)
             for s in (shape_q, shape_kv, shape_kv))
  q_seg, kv_seg = segment_ids("sorted", rng, 6, 30, 30)
  q_seg, kv_seg = (jnp.asarray(a.reshape(2, 3, 30)) for a in (q_seg, kv_seg))
  same = (q_seg[..., :, None] == kv_seg[..., None, :])[:, :, None]
  want = jax.nn.dot_product_attention(q.reshape(6, 30, 4, 16), k.reshape(6, 30, 4, 16),
                                      v.reshape(6, 30, 4, 16), mask=same.reshape(6, 1, 30, 30))
  per_call = jax_fatrain.flax_attention_fn(implementation)(
      q, k, v, q_segment_ids=q_seg, kv_segment_ids=kv_seg)
  bound = jax_fatrain.flax_attention_fn(implementation, q_segment_ids=q_seg,
                                        kv_segment_ids=kv_seg)(q, k, v)
  for got in (per_call, bound):
    assert got.shape == q.shape
    assert relative_error(got.reshape(want.shape), want) < 1e-4


def _visited_tile_pairs(visible: np.ndarray, tq: int, tk: int) -> int:
  """(query tile, key tile) pairs with at least one visible element, summed
  over batch and heads; visible is bool [B, N, T, S]."""
  b, n, t, s = visible.shape
  pad = np.zeros((b, n, -(-t // tq) * tq, -(-s // tk) * tk), bool)
  pad[:, :, :t, :s] = visible
  tiles = pad.reshape(b, n, pad.shape[2] // tq, tq, pad.shape[3] // tk, tk)
  return int(tiles.any(axis=(3, 5)).sum())


@pytest.mark.parametrize("layout", ["aligned", "unaligned", "unsorted"])
def test_cpu_skips_the_tiles_segment_ids_rule_out(layout):
  """The tile-visit counters of the CPU kernels: a causal pack of documents
  visits exactly the tiles that hold a visible element (about 1/k of dense
  causal for k documents) in the forward and both backward passes; unsorted
  ids, whose tiles all share ids, skip nothing the causal mask keeps."""
  from jax_fatrain._backends import cpu as _cpu
  tq, tk = _cpu.tile_sizes()
  t, n, kh = 512, 4, 2
  rng = np.random.default_rng(0)
  if layout == "aligned":        # 4 documents of 128 tokens: 2 tiles each
    ids = np.repeat(np.arange(4, dtype=np.int32), 128)[None]
  elif layout == "unaligned":    # documents crossing tile boundaries
    ids = np.repeat(np.arange(5, dtype=np.int32), [100, 37, 150, 125, 100])[None]
  else:
    ids = rng.integers(0, 3, (1, t)).astype(np.int32)
  case = Case(batch=1, q_len=t, kv_len=t, q_heads=n, kv_heads=kh, is_causal=True)
  x = make_inputs(case, seed=1)
  seg = jnp.asarray(ids)

  def loss(q, k, v):
    out = jax_fatrain.dot_product_attention(q, k, v, is_causal=True, q_segment_ids=seg,
                                            kv_segment_ids=seg, implementation="cpu")
    return jnp.sum(out * x.cotangent), out
  grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))
  jax.block_until_ready(grad(x.q, x.k, x.v))   # compile first: nothing counted twice
  _cpu.tile_visits(reset=True)
  (dq, dk, dv), out = jax.block_until_ready(grad(x.q, x.k, x.v))
  visits = _cpu.tile_visits(reset=True)

  causal = np.tril(np.ones((t, t), bool))
  same = ids[0][:, None] == ids[0][None, :]
  packed = _visited_tile_pairs(np.broadcast_to(causal & same, (1, n, t, t)), tq, tk)
  dense = _visited_tile_pairs(np.broadcast_to(causal, (1, n, t, t)), tq, tk)
  want_visits = dense if layout == "unsorted" else packed
  assert visits == {"forward": want_visits, "backward_dq": want_visits,
                    "backward_dkdv": want_visits, "bias_grad": 0}, (visits, packed, dense)
  if layout == "aligned":
    assert (packed, dense) == (n * 4 * 3, n * 36)   # 3 of a document's 2x2 tiles
  want = jax.nn.dot_product_attention(x.q, x.k, x.v, **jax_nn_kwargs(
      dict(is_causal=True, q_segment_ids=seg, kv_segment_ids=seg)))
  assert relative_error(out, want) < 1e-4
