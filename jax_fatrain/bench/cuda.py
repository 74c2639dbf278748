"""Side-by-side throughput on one NVIDIA GPU: jax_fatrain ``cuda`` against
``jax.nn.dot_product_attention(implementation="cudnn")`` and ``"xla"``.

    python -m jax_fatrain.benchmark --cuda [--quick] [--masked-only] [--no-xla] [--repeat N]
                                           [--part K/N] [--json FILE] [--plot FILE]
    python -m jax_fatrain.benchmark --cuda --packed [--repeat N] [--json FILE]

Configurations (docs/cuda.md has a measured table): bf16, 16k tokens per
batch, D in {64, 128, 256} with 2048 / D heads, T in {1k, 4k, 8k}, causal off/on;
the GQA 16:2 D=256 rows (T 2k / 8k); GQA 32:8 D=128 causal at T 4k / 8k; a
float16 row; a causal row with a 1024-key sliding window; long causal context
(B=1, GQA 8:2, T 32k and 128k, D 128 and 256; no XLA reference there, its
T x T scores do not fit); a boolean-mask row and an additive-bias row (full
[B, N, T, S] tensors, which cuDNN must read too). ``--plot`` draws the ratios
ours / cuDNN.

``--packed`` times packed sequences instead: B = 2, T = 8192 split into 8
documents of 1024 tokens, causal, D = 128, 16 query and 4 key/value heads,
bf16; ours with segment ids against ours dense causal on the same shape and
against cuDNN given the equivalent materialised boolean mask ``[B, 1, T, T]``
(``packed_rows``), in milliseconds. Each variant is timed two ways: one call
at a time (``_time``), and calls queued back to back and waited for once
(``_time_back_to_back``, as every other row is). The second is the GPU time
of a call as a training loop sees it; the first adds the host's dispatch and
its wake-up after each call, about 0.2 ms that weighs on a 1 ms call.

FLOP convention (FlashAttention papers): forward 4·B·N·T·S·D, halved when
causal; backward 2.5x forward, so forward+backward counts 3.5x forward.
The rows' times are GPU times per call: jitted calls queued back to back and
waited for once (``_time_back_to_back``; as many calls as fill about 20 ms, a
median over five such rounds), so that the host's dispatch and wake-up, which
vary from call to call, stay out of the ratios. With --repeat N each
row is measured in N rounds, the implementations' order rotated between rounds,
and each time is the median over the rounds: single rounds at T = 1k have come
out 2x off on an H200.

An idle GPU starts at a low clock, so the first, smallest rows can read low
for every implementation (an H200 at 360 MHz: cuDNN's D = 64 T = 1k forward at
half its usual rate). There is no warm-up load on purpose: JAX's allocator
grows its pool in steps that depend on what was allocated first, and after
2 s of matrix products, or of the first row's own problem, the XLA reference
could no longer get the 40 GiB that its D = 64 T = 8k rows need. Run it on a
GPU that has just been busy, or with --repeat.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time

import jax
import jax.numpy as jnp


def _time(fn, *args, n=10, warm=2):
  for _ in range(warm):
    jax.block_until_ready(fn(*args))
  ts = []
  for _ in range(n):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    ts.append(time.perf_counter() - t0)
  return statistics.median(ts)


def _time_back_to_back(fn, *args, calls=None, rounds=5, warm=2, round_s=0.02):
  """Seconds per call when `calls` calls are queued one after another and
  waited for once (the median over `rounds`): the GPU time of a call as a
  training loop sees it, where the host queues the next step while the GPU
  runs this one. _time's one call at a time adds the host's dispatch and the
  wake-up after each call to every time. calls=None: as many calls (1 to 50)
  as fill about `round_s` seconds, from the time of the last warm-up call."""
  for _ in range(warm - 1):
    jax.block_until_ready(fn(*args))
  t0 = time.perf_counter()
  jax.block_until_ready(fn(*args))
  if calls is None:
    calls = max(1, min(50, math.ceil(round_s / max(time.perf_counter() - t0, 1e-6))))
  ts = []
  for _ in range(rounds):
    t0 = time.perf_counter()
    for _ in range(calls):
      out = fn(*args)  # one stream: the last call done means all are done
    jax.block_until_ready(out)
    ts.append((time.perf_counter() - t0) / calls)
  return statistics.median(ts)


def _attention(impl):
  if impl == "cuda":
    import jax_fatrain
    return lambda q, k, v, **kw: jax_fatrain.dot_product_attention(
        q, k, v, implementation="cuda", **kw)
  return lambda q, k, v, **kw: jax.nn.dot_product_attention(
      q, k, v, implementation=impl, **kw)


def configs(quick: bool, masked_only: bool = False):
  """The rows: dicts of B, N (query heads), K (key/value heads), T, D, causal,
  and optionally dtype (default bfloat16), window (left, right), extra ("mask"
  or "bias") and long (True where the XLA reference cannot hold T x T scores)."""
  rows = []
  for d in (64, 128, 256):
    for t in (1024, 4096, 8192):
      for causal in (False, True):
        rows.append(dict(B=16384 // t, N=2048 // d, K=2048 // d, T=t, D=d, causal=causal))
  for t in (2048, 8192):
    for causal in (False, True):
      rows.append(dict(B=16384 // t, N=16, K=2, T=t, D=256, causal=causal))
  # Llama-3-8B-like GQA, float16, a sliding window, long causal context.
  for t in (4096, 8192):
    rows.append(dict(B=16384 // t, N=32, K=8, T=t, D=128, causal=True))
  rows.append(dict(B=8, N=16, K=16, T=2048, D=128, causal=False, dtype="float16"))
  rows.append(dict(B=2, N=16, K=16, T=8192, D=128, causal=True, window=(1024, 0)))
  for t in (32768, 131072):
    for d in (128, 256):
      rows.append(dict(B=1, N=8, K=2, T=t, D=d, causal=True, long=True))
  for extra in ("mask", "bias"):
    rows.append(dict(B=4, N=16, K=16, T=4096, D=128, causal=False, extra=extra))
  if masked_only:
    rows = [r for r in rows if r.get("extra")]
  if quick:
    keep = lambda r: (r.get("extra") or (r["D"] == 128 and r["T"] == 4096 and r["K"] == 16)
                      or (r["K"] == 2 and r["T"] == 8192))
    rows = [r for r in rows if keep(r)]
  return rows


def row_label(cfg) -> str:
  """A short name for a row, for tables and plots: "D128 T8k 32:8 causal"."""
  t = cfg["T"]
  parts = [f"D{cfg['D']}", f"T{t // 1024}k" if t % 1024 == 0 else f"T{t}",
           f"{cfg['N']}:{cfg['K']}"]
  if cfg["causal"]: parts.append("causal")
  if cfg.get("window"): parts.append(f"window {cfg['window'][0]}")
  if cfg.get("dtype", "bfloat16") != "bfloat16": parts.append(cfg["dtype"])
  if cfg.get("extra"): parts.append(cfg["extra"])
  return " ".join(parts)


def run_one(cfg, impl):
  b, n, kh, t, d, causal = cfg["B"], cfg["N"], cfg["K"], cfg["T"], cfg["D"], cfg["causal"]
  if impl == "xla" and cfg.get("long"):
    return dict(error="skipped: XLA's T x T scores do not fit")
  dtype = jnp.dtype(cfg.get("dtype", "bfloat16"))
  k0, k1, k2, k3 = jax.random.split(jax.random.PRNGKey(0), 4)
  q = jax.random.normal(k0, (b, t, n, d), dtype)
  k = jax.random.normal(k1, (b, t, kh, d), dtype)
  v = jax.random.normal(k2, (b, t, kh, d), dtype)
  # The mask or bias travels as a jit argument: closed over, a [B, N, T, S]
  # array would be baked into the program as a gigabyte constant.
  extra = cfg.get("extra")
  if extra == "mask":
    x = jax.random.bernoulli(k3, 0.9, (b, n, t, t))
  elif extra == "bias":
    x = jax.random.normal(k3, (b, n, t, t), jnp.bfloat16)
  else:
    x = None
  attn = _attention(impl)
  kwargs = dict(is_causal=causal)
  if cfg.get("window"):
    kwargs["local_window_size"] = tuple(cfg["window"])
  call = lambda q, k, v, x: attn(q, k, v, **kwargs, **({extra: x} if extra else {}))
  fwd = jax.jit(call)
  fb = jax.jit(jax.grad(lambda q, k, v, x: jnp.sum(call(q, k, v, x).astype(jnp.float32)),
                        argnums=(0, 1, 2)))
  try:
    tf = _time_back_to_back(fwd, q, k, v, x)
    tfb = _time_back_to_back(fb, q, k, v, x)
  except Exception as e:  # noqa: BLE001 - report and go on
    return dict(error=str(e).splitlines()[0][:120])
  return _result(cfg, tf, tfb)


def visible_pairs(cfg) -> float:
  """Query-key pairs a row computes: T^2, halved when causal; with a window
  (left, right) the pairs inside it."""
  t = cfg["T"]
  if cfg.get("window"):
    left, right = cfg["window"]
    right = 0 if cfg["causal"] else right
    return sum(min(i + right, t - 1) - max(i - left, 0) + 1 for i in range(t))
  return t * t * (0.5 if cfg["causal"] else 1.0)


def _result(cfg, fwd_s, fwdbwd_s):
  """A row's times (seconds) as the printed and saved fields."""
  flops = 4.0 * cfg["B"] * cfg["N"] * cfg["D"] * visible_pairs(cfg)
  return dict(fwd_ms=fwd_s * 1e3, fwdbwd_ms=fwdbwd_s * 1e3, fwd_tflops=flops / fwd_s / 1e12,
              fwdbwd_tflops=3.5 * flops / fwdbwd_s / 1e12)


