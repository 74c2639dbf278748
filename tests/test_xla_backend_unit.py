"""Unit tests of the pure-JAX ("xla") backend, ``jax_fatrain/_backends/xla.py``.

Reference: ``jax.nn.dot_product_attention(implementation='xla')`` on float32
(upcast) inputs, gradients via ``jax.vjp`` with a random cotangent. The block
length is lowered so that every case runs several key blocks with a padded tail.
"""

from __future__ import annotations

import importlib.util
import os
import sys

import numpy as np
import pytest

import jax
import jax.numpy as jnp

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
  sys.path.insert(0, _ROOT)

try:
  from jax_fatrain._backends import xla as _xla  # noqa: E402
  from jax_fatrain._config import AttentionConfig  # noqa: E402
except Exception:  # package __init__ may be missing or mid-edit
  import types

  pkg = types.ModuleType("jax_fatrain")
  pkg.__path__ = [os.path.join(_ROOT, "jax_fatrain")]
  sys.modules["jax_fatrain"] = pkg

  def _load(name):
    spec = importlib.util.spec_from_file_location(
        f"jax_fatrain.{name}", os.path.join(_ROOT, "jax_fatrain", f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules[f"jax_fatrain.{name}"] = mod
    spec.loader.exec_module(mod)
    return mod

  AttentionConfig = _load("_config").AttentionConfig
  _xla = _load("_xla")


@pytest.fixture(autouse=True)
def small_blocks(monkeypatch):
  monkeypatch.setattr(_xla, "BLOCK_K", 16)


def _ours(q, k, v, bias, mask, ql, kvl, d_o, cfg):
  """forward, backward and bias_grad in one jit (one compile per case).

  A fresh closure per call, so that jit's cache (keyed on the function object)
  never reuses a trace made with another (monkeypatched) block size.
  """
  def run(q, k, v, bias, mask, ql, kvl, d_o):
    o, lse = _xla.forward(q, k, v, bias, mask, ql, kvl, cfg)
    dq, dk, dv = _xla.backward(q, k, v, bias, mask, ql, kvl, o, lse, d_o, cfg)
    db = _xla.bias_grad(q, k, v, bias, mask, ql, kvl, o, lse, d_o, cfg)
    return o, lse, dq, dk, dv, db
  return jax.jit(run)(q, k, v, bias, mask, ql, kvl, d_o)


def _rel(x, ref):
  x = np.asarray(x, np.float64)
  ref = np.asarray(ref, np.float64)
  return np.linalg.norm(x - ref) / max(np.linalg.norm(ref), 1e-30)


def _to_btnh(x, layout):
  return x if layout == "BTNH" else jnp.swapaxes(x, 1, 2)


def _from_btnh(x, layout):
  return x if layout == "BTNH" else jnp.swapaxes(x, 1, 2)


def _visible(B, N, T, S, cfg, mask, ql, kvl):
  """Dense numpy visibility [B, N, T, S] (independent of the implementation)."""
  i = np.arange(T)[:, None]
  j = np.arange(S)[None, :]
  vis = np.ones((B, N, T, S), bool)
  if mask is not None:
    vis &= np.broadcast_to(np.asarray(mask), vis.shape)
  if cfg.is_causal:
    vis &= j <= i
  if cfg.window_left >= 0:
    vis &= j >= i - cfg.window_left
  if cfg.window_right >= 0:
    vis &= j <= i + cfg.window_right
  if ql is not None:
    vis &= (i < np.asarray(ql)[:, None, None, None])
  if kvl is not None:
    vis &= (j < np.asarray(kvl)[:, None, None, None])
  return vis


def _reference(q, k, v, bias, mask, ql, kvl, d_o, cfg, row_ok):
  """float32 jax.nn reference: o, lse [B,N,T], (dq, dk, dv, dbias)."""
  L = cfg.layout
  f32 = lambda x: None if x is None else jnp.asarray(x, jnp.float32)
  q, k, v, bias, d_o = map(f32, (q, k, v, bias, d_o))
  T = q.shape[cfg.seq_axis]
  S = k.shape[cfg.seq_axis]
  window = None
  if cfg.window_left >= 0 or cfg.window_right >= 0:
    big = T + S + 1
    window = (cfg.window_left if cfg.window_left >= 0 else big,
              cfg.window_right if cfg.window_right >= 0 else big)
  has_bias = bias is not None
  # Zero the cotangent on rows without a visible key: jax.nn gives them the
  # mean of V (and thus gradients); ours gives 0 by design.
  row_mask = np.asarray(row_ok)  # [B, N, T]
  rm = row_mask.transpose(0, 2, 1) if L == "BTNH" else row_mask
  rm = jnp.asarray(rm, jnp.float32)[..., None]

  def run(q, k, v, bias, mask, ql, kvl, d_o, rm):
    kw = dict(scale=cfg.scale, is_causal=cfg.is_causal, query_seq_lengths=ql,
              key_value_seq_lengths=kvl, local_window_size=window,
              implementation="xla")

    def f(q, k, v, bias):
      o = jax.nn.dot_product_attention(
          _to_btnh(q, L), _to_btnh(k, L), _to_btnh(v, L),
          bias if has_bias else None, mask, **kw)
      return _from_btnh(o, L)

    o, vjp = jax.vjp(f, q, k, v, bias if has_bias else jnp.zeros(()))
    grads = vjp(d_o * rm)
    _, lse = jax.nn.dot_product_attention(
        _to_btnh(q, L), _to_btnh(k, L), _to_btnh(v, L),
        bias if has_bias else None, mask, return_residual=True, **kw)
    lse = jnp.transpose(lse, (0, 2, 1)).astype(jnp.float32)  # [B, N, T]
    return o, lse, grads

  o, lse, grads = jax.jit(run)(q, k, v, bias, mask, ql, kvl, d_o, rm)
  if not has_bias:
    grads = tuple(grads[:3]) + (None,)
  return o, lse, tuple(grads)


def _make(seed, *, layout, B, T, S, N, K, H, dtype, bias_shape=None,
          mask_shape=None, lengths=False):
  rng = np.random.default_rng(seed)
  if layout == "BTNH":
    qs, ks = (B, T, N, H), (B, S, K, H)
  else:
    qs, ks = (B, N, T, H), (B, K, S, H)
  q = jnp.asarray(rng.standard_normal(qs), dtype)
  k = jnp.asarray(rng.standard_normal(ks), dtype)
  v = jnp.asarray(rng.standard_normal(ks), dtype)
  d_o = jnp.asarray(rng.standard_normal(qs), dtype)
  bias = mask = ql = kvl = None
  if bias_shape is not None:
    bias = jnp.asarray(rng.standard_normal(bias_shape), jnp.float32)
  if mask_shape is not None:
    mask = jnp.asarray(rng.random(mask_shape) < 0.8)
  if lengths:
    ql = jnp.asarray(rng.integers(1, T + 1, size=B), jnp.int32)
    kvl = jnp.asarray(rng.integers(1, S + 1, size=B), jnp.int32)
  return q, k, v, bias, mask, ql, kvl, d_o


CASES = [
    # name, layout, B, T, S, N, K, H, dtype, causal, window(l, r), bias, mask, lengths
    ("f16_plain_gqa1", "BTNH", 2, 37, 50, 2, 2, 64, "f16", False, None, None, None,
     False),
    ("bnth_gqa2_causal_bias1NTS", "BNTH", 2, 50, 37, 4, 2, 64, "f32", True, None,
     "1NTS", None, False),
    ("d256_gqa8_window_biasB11S", "BTNH", 2, 20, 45, 8, 1, 256, "f32", False, (5, 3),
     "B11S", None, False),
    ("bnth_gqa8_lengths_maskB1TS", "BNTH", 2, 33, 41, 8, 1, 64, "f32", True, None,
     None, "B1TS", True),
    ("causal_left_window_full_bias_lengths", "BNTH", 2, 29, 60, 4, 4, 64, "f32", True,
     (7, -1), "BNTS", None, True),
    ("right_window_only_biasBNT1", "BTNH", 1, 40, 70, 2, 1, 64, "f32", False, (-1, 4),
     "BNT1", "11TS", False),
    ("bf16_gqa2_bias_mask", "BTNH", 2, 45, 33, 4, 2, 64, "bf16", True, None, "1N1S",
     "B1TS", True),
    ("bf16_d256_bnth", "BNTH", 1, 24, 40, 2, 1, 256, "bf16", False, None, None, None,
     False),
]

_SHAPE = {
    "1NTS": lambda B, N, T, S: (1, N, T, S),
    "B11S": lambda B, N, T, S: (B, 1, 1, S),
    "BNTS": lambda B, N, T, S: (B, N, T, S),
    "BNT1": lambda B, N, T, S: (B, N, T, 1),
    "1N1S": lambda B, N, T, S: (1, N, 1, S),
    "B1TS": lambda B, N, T, S: (B, 1, T, S),
    "11TS": lambda B, N, T, S: (1, 1, T, S),
}


def _run_case(case, seed=0):
  (name, layout, B, T, S, N, K, H, dt, causal, window, bsh, msh, lengths) = case
  dtype = {"f32": jnp.float32, "bf16": jnp.bfloat16, "f16": jnp.float16}[dt]
  wl, wr = window if window is not None else (-1, -1)
  cfg = AttentionConfig(scale=1.0 / np.sqrt(H), is_causal=causal, window_left=wl,
                        window_right=wr, layout=layout)
  q, k, v, bias, mask, ql, kvl, d_o = _make(
      seed, layout=layout, B=B, T=T, S=S, N=N, K=K, H=H, dtype=dtype,
      bias_shape=None if bsh is None else _SHAPE[bsh](B, N, T, S),
      mask_shape=None if msh is None else _SHAPE[msh](B, N, T, S),
      lengths=lengths)
  if bias is not None and dtype != jnp.float32:
    bias = bias.astype(dtype)
  vis = _visible(B, N, T, S, cfg, mask, ql, kvl)
  row_ok = vis.any(-1)  # [B, N, T]
  return cfg, (q, k, v, bias, mask, ql, kvl, d_o), row_ok, dtype


def _rows(x, row_ok, layout):
  """Select valid rows of a q-shaped array -> [n_valid, H]."""
  x = np.asarray(jnp.asarray(x, jnp.float32))
  if layout == "BTNH":
    x = x.transpose(0, 2, 1, 3)
  return x[row_ok]


_TOL = {"f32": 1e-5, "f16": 5e-3, "bf16": 1e-2}


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_against_jax_nn(case):
  cfg, (q, k, v, bias, mask, ql, kvl, d_o), row_ok, dtype = _run_case(case)
  tol = _TOL[case[8]]
  o, lse, dq, dk, dv, db = _ours(q, k, v, bias, mask, ql, kvl, d_o, cfg)
  assert o.shape == q.shape and o.dtype == q.dtype
  assert lse.shape == row_ok.shape and lse.dtype == jnp.float32
  assert dq.shape == q.shape and dq.dtype == q.dtype
  assert dk.shape == k.shape and dk.dtype == k.dtype
  assert dv.shape == v.shape and dv.dtype == v.dtype
  for x in (o, lse, dq, dk, dv) + (() if db is None else (db,)):
    assert not np.isnan(np.asarray(x, np.float32)).any()

  ro, rlse, (rdq, rdk, rdv, rdb) = _reference(
      q, k, v, bias, mask, ql, kvl, d_o, cfg, row_ok)
  assert _rel(_rows(o, row_ok, cfg.layout), _rows(ro, row_ok, cfg.layout)) < tol
  lse_np = np.asarray(lse)
  assert _rel(lse_np[row_ok], np.asarray(rlse)[row_ok]) < tol
  # Rows without a visible key: o = 0, lse = -inf, dq = 0.
  dead = ~row_ok
  if dead.any():
    assert np.all(np.isneginf(lse_np[dead]))
    assert np.all(_rows(o, dead, cfg.layout) == 0)
    assert np.all(_rows(dq, dead, cfg.layout) == 0)
  assert np.all(np.isfinite(lse_np[row_ok]))
  assert _rel(dq, rdq) < tol
  assert _rel(dk, rdk) < tol
  assert _rel(dv, rdv) < tol

  if bias is None:
    assert db is None
  else:
    assert db.shape == bias.shape and db.dtype == jnp.float32
    if bias.shape[-1] == 1:
      # A per-row constant bias has (mathematically) zero gradient.
      np.testing.assert_allclose(db, 0, atol=1e-4 if tol < 1e-4 else 1e-2)
      np.testing.assert_allclose(rdb, 0, atol=1e-4)
    else:
      assert _rel(db, rdb) < tol


def test_default_block_single_block_matches_multi_block(monkeypatch):
  case = CASES[4]
  cfg, args, row_ok, _ = _run_case(case, seed=3)
  q, k, v, bias, mask, ql, kvl, d_o = args
  multi = _ours(*args, cfg)          # BLOCK_K = 16: 4 blocks, padded tail
  monkeypatch.setattr(_xla, "BLOCK_K", 512)
  single = _ours(*args, cfg)         # one block
  l1, l2 = np.asarray(multi[1]), np.asarray(single[1])
  np.testing.assert_array_equal(np.isneginf(l1), np.isneginf(l2))
  np.testing.assert_allclose(np.where(row_ok, l1, 0), np.where(row_ok, l2, 0),
                             rtol=1e-5, atol=1e-5)
  for i in (0, 2, 3, 4, 5):
    np.testing.assert_allclose(multi[i], single[i], rtol=1e-4, atol=1e-5)


def test_fully_masked_rows():
  """Rows masked by mask, by q_lengths and by an all -inf bias row."""
  B, T, S, N, K, H = 2, 19, 35, 4, 2, 64
  cfg = AttentionConfig(scale=0.125, layout="BTNH")
  q, k, v, bias, mask, _, _, d_o = _make(
      7, layout="BTNH", B=B, T=T, S=S, N=N, K=K, H=H, dtype=jnp.float32,
      bias_shape=(B, N, T, S), mask_shape=(B, 1, T, S))
  mask = np.array(mask)
  mask[:, 0, :, 0] = True           # every other row keeps a key
  mask[0, 0, 3, :] = False          # row 3 of batch 0, every head: dead
  ql = jnp.asarray([T, T - 4], jnp.int32)  # last 4 rows of batch 1 dead
  kvl = jnp.asarray([S, S - 5], jnp.int32)
  # Dead row by bias: -inf over the whole row (b=1, n=2, i=5).
  bias_inf = np.array(bias)
  bias_inf[1, 2, 5, :] = -np.inf

  o, lse, dq, dk, dv, db = _ours(q, k, v, jnp.asarray(bias_inf),
                                 jnp.asarray(mask), ql, kvl, d_o, cfg)
  for x in (o, lse, dq, dk, dv, db):
    assert not np.isnan(np.asarray(x)).any()
  for x in (o, dq, dk, dv, db):
    assert np.isfinite(np.asarray(x)).all()
  lse = np.asarray(lse)
  o_ = np.asarray(o).transpose(0, 2, 1, 3)
  dq_ = np.asarray(dq).transpose(0, 2, 1, 3)
  dead = np.zeros((B, N, T), bool)
  dead[0, :, 3] = True
  dead[1, :, T - 4:] = True
  dead[1, 2, 5] = True
  assert np.all(np.isneginf(lse[dead]))
  assert np.all(np.isfinite(lse[~dead]))
  assert np.all(o_[dead] == 0)
  assert np.all(dq_[dead] == 0)
  assert np.all(np.asarray(db)[dead] == 0)

  # Against jax.nn on the live rows, expressing the -inf bias row as a mask
  # (jax.nn itself would produce NaN for an all -inf row).
  bias0 = bias_inf.copy()
  bias0[1, 2, 5, :] = 0.0
  mask_full = np.broadcast_to(mask, (B, N, T, S)).copy()
  mask_full[1, 2, 5, :] = False
  vis = _visible(B, N, T, S, cfg, mask_full, ql, kvl)
  row_ok = vis.any(-1)
  np.testing.assert_array_equal(row_ok, ~dead)
  ro, rlse, (rdq, rdk, rdv, rdb) = _reference(
      q, k, v, jnp.asarray(bias0), jnp.asarray(mask_full), ql, kvl, d_o, cfg,
      row_ok)
  assert _rel(_rows(o, row_ok, "BTNH"), _rows(ro, row_ok, "BTNH")) < 1e-5
  assert _rel(lse[row_ok], np.asarray(rlse)[row_ok]) < 1e-5
  assert _rel(dq, rdq) < 1e-5
  assert _rel(dk, rdk) < 1e-5
  assert _rel(dv, rdv) < 1e-5
  assert _rel(db, rdb) < 1e-5


def test_all_keys_masked_everywhere():
  """No visible key at all (kv_lengths == 0): zeros, -inf, no NaN."""
  cfg = AttentionConfig(scale=0.125, layout="BNTH", is_causal=True)
  q, k, v, _, _, _, _, d_o = _make(
      1, layout="BNTH", B=2, T=9, S=40, N=2, K=1, H=64, dtype=jnp.bfloat16)
  kvl = jnp.asarray([0, 0], jnp.int32)
  bias = jnp.ones((1, 1, 1, 40), jnp.float32)
  o, lse, dq, dk, dv, db = _ours(q, k, v, bias, None, None, kvl, d_o, cfg)
  assert np.all(np.isneginf(np.asarray(lse)))
  for x in (o, dq, dk, dv, db):
    assert np.all(np.asarray(x, np.float32) == 0)


def test_vmap_matches_loop():
  cfg = AttentionConfig(scale=0.2, layout="BTNH", is_causal=True)
  xs = [_make(s, layout="BTNH", B=1, T=21, S=30, N=4, K=2, H=64,
              dtype=jnp.float32, bias_shape=(1, 4, 1, 30)) for s in range(3)]
  stack = lambda i: jnp.stack([x[i] for x in xs])
  q, k, v, bias, d_o = stack(0), stack(1), stack(2), stack(3), stack(7)

  def both(q, k, v, bias, d_o):
    o, lse = _xla.forward(q, k, v, bias, None, None, None, cfg)
    g = _xla.backward(q, k, v, bias, None, None, None, o, lse, d_o, cfg)
    db = _xla.bias_grad(q, k, v, bias, None, None, None, o, lse, d_o, cfg)
    return (o, lse) + tuple(g) + (db,)

  batched = jax.jit(jax.vmap(both))(q, k, v, bias, d_o)
  single = jax.jit(both)
  for i in range(3):
    for a, b in zip(batched, single(q[i], k[i], v[i], bias[i], d_o[i])):
      np.testing.assert_allclose(a[i], b, rtol=1e-5, atol=1e-6)
