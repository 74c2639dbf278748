"""Times the `cuda` kernels per configuration on the GPU at hand (a tuning aid).

    python tools/cuda_sweep.py                      # the kernels a GPU picks by default
    python tools/cuda_sweep.py --family mma_sync    # the sm_80 kernels, on Hopper too
    python tools/cuda_sweep.py --impl cudnn         # the reference, same configs
    python tools/cuda_sweep.py --head-dim 64        # only the D=64 configurations
    python tools/cuda_sweep.py --seq-len 1024       # T=1024, same tokens per batch
    python tools/cuda_sweep.py --causal             # the same configurations, causal
    python tools/cuda_sweep.py --window 1024        # each query sees 1024 keys before it

To compare a kernel change, build both versions and run this once in each
tree (same call, same GPU), with PYTHONPATH set to that tree: Python puts
tools/, not the working directory, on sys.path, so without it every run
imports whichever jax_fatrain comes first on the path, the same build each
time:

    (cd ../other_tree && PYTHONPATH=$PWD python tools/cuda_sweep.py ...)

Prints one line per configuration: forward and forward+backward TFLOP/s
(FlashAttention convention, as jax_fatrain.bench.cuda) and, for `cuda`,
the relative error of O and of the gradients against cuDNN on the same inputs,
so that a kernel that computes the wrong thing cannot look fast.
"""

import argparse

import jax
import jax.numpy as jnp

from jax_fatrain.bench import cuda as bench
from jax_fatrain._backends import cuda as _cuda

CONFIGS = [
    dict(B=4, N=32, K=32, T=4096, D=64, causal=False),
    dict(B=4, N=32, K=32, T=4096, D=64, causal=True),
    dict(B=4, N=16, K=16, T=4096, D=128, causal=False),
    dict(B=4, N=16, K=16, T=4096, D=128, causal=True),
    dict(B=4, N=8, K=8, T=4096, D=256, causal=False),
    dict(B=2, N=16, K=2, T=8192, D=256, causal=False),
]


def rel_err(a, b):
  a = a.astype(jnp.float32)
  b = b.astype(jnp.float32)
  return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


def check(cfg):
  b, n, kh, t, d = cfg["B"], cfg["N"], cfg["K"], cfg["T"], cfg["D"]
  ks = jax.random.split(jax.random.PRNGKey(1), 4)
  q = jax.random.normal(ks[0], (b, t, n, d), jnp.bfloat16)
  k = jax.random.normal(ks[1], (b, t, kh, d), jnp.bfloat16)
  v = jax.random.normal(ks[2], (b, t, kh, d), jnp.bfloat16)
  ct = jax.random.normal(ks[3], (b, t, n, d), jnp.float32)
  kwargs = {"local_window_size": cfg["window"]} if cfg.get("window") else {}
  out = {}
  for impl in ("cuda", "cudnn"):
    attn = bench._attention(impl)
    f = lambda q, k, v: attn(q, k, v, is_causal=cfg["causal"], **kwargs)
    o, vjp = jax.vjp(f, q, k, v)
    out[impl] = (o,) + vjp(ct.astype(o.dtype))
  return max(rel_err(x, y) for x, y in zip(out["cuda"], out["cudnn"]))


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--impl", default="cuda")
  ap.add_argument("--head-dim", type=int, action="append",
                  help="only the configurations with this D (repeatable)")
  ap.add_argument("--seq-len", type=int,
                  help="this T instead of each configuration's, at the same tokens per batch")
  ap.add_argument("--causal", action="store_true", help="every configuration causal")
  ap.add_argument("--window", type=int, metavar="L",
                  help="every configuration with local_window_size=(L, 0), as benchmark --cuda's "
                       "window row")
  ap.add_argument("--family", default="hopper", choices=("hopper", "mma_sync", "simt"),
                  help="the fastest kernel family ours may use (cpp/cuda/kernel_choice.h)")
  args = ap.parse_args()
  tag = f"cuda {args.family}" if args.impl == "cuda" else args.impl
  with _cuda.kernel_family(args.family):
    sweep(args, tag)


def sweep(args, tag):
  for cfg in CONFIGS:
    if args.head_dim and cfg["D"] not in args.head_dim:
      continue
    if args.seq_len:
      cfg = dict(cfg, T=args.seq_len, B=max(1, cfg["B"] * cfg["T"] // args.seq_len))
    if args.causal:
      cfg = dict(cfg, causal=True)
    if args.window is not None:
      cfg = dict(cfg, window=(args.window, 0))
    r = bench.run_one(cfg, args.impl)
    err = check(cfg) if args.impl == "cuda" else float("nan")
    window = f" window={cfg['window'][0]}" if cfg.get("window") else ""
    print(f"{tag:28s} D={cfg['D']:3d} N:K={cfg['N']}:{cfg['K']} T={cfg['T']} "
          f"causal={int(cfg['causal'])}{window}  fwd {r.get('fwd_tflops', 0):6.1f}  "
          f"f+b {r.get('fwdbwd_tflops', 0):6.1f}  max_rel_err {err:.2e} {r.get('error', '')}",
          flush=True)


if __name__ == "__main__":
  main()