def measure_row(cfg, impls, repeat=1, run=None):
  """{impl: result} for one configuration, over `repeat` rounds.

  Each round runs every implementation; round r starts at implementation
  r mod len(impls), so none always runs first. Each time is the median over
  the rounds (an error in any round is reported instead). With one round this
  is one run_one per implementation, in the given order.
  """
  run = run or run_one
  rounds = {impl: [] for impl in impls}
  for r in range(repeat):
    start = r % len(impls)
    for impl in impls[start:] + impls[:start]:
      rounds[impl].append(run(cfg, impl))
  row = {}
  for impl, results in rounds.items():
    failed = [res for res in results if "error" in res]
    if repeat == 1 or failed:
      row[impl] = (failed or results)[0]
    else:
      row[impl] = _result(cfg, statistics.median(res["fwd_ms"] for res in results) / 1e3,
                          statistics.median(res["fwdbwd_ms"] for res in results) / 1e3)
  return row


PACKED = dict(B=2, T=8192, N=16, K=4, D=128, docs=8)
# A packed variant's times (ms): one call at a time (_time) and queued back to
# back (_time_back_to_back), forward and forward+backward.
PACKED_TIMES = {"fwd_ms": "fwd, one call at a time", "fwdbwd_ms": "fwd+bwd, one call at a time",
                "fwd_b2b_ms": "fwd, back to back", "fwdbwd_b2b_ms": "fwd+bwd, back to back"}


