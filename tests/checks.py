"""The one comparison every backend's tests use: ours against jax.nn (docs/testing.md).

``results(case, x, attention)`` runs an attention function on a case's inputs
and returns its output, logsumexp and gradients of a loss with a random
cotangent; ``reference_results`` does the same for ``jax.nn`` in float32;
``assert_matches_reference`` holds the two to the tolerances of
``attention_cases.TOLERANCE`` and to our convention for rows that see no key.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

import jax_fatrain
from attention_cases import (TOLERANCE, Case, Inputs, relative_error, reference,
                             visibility)


def _up(a):
  return None if a is None else a.astype(jnp.float32)


def _argnums(x: Inputs):
  return (0, 1, 2, 3) if x.bias is not None else (0, 1, 2)


def gradients(attention, case: Case, x: Inputs):
  """Gradients of sum(attention(...) * cotangent) in q, k, v (and bias)."""
  def loss(q, k, v, bias):
    out = attention(q, k, v, **{**x.kwargs(case), "bias": bias})
    return jnp.sum(out.astype(jnp.float32) * x.cotangent.astype(jnp.float32))
  return jax.jit(jax.grad(loss, argnums=_argnums(x)))(x.q, x.k, x.v, x.bias)


def results(case: Case, x: Inputs, implementation: str, **options):
  """(out, lse [B, T, N], grads) of jax_fatrain with ``implementation`` (and
  ``options``, further keywords of the call such as ``deterministic``)."""
  ours = functools.partial(jax_fatrain.dot_product_attention, implementation=implementation,
                           **options)
  out, lse = jax.jit(lambda q, k, v: ours(q, k, v, return_residual=True, **x.kwargs(case)))(
      x.q, x.k, x.v)
  return out, lse, gradients(ours, case, x)


def reference_results(case: Case, x: Inputs):
  """(out, lse, grads) of jax.nn.dot_product_attention on float32 inputs.

  One jitted function with the operands as arguments: run eagerly, jax.nn
  compiles each of its operations on its own (seconds per case), and
  closed-over arrays would be constants that XLA tries to fold.
  """
  def loss(q, k, v, bias, mask, q_lengths, kv_lengths, cotangent):
    y = dataclasses.replace(x, q=q, k=k, v=v, bias=bias, mask=mask, q_lengths=q_lengths,
                            kv_lengths=kv_lengths)
    out, lse = reference(case, y)
    return jnp.sum(out * cotangent.astype(jnp.float32)), (out, lse)
  step = jax.jit(jax.grad(loss, argnums=_argnums(x), has_aux=True))
  grads, (out, lse) = step(x.q, x.k, x.v, x.bias, x.mask, x.q_lengths, x.kv_lengths,
                           x.cotangent)
  return out, lse, grads


def gradient_noise(case: Case, x: Inputs) -> dict[str, float]:
  """Norm of the rounding noise each gradient carries where its terms cancel.

  A row of dS = P (dP - D) sums to zero (D_i = dO_i . O_i = sum_j P_ij dP_ij),
  so where a row sees one key, or where a bias shared by all keys sums dS over
  them, the exact gradient is 0 and both ours and the reference compute
  rounding: chiefly that of D_i, whose O is stored in the input dtype. Its
  size per row is t_i = |dO_i| . |O_i|, which reaches dq as
  scale t_i |P K|_i, dk as scale sum_i P_ij t_i |q_i| and dbias as P_ij t_i
  summed like the bias; dv has no such term. Computed in float64 NumPy.
  """
  f64 = lambda a: np.asarray(a, np.float64)
  q, k, v, ct = f64(x.q), f64(x.k), f64(x.v), f64(x.cotangent)
  b, t, n, h = q.shape
  group = n // k.shape[2]
  scale = case.scale if case.scale is not None else 1 / np.sqrt(h)
  kr, vr = np.repeat(k, group, axis=2), np.repeat(v, group, axis=2)
  s = scale * np.einsum("btnh,bsnh->bnts", q, kr)
  if x.bias is not None:
    s = s + f64(x.bias)
  segments = (None if x.q_segment_ids is None else
              (np.asarray(x.q_segment_ids), np.asarray(x.kv_segment_ids)))
  vis = visibility(case, None if x.mask is None else np.asarray(x.mask), x.q_lengths,
                   x.kv_lengths, segments)
  s = np.where(vis, s, -np.inf)
  m = s.max(axis=-1, keepdims=True)
  p = np.exp(s - np.where(np.isfinite(m), m, 0.0))
  p = p / np.maximum(p.sum(axis=-1, keepdims=True), 1e-300)     # 0 on dead rows
  o = np.einsum("bnts,bsnh->btnh", p, vr)
  rows = np.sum(np.abs(ct) * np.abs(o), axis=-1).transpose(0, 2, 1)   # t_i [B, N, T]
  weighted = p * rows[..., None]                                     # P_ij t_i
  dq = scale * rows[..., None] * np.abs(np.einsum("bnts,bsnh->bnth", p, kr))
  dk = scale * np.einsum("bnts,btnh->bsnh", weighted, np.abs(q))
  dk = dk.reshape(dk.shape[:2] + (n // group, group, h)).sum(axis=3)
  noise = {"q": np.linalg.norm(dq), "k": np.linalg.norm(dk), "v": 0.0, "b": 0.0}
  if x.bias is not None:
    shape = (1,) * (4 - x.bias.ndim) + x.bias.shape
    axes = tuple(a for a in range(4) if shape[a] == 1)
    noise["b"] = np.linalg.norm(weighted.sum(axis=axes))
  return {name: float(value) for name, value in noise.items()}


def assert_matches_reference(case: Case, x: Inputs, got, want) -> None:
  """``got`` and ``want`` are (out, lse, grads) of ours and of the reference."""
  out, lse, grads = got
  ref_out, ref_lse, ref_grads = want
  tol = TOLERANCE[case.dtype]
  live = x.live_rows
  assert out.shape == x.q.shape and out.dtype == x.q.dtype
  assert lse.shape == live.shape and lse.dtype == jnp.float32
  assert relative_error(out, ref_out, live) < tol.out, relative_error(out, ref_out, live)
  # The logsumexp is a log: its error is relative to its size, but absolute
  # where it is near 0 (a row with one key has lse = its single score).
  lse_err = np.abs(np.asarray(lse, np.float64) - np.asarray(ref_lse, np.float64))[live]
  lse_size = np.maximum(np.abs(np.asarray(ref_lse, np.float64))[live], 1.0)
  assert np.all(lse_err <= tol.lse * lse_size), float(np.max(lse_err / lse_size))
  # Rows that see no key: exactly zero output and -inf logsumexp.
  assert np.all(np.asarray(out, np.float32)[~live] == 0)
  assert np.all(np.asarray(lse)[~live] == -np.inf)
  assert len(grads) == len(ref_grads)
  noise = gradient_noise(case, x)
  for name, g, rg, arg in zip("qkvb", grads, ref_grads, (x.q, x.k, x.v, x.bias)):
    assert g.shape == arg.shape and g.dtype == arg.dtype, name
    assert np.all(np.isfinite(np.asarray(g, np.float32))), name
    diff = np.linalg.norm(np.asarray(g, np.float64) - np.asarray(rg, np.float64))
    allowed = tol.grad * np.linalg.norm(np.asarray(rg, np.float64)) + tol.grad_noise * noise[name]
    assert diff <= allowed, (name, relative_error(g, rg), diff, allowed)
  # A row that sees nothing has a zero query gradient.
  assert np.all(np.asarray(grads[0], np.float32)[~live] == 0)
