"""Large problems: 64-bit offsets and memory linear in T.

* A boolean mask of more than 2^31 elements (and a bias shared over batch and
  heads, so B x N x T x S > 2^31 for it too): a few rows of the output, the
  logsumexp, dq and dbias against float64 NumPy on a slice. Every offset into
  the mask past 2^31 would wrap in 32-bit arithmetic. On the CPU kernels in
  float32; on an NVIDIA GPU also on the CUDA tensor-core kernels (bfloat16,
  head dim 64). In CI the problem is
  causal with a 200-key window, so the kernels read the mask along its
  diagonal (offsets up to its end) in seconds; the whole mask (about a
  minute on the CPU) runs on request.
* (on request, ~9 GiB) a bfloat16 query of more than 2^31 elements, forward
  only.

On request: JAX_FATRAIN_LARGE_TESTS=1.
* The peak extra memory of forward + backward grows linearly in T (4096 vs
  16384), measured in a fresh process, so an O(T^2) buffer fails here.
"""

import os
import pathlib
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_fatrain
from attention_cases import IMPLEMENTATIONS, TOLERANCE, relative_error

HERE = pathlib.Path(__file__).parent
LARGE = os.environ.get("JAX_FATRAIN_LARGE_TESTS") == "1"


def _rows_reference(q, k, v, bias, mask_row, ct, scale, b, n, i, group):
  """float64 out, lse, dq and dS of query row (b, i, n) over all keys
  (mask_row: the keys it sees)."""
  qi = q[b, i, n].astype(np.float64)
  kh = n // group
  kk = k[b, :, kh].astype(np.float64)
  vv = v[b, :, kh].astype(np.float64)
  s = scale * (kk @ qi) + bias[0, 0, i].astype(np.float64)
  s = np.where(mask_row, s, -np.inf)
  if not mask_row.any():   # sees no key: our convention (docs/design.md)
    return np.zeros(kk.shape[1]), -np.inf, np.zeros(kk.shape[1]), np.zeros(len(s))
  m = s.max()
  p = np.exp(s - m)
  lse = m + np.log(p.sum())
  p = np.exp(s - lse)
  out = p @ vv
  do = ct[b, i, n].astype(np.float64)
  dp = vv @ do
  ds = p * (dp - do @ out)
  dq = scale * (ds @ kk)
  return out, lse, dq, ds


# The dtype and head dim each implementation runs the large-mask problem in:
# float32 on the CPU, where its rows must match to float32 rounding; on CUDA
# the tensor-core kernels' bfloat16 at D = 64, held to the suite's bfloat16
# tolerances (attention_cases.TOLERANCE).
LARGE_MASK_CONFIGS = {"cpu": (np.float32, 16), "cuda": (jnp.bfloat16, 64)}