def packed_segment_ids(batch: int, seq_len: int, docs: int):
  """Segment ids [batch, seq_len] (int32) packing each sequence with `docs`
  documents of seq_len / docs tokens, one after another."""
  ids = jnp.arange(seq_len, dtype=jnp.int32) // (seq_len // docs)
  return jnp.broadcast_to(ids, (batch, seq_len))


def run_packed(cfg, variant):
  """(fwd ms, fwd+bwd ms) of one packed-sequence variant: "cuda packed" (segment
  ids), "cuda dense" (causal, no ids) or "cudnn mask" (the ids as a boolean
  mask [B, 1, T, T], passed as a jit argument)."""
  b, t, n, kh, d = cfg["B"], cfg["T"], cfg["N"], cfg["K"], cfg["D"]
  k0, k1, k2 = jax.random.split(jax.random.PRNGKey(0), 3)
  q = jax.random.normal(k0, (b, t, n, d), jnp.bfloat16)
  k = jax.random.normal(k1, (b, t, kh, d), jnp.bfloat16)
  v = jax.random.normal(k2, (b, t, kh, d), jnp.bfloat16)
  ids = packed_segment_ids(b, t, cfg["docs"])
  if variant == "cuda packed":
    attn = _attention("cuda")
    call = lambda q, k, v, x: attn(q, k, v, is_causal=True, q_segment_ids=x, kv_segment_ids=x)
    x = ids
  elif variant == "cuda dense":
    attn = _attention("cuda")
    call = lambda q, k, v, x: attn(q, k, v, is_causal=True)
    x = ids
  else:
    attn = _attention("cudnn")
    call = lambda q, k, v, x: attn(q, k, v, is_causal=True, mask=x)
    x = (ids[:, :, None] == ids[:, None, :])[:, None]
  fwd = jax.jit(call)
  fb = jax.jit(jax.grad(lambda q, k, v, x: jnp.sum(call(q, k, v, x).astype(jnp.float32)),
                        argnums=(0, 1, 2)))
  try:
    return dict(fwd_ms=_time(fwd, q, k, v, x) * 1e3, fwdbwd_ms=_time(fb, q, k, v, x) * 1e3,
                fwd_b2b_ms=_time_back_to_back(fwd, q, k, v, x) * 1e3,
                fwdbwd_b2b_ms=_time_back_to_back(fb, q, k, v, x) * 1e3)
  except Exception as e:  # noqa: BLE001 - report and go on
    return dict(error=str(e).splitlines()[0][:120])


