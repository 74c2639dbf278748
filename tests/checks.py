"""The one comparison every backend's tests use: ours against jax.nn (docs/testing.md).

``results(case, x, attention)`` runs an attention function on a case's inputs
and returns its output, logsumexp and gradients of a loss with a random
cotangent; ``reference_results`` does the same for ``jax.nn`` in float32;
``assert_matches_reference`` holds the two to the tolerances of
``attention_cases.TOLERANCE`` and to our convention for rows that see no key.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

import jax_fatrain
from attention_cases import TOLERANCE, Case, Inputs, jax_nn_kwargs, relative_error, reference


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


def results(case: Case, x: Inputs, implementation: str):
  """(out, lse [B, T, N], grads) of jax_fatrain with ``implementation``."""
  ours = functools.partial(jax_fatrain.dot_product_attention, implementation=implementation)
  out, lse = jax.jit(lambda q, k, v: ours(q, k, v, return_residual=True, **x.kwargs(case)))(
      x.q, x.k, x.v)
  return out, lse, gradients(ours, case, x)


def reference_results(case: Case, x: Inputs):
  """(out, lse, grads) of jax.nn.dot_product_attention on float32 inputs."""
  def ref_attention(q, k, v, **kw):
    return jax.nn.dot_product_attention(_up(q), _up(k), _up(v), implementation="xla",
                                        **jax_nn_kwargs({**kw, "bias": _up(kw["bias"])}))
  out, lse = reference(case, x)
  return out, lse, gradients(ref_attention, case, x)


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
  for name, g, rg, arg in zip("qkvb", grads, ref_grads, (x.q, x.k, x.v, x.bias)):
    assert g.shape == arg.shape and g.dtype == arg.dtype, name
    assert np.all(np.isfinite(np.asarray(g, np.float32))), name
    assert relative_error(g, rg) < tol.grad, (name, relative_error(g, rg))
  # A row that sees nothing has a zero query gradient.
  assert np.all(np.asarray(grads[0], np.float32)[~live] == 0)
