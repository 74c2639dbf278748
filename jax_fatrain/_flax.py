"""The adapter that plugs our attention into Flax's ``attention_fn`` hook."""

from __future__ import annotations

import functools
import math
from typing import Callable

import jax.numpy as jnp


def _flatten_batch(x, batch_shape):
  """``[*batch, a, b, c]`` (batch dims possibly 1) -> ``[prod(batch), a, b, c]``."""
  if x is None:
    return None
  x = jnp.reshape(x, (1,) * max(0, len(batch_shape) + 3 - x.ndim) + x.shape)
  x = jnp.broadcast_to(x, tuple(batch_shape) + x.shape[-3:])
  return jnp.reshape(x, (math.prod(batch_shape),) + x.shape[-3:])


def _flatten_ids(x, batch_shape):
  """Segment ids ``[*batch, length]`` (batch dims possibly 1) -> ``[prod(batch), length]``."""
  if x is None:
    return None
  x = jnp.asarray(x)
  x = jnp.reshape(x, (1,) * max(0, len(batch_shape) + 1 - x.ndim) + x.shape)
  x = jnp.broadcast_to(x, tuple(batch_shape) + x.shape[-1:])
  return jnp.reshape(x, (math.prod(batch_shape),) + x.shape[-1:])


def flax_attention_fn(implementation: str | None = None, *,
                      attention: Callable | None = None, **attention_kwargs):
  """An ``attention_fn`` for ``flax.nnx.MultiHeadAttention`` and
  ``flax.linen.MultiHeadDotProductAttention``.

  Flax calls it with ``[batch..., length, heads, head_dim]`` arrays, a boolean
  ``mask`` broadcastable to ``[batch..., heads, q_length, kv_length]``, an
  optional ``bias`` and dropout / dtype / precision settings. The adapter
  passes ``mask``, ``bias`` and ``is_causal`` on (the scale is
  ``1/sqrt(head_dim)``, the default of both Flax and ``jax.nn``), accepts
  dropout settings that switch dropout off, and raises for what a fused kernel
  cannot do: attention dropout in training and sowing attention weights.

  ``attention`` defaults to :func:`jax_fatrain.dot_product_attention` with the
  given ``implementation``; any function with ``jax.nn.dot_product_attention``'s
  signature works (the tests pass jax.nn itself as the reference).
  ``attention_kwargs`` are forwarded on every call.

  Packed sequences: ``q_segment_ids`` ``[batch..., q_length]`` and
  ``kv_segment_ids`` ``[batch..., kv_length]`` (int32) are taken per call by the
  returned function, or once for every call through ``attention_kwargs``
  (Flax's attention modules pass no extra arguments to ``attention_fn``, so a
  module built with ``flax_attention_fn(q_segment_ids=ids,
  kv_segment_ids=ids)`` uses that packing on every call).
  """
  if attention is None:
    from jax_fatrain._api import dot_product_attention  # pylint: disable=import-outside-toplevel
    attention = functools.partial(dot_product_attention, implementation=implementation)
  elif implementation is not None:
    raise TypeError("pass either implementation= or attention=, not both")

  def attention_fn(query, key, value, bias=None, mask=None, *, broadcast_dropout=True,
                   dropout_rng=None, dropout_rate=0.0, deterministic=True, dtype=None,
                   precision=None, module=None, is_causal=False, q_segment_ids=None,
                   kv_segment_ids=None, **unused):
    del broadcast_dropout, dropout_rng, precision  # dropout is off; kernels fix precision
    unused.pop("promote_dtype", None)
    unused.pop("force_fp32_for_softmax", None)  # we always do softmax in float32
    unexpected = sorted(k for k, v in unused.items() if v is not None)
    if unexpected:
      raise TypeError(f"attention_fn got unsupported arguments: {unexpected}")
    if dropout_rate > 0.0 and not deterministic:
      raise NotImplementedError(
          f"attention dropout (dropout_rate={dropout_rate}) is not supported by the "
          "fused attention; use dropout_rate=0.0 or deterministic=True")
    if module is not None:
      raise NotImplementedError(
          "sow_weights=True needs the attention probabilities, which fused attention "
          "never materialises")
    if dtype is None:
      dtype = jnp.result_type(query, key, value)
    query, key, value = (x.astype(dtype) for x in (query, key, value))
    if mask is not None:
      mask = mask.astype(jnp.bool_)

    batch_shape = query.shape[:-3]
    out_shape = query.shape
    kwargs = dict(attention_kwargs)
    if q_segment_ids is not None or kv_segment_ids is not None:
      kwargs.update(q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids)
    for name in ("q_segment_ids", "kv_segment_ids"):
      if kwargs.get(name) is not None:
        kwargs[name] = _flatten_ids(kwargs[name], batch_shape)
    if len(batch_shape) != 1:  # the attention API takes exactly one batch dim
      query, key, value = (_flatten_batch(x, batch_shape) for x in (query, key, value))
      bias = _flatten_batch(bias, batch_shape)
      mask = _flatten_batch(mask, batch_shape)
    out = attention(query, key, value, bias=bias, mask=mask, is_causal=is_causal, **kwargs)
    return jnp.reshape(out, out_shape).astype(dtype)

  return attention_fn