def packed_rows(repeat=1, run=None):
  """{variant: {fwd_ms, fwdbwd_ms}} for PACKED, medians over `repeat` rounds
  with the variants' order rotated."""
  run = run or run_packed
  variants = ["cuda packed", "cuda dense", "cudnn mask"]
  rounds = {v: [] for v in variants}
  for r in range(repeat):
    for variant in variants[r % 3:] + variants[:r % 3]:
      rounds[variant].append(run(PACKED, variant))
  out = {}
  for variant, results in rounds.items():
    failed = [res for res in results if "error" in res]
    out[variant] = failed[0] if failed else {
        key: statistics.median(res[key] for res in results) for key in PACKED_TIMES
        if all(key in res for res in results)}
  return out


def print_packed(rows) -> None:
  c = PACKED
  print(f"packed: B={c['B']} T={c['T']} ({c['docs']} documents of {c['T'] // c['docs']}), "
        f"causal, D={c['D']}, heads {c['N']}:{c['K']}, bf16; ms")
  print("| pass | cuda packed | cuda dense causal | cudnn + mask | dense / packed | "
        "cudnn / packed |")
  print("|---|---|---|---|---|---|")
  for key, name in PACKED_TIMES.items():
    if not any(key in r for r in rows.values()):
      continue
    cell = lambda v: f"{rows[v][key]:.3f}" if key in rows[v] else "err"
    ratio = lambda v: (f"{rows[v][key] / rows['cuda packed'][key]:.2f}"
                       if key in rows[v] and key in rows["cuda packed"] else "-")
    print(f"| {name} | {cell('cuda packed')} | {cell('cuda dense')} | {cell('cudnn mask')} | "
          f"{ratio('cuda dense')} | {ratio('cudnn mask')} |")
  for variant, r in rows.items():
    if "error" in r:
      print(f"<!-- {variant}: {r['error']} -->")


def _extras(cfg) -> str:
  """The table's "extra" cell: mask, bias, window, a dtype other than bf16."""
  parts = [cfg["extra"]] if cfg.get("extra") else []
  if cfg.get("window"): parts.append("window {}".format(cfg["window"][0]))
  if cfg.get("dtype", "bfloat16") != "bfloat16": parts.append(cfg["dtype"])
  return ", ".join(parts)


