"""Pure-JAX ("xla") implementation of FlashAttention-2 style training attention.

Three entry points, each taking the canonical operands described in
``_config.py`` and a static :class:`AttentionConfig`:

* :func:`forward`   -> ``(o, lse)``
* :func:`backward`  -> ``(dq, dk, dv)``
* :func:`bias_grad` -> ``dbias`` (float32, ``bias.shape``)

None of them is differentiable on purpose: the caller's ``custom_vjp`` calls them
explicitly. Everything is blockwise over the key/value sequence (``lax.scan`` over
KV blocks with an online softmax in the forward), so no ``[T, S]`` score matrix is
ever materialised per head when ``S`` exceeds the block size; the working set per
head is ``O(T * block + (T + S) * H)``.

Internally every tensor is brought to a grouped head-major form:

* q, o, d_o, dq: ``[B, K, G, T, H]`` (query head ``n = k * G + g``; GQA)
* k, v, dk, dv:  ``[B, K, S, H]``
* bias / mask:   ``[Bb, Kb, Gb, Tb, Sb]`` where each dim is 1 or full
* lse, D:        ``[B, K, G, T]``

K/V are never repeated per query head.

Numerics (docs/design.md): scores ``s = scale * q.k^T`` computed in float32
(``preferred_element_type``), plus ``bias`` in float32, invisible positions set to
``-inf``. Rows without any visible key give ``o = 0``, ``lse = -inf`` and zero
gradients; every ``-inf - -inf`` case is guarded so no NaN appears.
"""

from __future__ import annotations


import jax
import jax.numpy as jnp
from jax import lax

from jax_fatrain._config import AttentionConfig
from jax_fatrain._registry import Implementation


# Key/value block length. Problems with S <= BLOCK_K run as a single block (no
# padding). Tests may lower it to exercise the multi-block paths; it is read at
# trace time.
BLOCK_K = 512
# For S > BLOCK_K the block length is rounded up to a multiple of this.
_BLOCK_ALIGN = 128

_NEG_INF = float("-inf")


# ----------------------------------------------------------------------------
# Layout helpers
# ----------------------------------------------------------------------------


def _dims(q, k, config: AttentionConfig):
  if q.ndim != 4 or k.ndim != 4:
    raise ValueError(
        f"query and key must be rank 4, got {q.shape} and {k.shape}")
  if config.layout == "BTNH":
    B, T, N, H = q.shape
    _, S, K, _ = k.shape
  else:
    B, N, T, H = q.shape
    _, K, S, _ = k.shape
  if N % K != 0:
    raise ValueError(
        f"number of query heads ({N}) must be a multiple of kv heads ({K})")
  return B, T, N, K, N // K, S, H


def _q_to_grouped(x, config, B, T, K, G, H):
  """q-shaped tensor -> [B, K, G, T, H]."""
  if config.layout == "BTNH":
    return jnp.transpose(x.reshape(B, T, K, G, H), (0, 2, 3, 1, 4))
  return x.reshape(B, K, G, T, H)


def _q_from_grouped(x, config, B, T, N, H):
  """[B, K, G, T, H] -> q-shaped tensor."""
  if config.layout == "BTNH":
    return jnp.transpose(x, (0, 3, 1, 2, 4)).reshape(B, T, N, H)
  return x.reshape(B, N, T, H)


def _kv_to_blocks(x, config, S_eff, nblk, bk):
  """k/v-shaped tensor -> [nblk, B, K, bk, H] covering keys [0, S_eff)."""
  pad = nblk * bk - S_eff
  if config.layout == "BTNH":
    B, _, K, H = x.shape
    x = x[:, :S_eff]
    if pad:
      x = jnp.pad(x, ((0, 0), (0, pad), (0, 0), (0, 0)))
    return jnp.transpose(x.reshape(B, nblk, bk, K, H), (1, 0, 3, 2, 4))
  B, K, _, H = x.shape
  x = x[:, :, :S_eff]
  if pad:
    x = jnp.pad(x, ((0, 0), (0, 0), (0, pad), (0, 0)))
  return jnp.moveaxis(x.reshape(B, K, nblk, bk, H), 2, 0)


