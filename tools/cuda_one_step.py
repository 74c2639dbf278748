"""One forward+backward of one attention implementation (our `cuda` by
default), for running under a profiler (ncu, compute-sanitizer):

    ncu --clock-control none -k regex:bwd_ws -c 1 python tools/cuda_one_step.py D T N K [causal [mask|bias|packed]]
    ncu --clock-control none -k regex:bprop -c 1 python tools/cuda_one_step.py 256 8192 16 2 0 --impl cudnn
    ncu --clock-control none -k regex:fwd_ws -c 1 python tools/cuda_one_step.py 128 8192 16 16 1 --window 1024
    compute-sanitizer --tool racecheck python tools/cuda_one_step.py 64 1024 4 2

The optional last positional argument adds a boolean mask or an additive
bias of shape (B, 1, T, T) (contiguous keys, so the Hopper kernels stage it),
or ("packed") segment ids that pack each sequence with 8 documents of T / 8
tokens, as benchmark --cuda --packed does (ours only). --window L lets each
query see only the L keys before it and itself (local_window_size=(L, 0), as
benchmark --cuda's window row).
--impl cudnn or xla runs jax.nn.dot_product_attention instead, as
jax_fatrain.bench.cuda does.
"""

import argparse
import os
import sys

import jax
import jax.numpy as jnp

# The checkout this tool belongs to, ahead of any installed copy: Python puts
# tools/ on sys.path, not the repository root, and on the GPU machine the
# package is built in place (tools/cuda_device_build.sh), not installed.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from jax_fatrain.bench import cuda as benchmark_cuda  # noqa: E402


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("d", type=int)
  ap.add_argument("t", type=int)
  ap.add_argument("n", type=int)
  ap.add_argument("kh", type=int)
  ap.add_argument("causal", type=int, nargs="?", default=0)
  ap.add_argument("extra", nargs="?", default="none", choices=("none", "mask", "bias", "packed"))
  ap.add_argument("--impl", default="cuda", choices=("cuda", "cudnn", "xla"))
  ap.add_argument("--window", type=int, default=None, metavar="L")
  args = ap.parse_args(argv)
  d, t, n, kh = args.d, args.t, args.n, args.kh
  b = max(1, 16384 // t)
  ks = jax.random.split(jax.random.PRNGKey(0), 3)
  q = jax.random.normal(ks[0], (b, t, n, d), jnp.bfloat16)
  k = jax.random.normal(ks[1], (b, t, kh, d), jnp.bfloat16)
  v = jax.random.normal(ks[2], (b, t, kh, d), jnp.bfloat16)
  kwargs = {}
  if args.extra in ("mask", "bias"):  # (B, 1, T, T): built only when asked for
    scores = jax.random.normal(ks[0], (b, 1, t, t), jnp.bfloat16)
    kwargs = {"mask": scores > -1.0} if args.extra == "mask" else {"bias": scores}
  if args.extra == "packed":
    ids = benchmark_cuda.packed_segment_ids(b, t, 8)
    kwargs = {"q_segment_ids": ids, "kv_segment_ids": ids}
  if args.window is not None:
    kwargs["local_window_size"] = (args.window, 0)
  attn = benchmark_cuda._attention(args.impl)
  loss = lambda q, k, v: jnp.sum(
      attn(q, k, v, is_causal=bool(args.causal), **kwargs).astype(jnp.float32))
  grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
  jax.block_until_ready(grads)
  print("ok", [float(jnp.linalg.norm(g.astype(jnp.float32))) for g in grads])


if __name__ == "__main__":
  main()
