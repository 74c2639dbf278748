"""One forward+backward of the `cuda` implementation, for running under a
profiler (ncu, compute-sanitizer):

    ncu --clock-control none -k regex:bwd_ws -c 1 python tools/cuda_one_step.py D T N K [causal [mask|bias]]
    compute-sanitizer --tool racecheck python tools/cuda_one_step.py 64 1024 4 2

The optional last argument adds a boolean mask or an additive bias of shape
(B, 1, T, T) (contiguous keys, so the Hopper kernels stage it).
"""

import sys

import jax
import jax.numpy as jnp

import jax_fatrain


def main(d=128, t=4096, n=16, kh=16, causal=0, extra="none"):
  b = max(1, 16384 // t)
  ks = jax.random.split(jax.random.PRNGKey(0), 3)
  q = jax.random.normal(ks[0], (b, t, n, d), jnp.bfloat16)
  k = jax.random.normal(ks[1], (b, t, kh, d), jnp.bfloat16)
  v = jax.random.normal(ks[2], (b, t, kh, d), jnp.bfloat16)
  kwargs = {}
  if extra in ("mask", "bias"):  # (B, 1, T, T): built only when asked for
    scores = jax.random.normal(ks[0], (b, 1, t, t), jnp.bfloat16)
    kwargs = {"mask": scores > -1.0} if extra == "mask" else {"bias": scores}
  loss = lambda q, k, v: jnp.sum(jax_fatrain.dot_product_attention(
      q, k, v, is_causal=bool(causal), implementation="cuda", **kwargs).astype(jnp.float32))
  grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
  jax.block_until_ready(grads)
  print("ok", [float(jnp.linalg.norm(g.astype(jnp.float32))) for g in grads])


if __name__ == "__main__":
  main(*map(int, sys.argv[1:6]), *sys.argv[6:7])