def _kv_from_blocks(x, config, S):
  """[nblk, B, K, bk, H] (float32) -> k/v-shaped tensor with S keys."""
  nblk, B, K, bk, H = x.shape
  if config.layout == "BTNH":
    x = jnp.transpose(x, (1, 0, 3, 2, 4)).reshape(B, nblk * bk, K, H)
    n = x.shape[1]
    if n >= S:
      return x[:, :S]
    return jnp.pad(x, ((0, 0), (0, S - n), (0, 0), (0, 0)))
  x = jnp.moveaxis(x, 0, 2).reshape(B, K, nblk * bk, H)
  n = x.shape[2]
  if n >= S:
    return x[:, :, :S]
  return jnp.pad(x, ((0, 0), (0, 0), (0, S - n), (0, 0)))


def _check_bm(x, name, B, N, T, S):
  if x.ndim != 4:
    raise ValueError(f"{name} must be rank 4 [B, N, T, S], got shape {x.shape}")
  for d, full, dn in zip(x.shape, (B, N, T, S), "BNTS"):
    if d != 1 and d != full:
      raise ValueError(
          f"{name} dim {dn} must be 1 or {full}; got shape {x.shape} for "
          f"[B, N, T, S] = {(B, N, T, S)}")


def _bm_to_blocks(x, name, B, N, K, G, T, S, S_eff, nblk, bk):
  """bias/mask [Bb, Nb, Tb, Sb] -> grouped form, split along S if Sb == S.

  Returns (blocks, whole): exactly one is not None. ``blocks`` is
  [nblk, Bb, Kb, Gb, Tb, bk] (padded with 0 / False); ``whole`` is
  [Bb, Kb, Gb, Tb, 1] (broadcast over keys).
  """
  if x is None:
    return None, None
  _check_bm(x, name, B, N, T, S)
  Bb, Nb, Tb, Sb = x.shape
  if Nb == N:
    x = x.reshape(Bb, K, G, Tb, Sb)
  else:
    x = x.reshape(Bb, 1, 1, Tb, Sb)
  if Sb == 1 and S != 1:
    return None, x
  x = x[..., :S_eff]
  pad = nblk * bk - S_eff
  if pad:
    x = jnp.pad(x, ((0, 0),) * 4 + ((0, pad),))
  x = x.reshape(x.shape[:4] + (nblk, bk))
  return jnp.moveaxis(x, 4, 0), None


