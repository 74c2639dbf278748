"""Non-finite inputs and extreme arguments (docs/testing.md, "Hostile inputs").

NaN, +Inf and -Inf in q, k, v or the bias propagate as in
``jax.nn.dot_product_attention``: the same elements of the output and of
every gradient (dq, dk, dv, dbias) are NaN, +Inf or -Inf, and the finite ones
agree. The logsumexp of a row with an infinite score is NaN here and +Inf in
jax.nn (docs/design.md); the output row is NaN in both.

The problems are unmasked and not causal on purpose: a key that a query
cannot see passes a non-finite value on to that query's row in jax.nn
(0 * Inf = NaN) and here only when it shares a computed tile with visible
keys (docs/design.md).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_fatrain
from attention_cases import IMPLEMENTATIONS, TOLERANCE, relative_error

IMPLS = IMPLEMENTATIONS + tuple(
    i for i in ("metal_emulated",) if i in jax_fatrain.available_implementations())

B, T, S, N, K, H = 2, 19, 23, 4, 2, 40
# Where the non-finite value goes: (array, index).
ROW = 7          # query row
KEY = 11         # key
HEAD = 3         # query head (kv head HEAD // 2)
DIM = 5          # head-dim element


def _inputs(operand: str, value: float):
  rng = np.random.default_rng(0)
  q = rng.standard_normal((B, T, N, H)).astype(np.float32)
  k = rng.standard_normal((B, S, K, H)).astype(np.float32)
  v = rng.standard_normal((B, S, K, H)).astype(np.float32)
  bias = rng.standard_normal((B, N, T, S)).astype(np.float32)
  ct = rng.standard_normal((B, T, N, H)).astype(np.float32)
  if operand == "query":
    q[1, ROW, HEAD, DIM] = value
    if np.isinf(value):
      # Every score of the row becomes +inf, not a mix of +inf and -inf: a
      # -inf score hides its key like a mask (see the module docstring).
      k[1, :, HEAD // 2, DIM] = (np.abs(k[1, :, HEAD // 2, DIM]) + 0.1) * np.sign(value)
  elif operand == "key":
    k[1, KEY, HEAD // 2, DIM] = value
  elif operand == "value":
    v[1, KEY, HEAD // 2, DIM] = value
  else:
    bias[1, HEAD, ROW, KEY] = value
  return q, k, v, bias, ct


@functools.lru_cache(maxsize=None)
def _step(attention):
  """One jitted (grads, (out, lse)) per attention function: every problem here
  has the same shapes, so each implementation compiles once and the
  non-finite values are data."""
  def loss(q, k, v, bias, ct):
    out, lse = attention(q, k, v, bias)
    return jnp.sum(out * ct), (out, lse)
  return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3), has_aux=True))


def _run(attention, q, k, v, bias, ct):
  """out, lse and the gradients in q, k, v, bias (float32 numpy)."""
  grads, (out, lse) = _step(attention)(q, k, v, bias, ct)
  return {name: np.asarray(a, np.float32) for name, a in
          zip(("out", "lse", "dq", "dk", "dv", "dbias"), (out, lse) + tuple(grads))}


@functools.lru_cache(maxsize=None)
def _ours(implementation):
  return functools.partial(jax_fatrain.dot_product_attention, implementation=implementation,
                           return_residual=True)


def _reference(q, k, v, bias):
  with jax.default_matmul_precision("highest"):
    return jax.nn.dot_product_attention(q, k, v, bias, implementation="xla",
                                        return_residual=True)


@functools.lru_cache(maxsize=None)
def _reference_results(operand, value):
  """jax.nn's results of one problem, the same for every implementation."""
  return _run(_reference, *_inputs(operand, value))


def _assert_same_non_finite(name, got, want):
  for what, test in (("NaN", np.isnan), ("+Inf", np.isposinf), ("-Inf", np.isneginf)):
    mismatch = test(got) != test(want)
    assert not mismatch.any(), (
        f"{name}: {what} at {int(mismatch.sum())} elements that differ from jax.nn "
        f"(ours {int(test(got).sum())}, jax.nn {int(test(want).sum())})")


@pytest.mark.parametrize("implementation", IMPLS)
@pytest.mark.parametrize("operand", ["query", "key", "value", "bias"])
@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf], ids=["nan", "inf", "-inf"])
def test_non_finite_input_propagates_like_jax_nn(implementation, operand, value):
  ours = _run(_ours(implementation), *_inputs(operand, value))
  want = _reference_results(operand, value)
  # The value must reach jax.nn's outputs (else the case tests nothing),
  # except a -inf bias: that is a mask, and everything stays finite.
  all_finite = all(np.isfinite(a).all() for a in want.values() if a is not want["lse"])
  assert all_finite == (operand == "bias" and value == -np.inf)
  tol = TOLERANCE[jnp.float32]
  for name in ("out", "dq", "dk", "dv", "dbias"):
    _assert_same_non_finite(name, ours[name], want[name])
    finite = np.isfinite(want[name])
    limit = tol.out if name == "out" else tol.grad
    assert relative_error(ours[name][finite], want[name][finite]) < limit, name
  # lse: NaN wherever jax.nn's is NaN or +Inf (a row with an infinite score),
  # -inf where jax.nn's is (a row all of whose scores are -inf: no key seen).
  lse, ref_lse = ours["lse"], want["lse"]
  assert np.array_equal(np.isnan(lse), np.isnan(ref_lse) | np.isposinf(ref_lse))
  assert np.array_equal(np.isneginf(lse), np.isneginf(ref_lse))
  finite = np.isfinite(ref_lse)
  assert np.abs(lse[finite] - ref_lse[finite]).max() < 1e-4


@pytest.mark.parametrize("implementation", IMPLS)
def test_huge_windows_are_unbounded(implementation):
  """A window side of 2^31 or more sees every key: same as no window, on every
  implementation (the Metal ABI holds 32-bit windows, the FFI 64-bit ones)."""
  rng = np.random.default_rng(1)
  q = jnp.asarray(rng.standard_normal((1, 20, 2, 64)), jnp.float32)
  kv = jnp.asarray(rng.standard_normal((1, 30, 1, 64)), jnp.float32)
  attend = lambda w: np.asarray(jax_fatrain.dot_product_attention(
      q, kv, kv, is_causal=True, local_window_size=w, implementation=implementation))
  want = attend(None)
  for window in (2**31, (2**40, 3), (5, 2**63 - 1), 2**64):
    got = attend(window)
    if isinstance(window, tuple) and min(window) < 49:
      # One side is bounded: the same window with the other side spelled
      # T + S - 1 = 49 (which still hides nothing).
      small = tuple(w if w < 49 else 49 for w in window)
      np.testing.assert_allclose(got, attend(small), rtol=1e-6, atol=1e-6)
    else:
      np.testing.assert_array_equal(got, want)
