"""The differentiable op: one ``jax.custom_vjp`` over any implementation.

An implementation (``_registry.py``) is three plain functions (forward,
backward, bias_grad) with the signatures described in ``_config.py``. This module

* wraps each stage in the sharding rules of ``_sharding/`` and in a batching
  rule that folds ``vmap``-ed axes into the batch dimension (one kernel launch,
  not a loop; FFI calls have no batching rule of their own), and
* ties forward and backward together with ``jax.custom_vjp``: the forward
  saves (q, k, v, bias, mask, lengths, segment ids, o, lse); the backward
  calls the backward kernel, and the bias gradient is a separate call that XLA
  removes when nothing uses it. Lengths and segment ids are integers and get
  no cotangent.

A stage callable takes the operands positionally: forward ``(q, k, v, bias,
mask, q_lengths, kv_lengths, q_segment_ids, kv_segment_ids)``, backward and
bias_grad ``(q, k, v, bias, mask, q_lengths, kv_lengths, o, lse, d_o,
q_segment_ids, kv_segment_ids)``; the segment ids come last so that an
implementation takes them as keyword arguments (see ``_config.py``).
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
from jax.custom_batching import custom_vmap

from jax_fatrain import _sharding
from jax_fatrain._config import AttentionConfig
from jax_fatrain._registry import Implementation


# ---------------------------------------------------------------------------
# vmap: fold the mapped axis into the batch axis.
# ---------------------------------------------------------------------------
#
# Every operand has the batch as its leading axis (q/k/v/o/dO, lse, bias,
# mask, lengths, segment ids), so under vmap the rule moves the mapped axis next to it and
# merges the two: [V, B, ...] -> [V*B, ...]. Operands that are not mapped are
# broadcast along V first, except a bias/mask whose batch dim is 1, which
# still broadcasts over the merged batch through its zero stride. Outputs are
# split back into [V, B, ...].

# Argument positions of the operands that broadcast over [B, N, T, S].
_BIAS, _MASK = 3, 4


def _fold(x, batched: bool, axis_size: int, batch: int, keep_unit_batch: bool):
  """[V, b, ...] (or unmapped [b, ...]) -> [V*batch, ...] (or [1, ...] kept)."""
  if x is None:
    return None
  if not batched:
    if keep_unit_batch and x.shape[0] == 1:
      return x
    x = x[None]
  # A mapped bias/mask with batch dim 1 still needs one entry per merged
  # batch element: the merged index v*B + b is not a strided view of v.
  x = jnp.broadcast_to(x, (axis_size, batch) + x.shape[2:])
  return x.reshape((-1,) + x.shape[2:])


def _unfold(y, axis_size: int):
  return y.reshape((axis_size, -1) + y.shape[1:])


@functools.lru_cache(maxsize=None)
def _batched(fn: Callable, stage: str) -> Callable:
  """Wraps ``fn(*operands)`` (config already bound) with the folding rule."""
  wrapped = custom_vmap(fn)

  @wrapped.def_vmap
  def rule(axis_size, in_batched, *args):
    q, q_batched = args[0], bool(in_batched[0])
    batch = q.shape[1] if q_batched else q.shape[0]
    folded = []
    for i, (x, batched) in enumerate(zip(args, in_batched)):
      is_score = i in (_BIAS, _MASK)
      # The bias gradient must come out per mapped element, so its bias is
      # always given the mapped axis.
      keep = is_score and not (stage == "bias_grad" and i == _BIAS)
      folded.append(_fold(x, bool(batched), axis_size, batch, keep_unit_batch=keep))
    out = wrapped(*folded)
    if stage == "bias_grad":
      dbias = _unfold(out, axis_size)
      if args[_BIAS].shape[int(bool(in_batched[_BIAS]))] == 1:
        dbias = dbias.sum(axis=1, keepdims=True)
      return dbias, True
    outs = tuple(_unfold(y, axis_size) for y in out)
    return outs, tuple(True for _ in outs)

  return wrapped


@functools.lru_cache(maxsize=None)
def stage(impl: Implementation, name: str, config: AttentionConfig) -> Callable:
  """The callable for stage `name` ("forward", "backward", "bias_grad"),
  cached by implementation, stage and config."""
  # Sharding (_sharding/): the stage is wrapped in custom_partitioning so
  # that under a multi-device jit each device runs the kernel on its shard
  # (batch/heads: no collectives; a sharded sequence: ring attention). On one
  # device it lowers to the plain call. custom_partitioning has no vmap rule,
  # so the folding rule above goes *outside* it, for every implementation:
  # vmap folds its axis into the batch first and the folded call is then
  # partitioned like any other.
  fn = _sharding.partitioned(impl, name, config)
  return _batched(fn, name)


# ---------------------------------------------------------------------------
# The custom_vjp.
# ---------------------------------------------------------------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8))
def attention(q, k, v, bias, mask, q_lengths, kv_lengths, config: AttentionConfig,
              impl: Implementation, q_segment_ids=None, kv_segment_ids=None):
  """(o, lse) for canonical operands; differentiable in q, k, v and bias.

  The segment ids come last, after config and implementation, so that calls
  without them keep their positions.
  """
  return stage(impl, "forward", config)(q, k, v, bias, mask, q_lengths, kv_lengths,
                                        q_segment_ids, kv_segment_ids)


def _attention_fwd(q, k, v, bias, mask, q_lengths, kv_lengths, config, impl,
                   q_segment_ids=None, kv_segment_ids=None):
  o, lse = stage(impl, "forward", config)(q, k, v, bias, mask, q_lengths, kv_lengths,
                                          q_segment_ids, kv_segment_ids)
  return (o, lse), (q, k, v, bias, mask, q_lengths, kv_lengths, q_segment_ids,
                    kv_segment_ids, o, lse)


def _attention_bwd(config, impl, residuals, cotangents):
  (q, k, v, bias, mask, q_lengths, kv_lengths, q_segment_ids, kv_segment_ids, o,
   lse) = residuals
  # The cotangent of lse is ignored: like jax.nn, the residual is returned
  # under stop_gradient (see api.dot_product_attention).
  d_o, _ = cotangents
  d_o = d_o.astype(o.dtype)
  operands = (q, k, v, bias, mask, q_lengths, kv_lengths, o, lse, d_o, q_segment_ids,
              kv_segment_ids)
  dq, dk, dv = stage(impl, "backward", config)(*operands)
  dbias = None
  if bias is not None:
    dbias = stage(impl, "bias_grad", config)(*operands).astype(bias.dtype)
  # Integer inputs (mask, lengths, segment ids): no cotangent.
  return dq, dk, dv, dbias, None, None, None, None, None


attention.defvjp(_attention_fwd, _attention_bwd)