def _block_plan(T, S, config: AttentionConfig):
  """Static: (S_eff, nblk, bk).

  Keys at positions >= S_eff are invisible to every query (causal or right
  window cut), so they are skipped entirely.
  """
  S_eff = S
  if config.is_causal:
    S_eff = min(S_eff, T)
  if config.window_right >= 0:
    S_eff = min(S_eff, T + config.window_right)
  S_eff = max(S_eff, 1) if S > 0 else 0
  if S_eff <= BLOCK_K:
    return S_eff, 1, max(S_eff, 1)
  nblk = -(-S_eff // BLOCK_K)
  bk = -(-S_eff // nblk)  # balanced blocks: minimal padding
  align = _BLOCK_ALIGN if BLOCK_K % _BLOCK_ALIGN == 0 else 1
  bk = -(-bk // align) * align  # still <= BLOCK_K
  nblk = -(-S_eff // bk)
  return S_eff, nblk, bk


def _visibility(j0, bk, B, T, S_eff, config, q_lengths, kv_lengths, mask_blk,
                q_seg=None, kv_seg_blk=None):
  """Bool visibility of one key block, broadcastable to [B, K, G, T, bk].

  Segment ids (q_seg [B, T], kv_seg_blk [B, bk]) are compared for this block
  only: the [B, T, bk] comparison is the size of the block's scores.
  """
  i = jnp.arange(T, dtype=jnp.int32)[:, None]
  j = j0 + jnp.arange(bk, dtype=jnp.int32)[None, :]
  vis = j < S_eff
  if config.is_causal:
    vis = vis & (j <= i)
  if config.window_left >= 0:
    vis = vis & (j >= i - config.window_left)
  if config.window_right >= 0:
    vis = vis & (j <= i + config.window_right)
  vis = vis[None, None, None]  # [1, 1, 1, T, bk]
  if kv_lengths is not None:
    kvl = kv_lengths.astype(jnp.int32).reshape(B, 1, 1, 1, 1)
    vis = vis & (j[None, None, None] < kvl)
  if q_lengths is not None:
    ql = q_lengths.astype(jnp.int32).reshape(B, 1, 1, 1, 1)
    vis = vis & (i[None, None, None] < ql)
  if mask_blk is not None:
    vis = vis & mask_blk
  if q_seg is not None:
    same = q_seg[:, :, None] == kv_seg_blk[:, None, :]   # [B, T, bk]
    vis = vis & same[:, None, None]
  return vis


def _scores(qg, kb, bias_blk, vis, scale):
  """Masked float32 scores [B, K, G, T, bk]."""
  s = jnp.einsum("bkgth,bksh->bkgts", qg, kb,
                 preferred_element_type=jnp.float32)
  s = s * jnp.float32(scale)
  if bias_blk is not None:
    s = s + bias_blk.astype(jnp.float32)
  return jnp.where(vis, s, _NEG_INF)


class _Prepared:
  """Operands in grouped/blocked form, shared by forward and backward."""

  def __init__(self, q, k, v, bias, mask, q_lengths, kv_lengths, config,
               q_segment_ids=None, kv_segment_ids=None):
    B, T, N, K, G, S, H = _dims(q, k, config)
    self.B, self.T, self.N, self.K, self.G, self.S, self.H = B, T, N, K, G, S, H
    self.config = config
    S_eff, nblk, bk = _block_plan(T, S, config)
    self.S_eff, self.nblk, self.bk = S_eff, nblk, bk
    self.qg = _q_to_grouped(q, config, B, T, K, G, H)
    self.kb = _kv_to_blocks(k, config, S_eff, nblk, bk)
    self.vb = _kv_to_blocks(v, config, S_eff, nblk, bk)
    self.bias_blocks, self.bias_whole = _bm_to_blocks(
        bias, "bias", B, N, K, G, T, S, S_eff, nblk, bk)
    if mask is not None and mask.dtype != jnp.bool_:
      mask = mask.astype(jnp.bool_)
    self.mask_blocks, self.mask_whole = _bm_to_blocks(
        mask, "mask", B, N, K, G, T, S, S_eff, nblk, bk)
    self.q_lengths = q_lengths
    self.kv_lengths = kv_lengths
    self.j0s = jnp.arange(nblk, dtype=jnp.int32) * bk
    self.q_seg = q_segment_ids
    self.seg_blocks = None
    if q_segment_ids is not None:
      # [B, S] -> [nblk, B, bk] over keys [0, S_eff); padded keys are beyond
      # S_eff, invisible whatever their id.
      seg = kv_segment_ids[:, :S_eff]
      seg = jnp.pad(seg, ((0, 0), (0, nblk * bk - S_eff)))
      self.seg_blocks = jnp.moveaxis(seg.reshape(B, nblk, bk), 1, 0)

  def xs(self):
    return (self.j0s, self.kb, self.vb, self.bias_blocks, self.mask_blocks,
            self.seg_blocks)

  def block_scores(self, j0, kb, bias_blk, mask_blk, seg_blk):
    if bias_blk is None:
      bias_blk = self.bias_whole
    if mask_blk is None:
      mask_blk = self.mask_whole
    vis = _visibility(j0, self.bk, self.B, self.T, self.S_eff, self.config,
                      self.q_lengths, self.kv_lengths, mask_blk, self.q_seg, seg_blk)
    return _scores(self.qg, kb, bias_blk, vis, self.config.scale)


# ----------------------------------------------------------------------------
# Forward
# ----------------------------------------------------------------------------


def forward(q, k, v, bias, mask, q_lengths, kv_lengths, config: AttentionConfig,
            q_segment_ids=None, kv_segment_ids=None):
  """Returns ``(o, lse)``: o with q's shape/dtype, lse float32 ``[B, N, T]``."""
  p = _Prepared(q, k, v, bias, mask, q_lengths, kv_lengths, config, q_segment_ids,
                kv_segment_ids)
  B, T, N, K, G, H = p.B, p.T, p.N, p.K, p.G, p.H

  def step(carry, x):
    m, l, acc = carry
    j0, kb, vb, bias_blk, mask_blk, seg_blk = x
    s = p.block_scores(j0, kb, bias_blk, mask_blk, seg_blk)
    m_new = jnp.maximum(m, jnp.max(s, axis=-1))
    # Rows still without any visible key keep m_new == -inf: use 0 as the
    # reference so that exp(-inf - 0) == 0 instead of NaN.
    m_ref = jnp.where(m_new == _NEG_INF, 0.0, m_new)
    pr = jnp.exp(s - m_ref[..., None])
    alpha = jnp.exp(m - m_ref)
    l = alpha * l + jnp.sum(pr, axis=-1)
    pv = jnp.einsum("bkgts,bksh->bkgth", pr.astype(vb.dtype), vb,
                    preferred_element_type=jnp.float32)
    acc = alpha[..., None] * acc + pv
    return (m_new, l, acc), None

  init = (jnp.full((B, K, G, T), _NEG_INF, jnp.float32),
          jnp.zeros((B, K, G, T), jnp.float32),
          jnp.zeros((B, K, G, T, H), jnp.float32))
  if p.S_eff == 0:
    m, l, acc = init
  elif p.nblk == 1:
    (m, l, acc), _ = step(init, jax.tree_util.tree_map(
        lambda a: None if a is None else a[0], p.xs(),
        is_leaf=lambda a: a is None))
  else:
    (m, l, acc), _ = lax.scan(step, init, p.xs())

  # A row saw a key iff l > 0; l is NaN when a score was NaN or +inf, and that
  # NaN must reach o and lse as it does in jax.nn (not read as a dead row).
  alive = l != 0.0
  inv_l = jnp.where(alive, 1.0 / jnp.where(alive, l, 1.0), 0.0)
  o = acc * inv_l[..., None]
  lse = jnp.where(alive, m + jnp.log(jnp.where(alive, l, 1.0)), _NEG_INF)
  o = _q_from_grouped(o.astype(q.dtype), config, B, T, N, H)
  return o, lse.reshape(B, N, T)


# ----------------------------------------------------------------------------
# Backward (shared by backward() and bias_grad())
# ----------------------------------------------------------------------------


def _backward_impl(q, k, v, bias, mask, q_lengths, kv_lengths, o, lse, d_o,
                   config, want_dqkv, want_dbias, q_segment_ids, kv_segment_ids):
  p = _Prepared(q, k, v, bias, mask, q_lengths, kv_lengths, config, q_segment_ids,
                kv_segment_ids)
  B, T, N, K, G, S, H = p.B, p.T, p.N, p.K, p.G, p.S, p.H
  scale = jnp.float32(config.scale)

  og = _q_to_grouped(o, config, B, T, K, G, H)
  dog = _q_to_grouped(d_o, config, B, T, K, G, H)
  # D = rowsum(dO * O) in float32.
  Drow = jnp.sum(dog.astype(jnp.float32) * og.astype(jnp.float32), axis=-1)
  lse_g = lse.astype(jnp.float32).reshape(B, K, G, T)
  # Dead rows (lse == -inf): use +inf so that exp(s - lse) == 0 for every s
  # (finite or -inf) instead of NaN / Inf.
  lse_g = jnp.where(lse_g == _NEG_INF, jnp.inf, lse_g)[..., None]

  bshape = None if bias is None else bias.shape
  red_axes, sum_keys = (), False
  if want_dbias and bshape is not None:
    Bb, Nb, Tb, Sb = bshape
    red_axes = tuple(a for a, (d, full) in enumerate(zip((Bb, Nb, Tb), (B, N, T)))
                     if d == 1 and full != 1)
    sum_keys = Sb == 1 and S != 1

  def dbias_block(ds):
    ds = ds.reshape(B, N, T, p.bk)
    if red_axes:
      ds = jnp.sum(ds, axis=red_axes, keepdims=True)
    if sum_keys:
      ds = jnp.sum(ds, axis=-1, keepdims=True)
    return ds

  def step(carry, x):
    dq_acc, dbias_acc = carry
    j0, kb, vb, bias_blk, mask_blk, seg_blk = x
    s = p.block_scores(j0, kb, bias_blk, mask_blk, seg_blk)
    pr = jnp.exp(s - lse_g)  # 0 where invisible or dead row
    dp = jnp.einsum("bkgth,bksh->bkgts", dog, vb,
                    preferred_element_type=jnp.float32)
    ds = pr * (dp - Drow[..., None])
    ys = {}
    if want_dqkv:
      ys["dv"] = jnp.einsum("bkgts,bkgth->bksh", pr.astype(dog.dtype), dog,
                            preferred_element_type=jnp.float32)
      ys["dk"] = scale * jnp.einsum("bkgts,bkgth->bksh", ds.astype(p.qg.dtype),
                                    p.qg, preferred_element_type=jnp.float32)
      dq_acc = dq_acc + scale * jnp.einsum(
          "bkgts,bksh->bkgth", ds.astype(kb.dtype), kb,
          preferred_element_type=jnp.float32)
    if want_dbias:
      db = dbias_block(ds)
      if sum_keys:
        dbias_acc = dbias_acc + db
      else:
        ys["dbias"] = db
    return (dq_acc, dbias_acc), ys

  dq0 = jnp.zeros((B, K, G, T, H), jnp.float32) if want_dqkv else None
  db0 = None
  if want_dbias and sum_keys:
    db0 = jnp.zeros(tuple(1 if a in red_axes else d
                          for a, d in enumerate((B, N, T))) + (1,), jnp.float32)
  init = (dq0, db0)

  if p.S_eff == 0:
    carry, ys = init, None
  elif p.nblk == 1:
    carry, ys = step(init, jax.tree_util.tree_map(
        lambda a: None if a is None else a[0], p.xs(),
        is_leaf=lambda a: a is None))
    ys = jax.tree_util.tree_map(lambda a: a[None], ys)
  else:
    carry, ys = lax.scan(step, init, p.xs())
  dq_acc, dbias_acc = carry

  out = {}
  if want_dqkv:
    dq = _q_from_grouped(dq_acc.astype(q.dtype), config, B, T, N, H)
    if ys is None:
      dk, dv = jnp.zeros_like(k), jnp.zeros_like(v)
    else:
      dk = _kv_from_blocks(ys["dk"], config, S).astype(k.dtype)
      dv = _kv_from_blocks(ys["dv"], config, S).astype(v.dtype)
    out["dqkv"] = (dq, dk, dv)
  if want_dbias:
    if bshape is None:
      out["dbias"] = None
    elif sum_keys:
      out["dbias"] = dbias_acc.reshape(bshape)
    elif ys is None:
      out["dbias"] = jnp.zeros(bshape, jnp.float32)
    else:
      db = ys["dbias"]  # [nblk, Bb', Nb', Tb', bk]
      db = jnp.moveaxis(db, 0, 3)
      db = db.reshape(db.shape[:3] + (p.nblk * p.bk,))
      n = db.shape[-1]
      if n >= S:
        db = db[..., :S]
      else:
        db = jnp.pad(db, ((0, 0),) * 3 + ((0, S - n),))
      out["dbias"] = db.reshape(bshape)
  return out


def backward(q, k, v, bias, mask, q_lengths, kv_lengths, o, lse, d_o,
             config: AttentionConfig, q_segment_ids=None, kv_segment_ids=None):
  """Returns ``(dq, dk, dv)`` with q's / k's / v's shapes and dtypes."""
  return _backward_impl(q, k, v, bias, mask, q_lengths, kv_lengths, o, lse, d_o,
                        config, True, False, q_segment_ids, kv_segment_ids)["dqkv"]


def bias_grad(q, k, v, bias, mask, q_lengths, kv_lengths, o, lse, d_o,
              config: AttentionConfig, q_segment_ids=None, kv_segment_ids=None):
  """Returns ``dbias``: float32 with ``bias.shape`` (None if bias is None).

  dS is summed over every dimension along which ``bias`` broadcasts.
  """
  if bias is None:
    return None
  return _backward_impl(q, k, v, bias, mask, q_lengths, kv_lengths, o, lse, d_o,
                        config, False, True, q_segment_ids, kv_segment_ids)["dbias"]


IMPORT_ERROR = None
IMPLEMENTATION = Implementation("xla", forward, backward, bias_grad, max_head_dim=None,
                                platforms=None)