@pytest.mark.parametrize("implementation", [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(
        "cuda" not in IMPLEMENTATIONS, reason="needs the CUDA extension and a GPU")),
])
@pytest.mark.parametrize("window", [
    (200, 0),
    pytest.param(None, marks=pytest.mark.skipif(
        not LARGE, reason="the whole mask takes about a minute; set JAX_FATRAIN_LARGE_TESTS=1")),
], ids=["causal-window", "whole-mask"])
def test_mask_of_more_than_2_31_elements(window, implementation):
  dtype, h_ = LARGE_MASK_CONFIGS[implementation]
  b_, n_, t_, s_, kh_ = 2, 16, 8256, 8192, 4
  assert b_ * n_ * t_ * s_ > 2**31
  group = n_ // kh_
  rng = np.random.default_rng(0)

  def operand(shape):  # in `dtype`, and as float32 NumPy holding the same values
    x = jnp.asarray(rng.standard_normal(shape, np.float32), dtype)
    return x, np.asarray(x, np.float32)
  (q, q_np), (k, k_np), (v, v_np) = (operand((b_, t_, n_, h_)), operand((b_, s_, kh_, h_)),
                                     operand((b_, s_, kh_, h_)))
  bias = rng.standard_normal((1, 1, t_, s_), np.float32)
  ct, ct_np = operand((b_, t_, n_, h_))
  scale = 0.25
  # The mask [B, N, T, S] is one pattern over (T, S), complemented for some
  # (b, n): built inside the jitted function by one elementwise XOR, so only
  # the 2 GiB mask itself is ever allocated.
  pattern = rng.random((t_, s_)) < 0.8
  flip = rng.random((b_, n_)) < 0.5
  flip[1, n_ - 1] = True    # the last head reads the complement (1/5 of the keys)

  j = np.arange(s_)

  def mask_row(b, n, i):
    seen = pattern[i] ^ flip[b, n]
    if window is not None:
      seen = seen & (j <= i) & (j >= i - window[0])
    return seen

  def loss(q, k, v, bias, pattern, flip):
    mask = pattern[None, None] ^ flip[:, :, None, None]
    out, lse = jax_fatrain.dot_product_attention(
        q, k, v, bias, mask, scale=scale, is_causal=window is not None,
        local_window_size=window, implementation=implementation, return_residual=True)
    return jnp.sum(out.astype(jnp.float32) * ct.astype(jnp.float32)), (out, lse)

  (dq, dbias), (out, lse) = jax.jit(jax.grad(loss, argnums=(0, 3), has_aux=True))(
      q, k, v, bias, pattern, flip)
  out, lse, dq, dbias = (np.asarray(a, np.float32) for a in (out, lse, dq, dbias))
  # Rows at the start, middle and end of the mask; (b, n) = (1, 15) and most
  # of (1, *) lie past 2^31 elements into it.
  rows = [(0, 0, 0), (1, n_ - 1, t_ - 1), (1, n_ - 2, t_ // 2), (1, 7, t_ - 300),
          (0, n_ - 1, 4097)]
  assert max((b * n_ + n) * t_ * s_ + i * s_ for b, n, i in rows) > 2**31
  tol = TOLERANCE[jnp.bfloat16]
  for b, n, i in rows:
    want_out, want_lse, want_dq, _ = _rows_reference(q_np, k_np, v_np, bias, mask_row(b, n, i),
                                                     ct_np, scale, b, n, i, group)
    if dtype == np.float32:
      np.testing.assert_allclose(out[b, i, n], want_out, rtol=2e-4, atol=2e-5)
      np.testing.assert_allclose(lse[b, i, n], want_lse, rtol=1e-5, atol=1e-5)
      np.testing.assert_allclose(dq[b, i, n], want_dq, rtol=2e-3, atol=2e-5)
    else:
      assert relative_error(out[b, i, n], want_out) < tol.out, (b, n, i)
      np.testing.assert_allclose(lse[b, i, n], want_lse, rtol=tol.lse, atol=tol.lse)
      assert relative_error(dq[b, i, n], want_dq) < tol.grad, (b, n, i)
  # dbias [1, 1, T, S] sums dS over every batch and head: rows of it.
  for i in (0, t_ // 3, t_ - 1):
    want = np.zeros(s_)
    for b in range(b_):
      for n in range(n_):
        want += _rows_reference(q_np, k_np, v_np, bias, mask_row(b, n, i), ct_np, scale, b,
                                n, i, group)[3]
    if dtype == np.float32:
      np.testing.assert_allclose(dbias[0, 0, i], want, rtol=1e-3, atol=1e-6)
    else:
      assert relative_error(dbias[0, 0, i], want) < tol.grad, i


@pytest.mark.skipif(not LARGE, reason="needs ~9 GiB of memory; set JAX_FATRAIN_LARGE_TESTS=1")
def test_query_of_more_than_2_31_elements():
  """A bfloat16 query (and output) of more than 2^31 elements, forward only:
  the backward's float32 scratch would need 4x the query in float32 (32 GiB)."""
  b_, t_, n_, h_, s_ = 1, 262_400, 128, 64, 16
  assert b_ * t_ * n_ * h_ > 2**31
  rng = np.random.default_rng(1)
  k = jnp.asarray(rng.standard_normal((b_, s_, 1, h_)), jnp.bfloat16)
  v = jnp.asarray(rng.standard_normal((b_, s_, 1, h_)), jnp.bfloat16)

  def query_values(t, n, d):
    return jnp.sin(0.37 * t + 1.3 * n + 0.11 * d + 0.05 * t * d)

  def forward(k, v):
    idx = [jax.lax.broadcasted_iota(jnp.float32, (b_, t_, n_, h_), d) for d in (1, 2, 3)]
    q = query_values(*idx).astype(jnp.bfloat16)
    out, lse = jax_fatrain.dot_product_attention(q, k, v, implementation="cpu",
                                                 return_residual=True)
    rows = jnp.array([0, t_ // 2, t_ - 1])
    return out[:, rows], lse[:, rows]

  out, lse = jax.jit(forward)(k, v)
  out, lse = np.asarray(out, np.float32), np.asarray(lse)
  kk = np.asarray(k, np.float64)[0, :, 0]
  vv = np.asarray(v, np.float64)[0, :, 0]
  d = np.arange(h_, dtype=np.float32)
  for r, t in enumerate((0, t_ // 2, t_ - 1)):
    for n in (0, n_ - 1):
      qrow = np.asarray(jnp.asarray(query_values(np.float32(t), np.float32(n), d),
                                    jnp.bfloat16), np.float64)
      s = kk @ qrow / np.sqrt(h_)
      p = np.exp(s - s.max())
      np.testing.assert_allclose(out[0, r, n], p @ vv / p.sum(), rtol=2e-2, atol=1e-2)
      np.testing.assert_allclose(lse[0, r, n], s.max() + np.log(p.sum()), rtol=1e-4,
                                 atol=1e-4)


_MEMORY_SCRIPT = textwrap.dedent(r"""
    import sys
    import jax, jax.numpy as jnp, numpy as np
    import jax_fatrain

    t, heads, d = int(sys.argv[1]), 2, 64

    def status(field):
      with open("/proc/self/status") as f:
        for line in f:
          if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
      raise RuntimeError(field)

    rng = np.random.default_rng(0)
    q, k, v, ct = (jnp.asarray(rng.standard_normal((1, t, heads, d)), jnp.float32)
                   for _ in range(4))

    def loss(q, k, v):
      out = jax_fatrain.dot_product_attention(q, k, v, is_causal=True,
                                              local_window_size=(256, 0),
                                              implementation="cpu")
      return jnp.sum(out * ct)
    step = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, k, v).compile()
    jax.block_until_ready((q, k, v, ct))
    # Peak RSS from here on: writing 5 to clear_refs resets VmHWM to VmRSS.
    with open("/proc/self/clear_refs", "w") as f:
      f.write("5")
    before = status("VmRSS")
    grads = jax.block_until_ready(step(q, k, v))
    print(status("VmHWM") - before)
    """)


def _peak_extra_bytes(t: int) -> int:
  env = dict(os.environ, PYTHONPATH=str(HERE) + os.pathsep + os.environ.get("PYTHONPATH", ""))
  proc = subprocess.run([sys.executable, "-c", _MEMORY_SCRIPT, str(t)], env=env,
                        capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return int(proc.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not pathlib.Path("/proc/self/clear_refs").exists(),
                    reason="needs Linux's /proc/self/clear_refs to reset the peak RSS")
def test_forward_backward_memory_is_linear_in_t():
  small, large = _peak_extra_bytes(4096), _peak_extra_bytes(16384)
  # What forward + backward must hold at T = 16384 (2 heads, D = 64, float32):
  # q, k, v, dO, O, dq, dk, dv and the packed copies, ~8 MiB each. A [T, S]
  # float32 buffer of one head alone would be 1 GiB (16x the T = 4096 one).
  per_tensor = 16384 * 2 * 64 * 4
  assert large > 4 * per_tensor, (small, large)        # the measurement sees the work
  assert large < 40 * per_tensor, (small, large)       # no O(T^2) buffer
  assert large < 6 * max(small, per_tensor // 4), (small, large)   # ~4x for 4x T