def plot_ratios(results, path: str) -> None:
  """A bar chart of ours / cuDNN per row (forward and forward+backward), with
  the 1.0 line, written to `path` (needs matplotlib, in the demo extra)."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  labels, fwd, fb = [], [], []
  for r in results:
    ours, cudnn = r.get("cuda", {}), r.get("cudnn", {})
    ratio = lambda key: ours[key] / cudnn[key] if key in ours and key in cudnn else 0.0
    labels.append(row_label(r))
    fwd.append(ratio("fwd_tflops"))
    fb.append(ratio("fwdbwd_tflops"))
  fig, ax = plt.subplots(figsize=(10, 0.28 * len(labels) + 1.5))
  y = range(len(labels))
  ax.barh([i - 0.2 for i in y], fwd, height=0.4, label="forward")
  ax.barh([i + 0.2 for i in y], fb, height=0.4, label="forward+backward")
  ax.axvline(1.0, color="k", lw=0.8)
  ax.set_yticks(list(y), labels, fontsize=7)
  ax.invert_yaxis()
  ax.set_xlabel("jax_fatrain cuda / cuDNN (TFLOP/s ratio; > 1 is faster)")
  ax.set_title(f"{jax.devices()[0].device_kind}, jax {jax.__version__}")
  ax.legend(loc="best")
  fig.tight_layout()
  fig.savefig(path, dpi=120)


def cuda_unavailable_reason() -> str | None:
  """Why this process cannot benchmark our ``cuda`` kernels, or None."""
  from jax_fatrain import _registry
  try:
    _registry.resolve_implementation("cuda")
  except ValueError as e:
    return str(e)
  if jax.default_backend() != "gpu":
    return f"JAX's default backend is {jax.default_backend()!r}, not a GPU"
  return None


def main(argv=None):
  ap = argparse.ArgumentParser(prog="python -m jax_fatrain.benchmark --cuda",
                               description=__doc__.splitlines()[0])
  ap.add_argument("--quick", action="store_true", help="a few representative rows")
  ap.add_argument("--masked-only", action="store_true",
                  help="only the boolean-mask and additive-bias rows")
  ap.add_argument("--no-xla", action="store_true", help="skip the slow XLA reference")
  ap.add_argument("--part", default="1/1",
                  help="K/N: run only the K-th of N equal slices of the rows (to split a "
                       "run across several time-limited processes)")
  ap.add_argument("--repeat", type=int, default=1,
                  help="measure each row in N rounds, the implementations' order rotated, "
                       "and report the medians (steadier tables; N x the time)")
  ap.add_argument("--json", help="also write the raw rows here")
  ap.add_argument("--plot", help="also write a PNG of the ours/cuDNN ratios here")
  ap.add_argument("--packed", action="store_true",
                  help="packed sequences instead: ours with segment ids vs ours dense "
                       "causal vs cuDNN with the materialised mask (see the module doc)")
  args = ap.parse_args(argv)
  if args.repeat < 1:
    ap.error(f"--repeat must be at least 1, got {args.repeat}")
  # Fail before the first row: without our kernels every row would time only
  # the references and print "err" for ours.
  why = cuda_unavailable_reason()
  if why is not None:
    print(f"benchmark --cuda: cannot run: {why}", file=sys.stderr)
    return 2
  print(f"# {jax.devices()[0].device_kind}, jax {jax.__version__}", flush=True)
  if args.packed:
    rows = packed_rows(args.repeat)
    print_packed(rows)
    if args.json:
      with open(args.json, "w") as f:
        json.dump(dict(PACKED, **rows), f, indent=1)
    return 0
  impls = ("cuda", "cudnn") + (() if args.no_xla else ("xla",))
  results = []
  header = ("| B | N:K | T | D | causal | extra | cuda fwd | cudnn fwd | xla fwd | "
            "cuda f+b | cudnn f+b | xla f+b | fwd ratio | f+b ratio |")
  print(header)
  print("|" + "---|" * 14)
  fmt = lambda r, key: (f"{r[key]:.0f}" if r and key in r else
                        ("err" if r and "error" in r else "-"))
  part, parts = (int(x) for x in args.part.split("/"))
  if not 1 <= part <= parts:
    ap.error(f"--part must be K/N with 1 <= K <= N, got {args.part}")
  rows = configs(args.quick, args.masked_only)
  per = -(-len(rows) // parts)
  for cfg in rows[(part - 1) * per:part * per]:
    row = measure_row(cfg, impls, args.repeat)
    results.append(dict(cfg, **row))
    ours, cudnn = row["cuda"], row["cudnn"]
    ratio = lambda key: (f"{ours[key] / cudnn[key]:.2f}"
                         if key in ours and key in cudnn else "-")
    xla = row.get("xla")
    print(f"| {cfg['B']} | {cfg['N']}:{cfg['K']} | {cfg['T']} | {cfg['D']} | "
          f"{'yes' if cfg['causal'] else 'no'} | {_extras(cfg)} | "
          f"{fmt(ours, 'fwd_tflops')} | {fmt(cudnn, 'fwd_tflops')} | {fmt(xla, 'fwd_tflops')} | "
          f"{fmt(ours, 'fwdbwd_tflops')} | {fmt(cudnn, 'fwdbwd_tflops')} | "
          f"{fmt(xla, 'fwdbwd_tflops')} | {ratio('fwd_tflops')} | {ratio('fwdbwd_tflops')} |",
          flush=True)
    for impl, r in row.items():
      if "error" in r:
        print(f"<!-- {impl}: {r['error']} -->", flush=True)
  print("\nTFLOP/s (FlashAttention convention: fwd 4·B·N·T·S·D, /2 causal, the pairs inside "
        "a window; f+b 3.5x fwd); ratio = cuda / cudnn.")
  if args.json:
    with open(args.json, "w") as f:
      json.dump(results, f, indent=1)
  if args.plot:
    plot_ratios(results, args.plot)
    print(f"plot: {args.plot}")


if __name__ == "__main__":
  sys.exit(main())
