"""Kernel times of one forward+backward per problem, by Nsight Compute, many
problems in one process (for the GPU machine after tools/cuda_device_build.sh):

    python3 tools/cuda_kernel_times.py [--impl cuda|cudnn] [--reps 3] D,T,N,K,causal ...
    e.g. python3 tools/cuda_kernel_times.py 128,4096,16,16,0 64,4096,32,32,1

Runs itself under `ncu --clock-control none --metrics gpu__time_duration.sum`
(the clocks left as they are), each problem's jitted forward+backward (B =
16384 / T, bf16, as tools/cuda_one_step.py) `reps` times after one untimed
call, with a small cosine kernel between problems as a separator, and prints
per problem and kernel the median duration in microseconds (range in
brackets). Kernels are matched by --kernel (default: the attention kernels of
ours and cuDNN's, fwd_ws|bwd_ws|fprop|bprop|simt|tc_).
"""

import argparse
import csv
import io
import os
import re
import statistics
import subprocess
import sys


def child(args):
  import jax
  import jax.numpy as jnp
  from jax_fatrain.bench import cuda as benchmark_cuda

  marker = jax.jit(lambda x: jnp.cos(x))
  xm = jnp.ones((4096,), jnp.float32)
  attn = benchmark_cuda._attention(args.impl)
  for spec in args.problems:
    d, t, n, kh, causal = (int(v) for v in spec.split(","))
    b = max(1, 16384 // t)
    ks = jax.random.split(jax.random.PRNGKey(0), 3)
    q = jax.random.normal(ks[0], (b, t, n, d), jnp.bfloat16)
    k = jax.random.normal(ks[1], (b, t, kh, d), jnp.bfloat16)
    v = jax.random.normal(ks[2], (b, t, kh, d), jnp.bfloat16)
    loss = lambda q, k, v: jnp.sum(attn(q, k, v, is_causal=bool(causal)).astype(jnp.float32))
    step = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    jax.block_until_ready(step(q, k, v))
    jax.block_until_ready(marker(xm))
    for _ in range(args.reps):
      jax.block_until_ready(step(q, k, v))
    jax.block_until_ready(marker(xm))


def summarise(page, problems, kernel_regex, impl):
  """Lines of the table from ncu's --csv page (rows of "Kernel Name",
  "Metric Value" in ns, in launch order): the kernels between the second
  and third, fourth and fifth, ... separator of each problem ([untimed
  call][marker][timed calls][marker] per problem), per problem and kernel
  the median in µs, the range and the count. ncu writes values of four or
  more digits with thousands separators."""
  rows = list(csv.DictReader(io.StringIO(page)))
  groups, cur, n_markers = [], [], 0
  for r in rows:
    name = r["Kernel Name"]
    if re.search("cos", name) and not re.search(kernel_regex, name):
      n_markers += 1
      if n_markers % 2 == 0:
        groups.append(cur)
      cur = []
      continue
    cur.append((name, float(r["Metric Value"].replace(",", "")) / 1e3))
  out = []
  for spec, g in zip(problems, groups):
    by = {}
    for name, us in g:
      short = re.sub(r"\(.*", "", name.replace("(anonymous namespace)::", ""))[:60]
      by.setdefault(short, []).append(us)
    for short, ts in by.items():
      out.append(f"{impl:6s} {spec:18s} {short:60s} {statistics.median(ts):9.1f} "
                 f"({min(ts):.1f}-{max(ts):.1f}) x{len(ts)}")
  return out


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("problems", nargs="+", help="D,T,N,K,causal")
  ap.add_argument("--impl", default="cuda", choices=("cuda", "cudnn"))
  ap.add_argument("--reps", type=int, default=3)
  ap.add_argument("--kernel", default="fwd_ws|bwd_ws|fprop|bprop|simt|tc_")
  ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
  args = ap.parse_args()
  if args.child:
    return child(args)
  here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env = dict(os.environ, PYTHONPATH=here + os.pathsep + os.environ.get("PYTHONPATH", ""))
  cmd = ["ncu", "--clock-control", "none", "--metrics", "gpu__time_duration.sum",
         "-k", f"regex:{args.kernel}|cos", "--csv", "--print-units", "base",
         sys.executable, os.path.abspath(__file__), "--child", "--impl", args.impl,
         "--reps", str(args.reps)] + args.problems
  p = subprocess.run(cmd, env=env, capture_output=True, text=True)
  lines = [l for l in p.stdout.splitlines() if l.startswith('"')]
  if p.returncode != 0 or not lines:
    print(p.stdout[-3000:], p.stderr[-3000:], file=sys.stderr)
    return 1
  for line in summarise("\n".join(lines), args.problems, args.kernel, args.impl):
    print(line)
  return 0


if __name__ == "__main__":
  sys.exit(main())
