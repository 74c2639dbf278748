"""What the Metal implementations (``metal``, ``metal_emulated``) do in Python.

Both run the same kernels (``jax_fatrain/metal/*.metal``) through the same
dispatch plan, as FFI calls on the ``cpu`` platform; only the C++ executor
differs (the Apple GPU, or the MSL emulator). Before the kernels see the
operands:

* the head dimension is zero-padded to a compiled variant (64/128/256; zero
  columns change neither the scores nor the kept columns of O and of the
  gradients);
* bias and boolean mask are folded into one additive operand of Q's dtype
  when both are given (the kernels take one mask buffer);
* a bias or mask broadcast over keys is expanded along the key axis (the mask
  ABI has no key stride).

The bias gradient is not a Metal kernel yet: both use the CPU backend's.
"""

from __future__ import annotations

import jax.numpy as jnp

from jax_fatrain._backends import _ffi
from jax_fatrain._backends import cpu as _cpu

MAX_HEAD_DIM = 256
HEAD_DIMS = (64, 128, 256)


def padded_dim(d: int, name: str) -> int:
  for p in HEAD_DIMS:
    if d <= p:
      return p
  raise ValueError(f"{name}: head_dim {d} exceeds {MAX_HEAD_DIM}")


def pad(x, dim):
  if x.shape[-1] == dim:
    return x
  return jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, dim - x.shape[-1])])


def score_operand(q, bias, mask, kv_len):
  """(bias, mask) as the kernels take them: at most one, contiguous over keys."""
  if bias is not None and mask is not None:
    shape = tuple(max(a, b) for a, b in zip(bias.shape, mask.shape))
    bias = jnp.where(jnp.broadcast_to(mask, shape),
                     jnp.broadcast_to(bias.astype(q.dtype), shape),
                     jnp.asarray(-jnp.inf, q.dtype))
    mask = None
  if bias is not None:
    bias = bias.astype(q.dtype)
    if bias.shape[3] != kv_len:
      bias = jnp.broadcast_to(bias, bias.shape[:3] + (kv_len,))
  if mask is not None and mask.shape[3] != kv_len:
    mask = jnp.broadcast_to(mask, mask.shape[:3] + (kv_len,))
  return bias, mask


def forward(target: str, name: str, q, k, v, bias, mask, q_lengths, kv_lengths, config,
            q_segment_ids=None, kv_segment_ids=None):
  """The forward FFI call ``target`` on adapted operands: (o, lse)."""
  d = q.shape[-1]
  dp = padded_dim(d, name)
  bias, mask = score_operand(q, bias, mask, k.shape[config.seq_axis])
  qp, kp, vp = pad(q, dp), pad(k, dp), pad(v, dp)
  o, lse = _ffi.ffi_call(target, (_ffi.result(qp.shape, q.dtype, q), _ffi.lse_result(q, config)),
                         qp, kp, vp, bias, mask, q_lengths, kv_lengths, config, q_segment_ids,
                         kv_segment_ids)
  return o[..., :d], lse


def backward(target: str, name: str, q, k, v, bias, mask, q_lengths, kv_lengths, o, lse, d_o,
             config, q_segment_ids=None, kv_segment_ids=None):
  """The backward FFI call ``target`` on adapted operands: (dq, dk, dv)."""
  d = q.shape[-1]
  dp = padded_dim(d, name)
  bias, mask = score_operand(q, bias, mask, k.shape[config.seq_axis])
  qp, kp, vp, op, dop = (pad(x, dp) for x in (q, k, v, o, d_o))
  results = (_ffi.result(qp.shape, q.dtype, q), _ffi.result(kp.shape, k.dtype, k),
             _ffi.result(vp.shape, v.dtype, v))
  dq, dk, dv = _ffi.ffi_call(target, results, qp, kp, vp, bias, mask, q_lengths, kv_lengths,
                             config, q_segment_ids, kv_segment_ids, op, lse, dop)
  return dq[..., :d], dk[..., :d], dv[..., :d]


def bias_grad(q, k, v, bias, mask, q_lengths, kv_lengths, o, lse, d_o, config,
              q_segment_ids=None, kv_segment_ids=None):
  # Not a Metal kernel yet: the CPU backend's bias gradient (same conventions).
  return _cpu.bias_grad(q, k, v, bias, mask, q_lengths, kv_lengths, o, lse, d_o, config,
                        q_segment_ids, kv_segment_ids)
