"""Per-device memory of ring attention vs. the gathered (unpartitioned) op.

Usage: python tools/sharding_memory.py [--seq 32768] [--devices 8] [--run]

Compiles forward+backward (jax.vjp with a random cotangent) of
jax_fatrain.dot_product_attention with q/k/v sharded along the sequence over
all devices, once partitioned (ring attention) and once with partitioning
switched off (jax_fatrain._sharding.DISABLED: XLA gathers q/k/v on every
device and runs the whole attention there), and prints
compiled.memory_analysis() (per device). --run also executes the ring version
and prints its time and the process's peak RSS.
"""

import argparse
import os
import sys


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--seq", type=int, default=32768)
  p.add_argument("--heads", type=int, default=1)
  p.add_argument("--head-dim", type=int, default=64)
  p.add_argument("--devices", type=int, default=8)
  p.add_argument("--causal", type=int, default=1)
  p.add_argument("--implementation", default="cpu")
  p.add_argument("--run", action="store_true")
  a = p.parse_args()
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             f" --xla_force_host_platform_device_count={a.devices}")
  import resource
  import time

  import jax
  import jax.numpy as jnp
  from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

  import jax_fatrain
  from jax_fatrain import _sharding

  mesh = jax.make_mesh((a.devices,), ("seq",), axis_types=(AxisType.Auto,))
  shape = (1, a.seq, a.heads, a.head_dim)
  sh = NamedSharding(mesh, P(None, "seq"))
  args = [jax.ShapeDtypeStruct(shape, jnp.float32, sharding=sh) for _ in range(4)]

  def f(q, k, v, ct):
    o, vjp = jax.vjp(lambda q, k, v: jax_fatrain.dot_product_attention(
        q, k, v, is_causal=bool(a.causal), implementation=a.implementation), q, k, v)
    return (o,) + vjp(ct)

  mib = lambda x: x / 2**20
  print(f"B=1 T=S={a.seq} N=K={a.heads} D={a.head_dim} float32 causal={bool(a.causal)} "
        f"devices={a.devices} implementation={a.implementation}")
  print(f"one q/k/v/o array: {mib(4 * a.seq * a.heads * a.head_dim):.1f} MiB global, "
        f"{mib(4 * a.seq * a.heads * a.head_dim / a.devices):.2f} MiB per shard")
  compiled = {}
  for name, disabled in (("ring", False), ("gathered", True)):
    _sharding.DISABLED = disabled
    jax.clear_caches()
    c = jax.jit(f, out_shardings=sh).lower(*args).compile()
    m = c.memory_analysis()
    text = c.as_text()
    colls = sorted({op for op in ("all-gather", "all-to-all", "collective-permute",
                                  "all-reduce") if f" {op}(" in text or f" {op}-start(" in text})
    print(f"{name:9s} per device: argument {mib(m.argument_size_in_bytes):7.2f} MiB  "
          f"output {mib(m.output_size_in_bytes):7.2f} MiB  temp {mib(m.temp_size_in_bytes):8.2f} MiB"
          f"  total {mib(m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes):8.2f} MiB"
          f"  collectives {colls}")
    compiled[name] = c
  _sharding.DISABLED = False
  if a.run:
    import numpy as np
    rng = np.random.default_rng(0)
    xs = [jax.device_put(jnp.asarray(rng.standard_normal(shape), jnp.float32), sh)
          for _ in range(4)]
    start = time.time()
    jax.block_until_ready(compiled["ring"](*xs))
    print(f"ring fwd+bwd ran in {time.time() - start:.1f} s; process peak RSS "
          f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10:.0f} MiB")
  return 0


if __name__ == "__main__":
  sys.exit(main())
