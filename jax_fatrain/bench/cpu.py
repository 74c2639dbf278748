"""Side-by-side CPU attention benchmark: jax_fatrain vs XLA vs PyTorch.

Run ``python -m jax_fatrain.benchmark`` (``--quick`` for a < 1 minute subset,
``--help`` for every flag). In one process it times

* ``ours``: ``jax_fatrain.dot_product_attention(..., implementation="cpu")``,
* ``xla``: ``jax.nn.dot_product_attention(..., implementation="xla")``,
* ``torch``: ``torch.nn.functional.scaled_dot_product_attention`` (PyTorch's CPU flash
  attention), when ``import torch`` works,
* ``mlx``: MLX's ``mx.fast.scaled_dot_product_attention`` on the Apple GPU, when
  ``import mlx.core`` works (a Mac; its backward is MLX's VJP of that op),

for the forward pass and for forward + backward (a jit-compiled ``jax.value_and_grad``
of ``sum(out * cotangent)`` with respect to q, k and v; in PyTorch
``out.backward(cotangent)``), with T = S, causal masks aligned top-left in all three.

Timing: JAX functions are compiled ahead of time (never timed); the first call is an
untimed warm-up unless it took a second or more, in which case it counts as a sample;
then calls are timed until there are at least ``--repeats`` samples (more, up to 50,
while they add up to less than 0.3 s) and the median is reported. Order: each round
measures every cell of the implementations other than XLA, the one measured first
rotating from cell to cell and from round to round, and XLA's cells after all of
them (XLA's large allocations slow the runs of whatever comes next); with
``--rounds R`` the grid is measured R times and each cell reports its median, and
``--json`` keeps every round, so the spread of a ratio across rounds shows the noise.
The run also measures this machine's float32 FMA peak (a vector FMA loop on every
core, from the cpu extension) and, where our bfloat16 products run on ``vdpbf16ps``
(``cpu_isa()`` = ``avx512_bf16``), its bf16 dot-product peak (the same loop on that
instruction, 4 FLOPs a lane), or where they run on AMX tiles (``avx512_amx``) its
AMX bf16 peak (a loop of ``TDPBF16PS`` on tiles held in the tile registers), each
before and after the grid (the larger reading counts), and reports our share of
the peak of the instructions that run each row: bfloat16 rows against the bf16
dot-product or AMX peak where they run on it (on AMX: the forward, and the
backward at head dims that are multiples of 32), every other row against the FMA
peak. The full default
grid (72 rows) is long on a small machine: on 2 cores expect 15 minutes or more,
most of it in the T=4096 rows, where XLA is the slowest (``--xla-max-seq-len 2048``
skips XLA's cells there; ``--seq-lens``/``--head-dims``/``--dtypes`` narrow the grid).
GFLOP/s follow the FlashAttention convention: forward = 4·B·N·T·S·D flops, halved
when causal; forward + backward = 3.5 × forward.

Peak memory (``--memory``, off by default because it costs a process start per
cell) is measured per implementation and configuration in a
fresh subprocess (``python -m jax_fatrain.benchmark --_single ...``) that imports,
creates the inputs and compiles, then records a baseline and runs the call once;
the figure is the growth of the process' peak resident set size over that baseline.
See :func:`_single` for the details.

``--packed`` runs something else: packed sequences (``--packed-docs`` documents of
T / docs tokens each, segment ids, causal, GQA ``--heads`` : ``--kv-heads``), ours
with segment ids against ours on the same shape with dense causal attention
(:func:`packed_main`; defaults T=8192, 8 documents, D=128, 8:2 heads, f32).

``--metal-model`` runs something else: our Metal kernels and MLX's steel attention
forward through the MSL emulator with cost counters, and a cost model of named
Apple GPUs over those counters, calibrated on published MLX timings
(:mod:`jax_fatrain.bench.metal`); with
``--packed``, our Metal kernels on a packed causal sequence (segment ids) against
our dense causal call on the same shape, counted and modelled the same way.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import gc
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from typing import Any, Callable, Sequence

import numpy as np

IMPLS = ("ours", "xla", "torch", "mlx")
# What "ours" means: jax_fatrain.dot_product_attention(..., implementation=this).
# Set from --ours-implementation (and passed on to the memory subprocesses).
OURS_IMPLEMENTATION = "cpu"
MODES = ("fwd", "fwd+bwd")


@dataclasses.dataclass(frozen=True)
class Case:
  """One benchmark configuration (without the implementation)."""

  T: int
  D: int
  causal: bool
  dtype: str  # "float32" or "bfloat16"
  mode: str  # "fwd" or "fwd+bwd"
  B: int = 1
  N: int = 8
  KH: int = 0  # kv heads (GQA); 0: N

  @property
  def S(self) -> int:
    return self.T

  @property
  def kv_heads(self) -> int:
    return self.KH or self.N

  @property
  def flops(self) -> float:
    f = 4.0 * self.B * self.N * self.T * self.S * self.D
    if self.causal:
      f /= 2
    if self.mode == "fwd+bwd":
      f *= 3.5
    return f

  def label(self) -> str:
    gqa = f" GQA {self.N}:{self.kv_heads}" if self.kv_heads != self.N else ""
    return (f"T={self.T} D={self.D}{gqa} {'causal' if self.causal else 'full'} "
            f"{self.dtype} {self.mode}")


# ---------------------------------------------------------------------------
# Inputs and callables
# ---------------------------------------------------------------------------


def _numpy_inputs(case: Case, seed: int = 0):
  """q, k, v, cotangent as float32 numpy arrays in BTNH layout."""
  rng = np.random.default_rng(seed)
  q_shape = (case.B, case.T, case.N, case.D)
  kv_shape = (case.B, case.S, case.kv_heads, case.D)
  return [rng.standard_normal(shape, dtype=np.float32)
          for shape in (q_shape, kv_shape, kv_shape, q_shape)]


def _jax_attention(impl: str) -> Callable:
  import jax  # pylint: disable=import-outside-toplevel
  if impl == "ours":
    import jax_fatrain  # pylint: disable=import-outside-toplevel
    return lambda q, k, v, causal: jax_fatrain.dot_product_attention(
        q, k, v, is_causal=causal, implementation=OURS_IMPLEMENTATION)
  if impl == "xla":
    return lambda q, k, v, causal: jax.nn.dot_product_attention(
        q, k, v, is_causal=causal, implementation="xla")
  raise ValueError(impl)


def _compile_once(fn, args):
  """(call, compile_only) for a jitted fn: compile_only() lowers and compiles
  it for args once; call(*a) runs the compiled executable and blocks."""
  import jax

  compiled = []

  def compile_only():
    if not compiled:
      compiled.append(fn.lower(*args).compile())

  def call(*a):
    compile_only()
    return jax.block_until_ready(compiled[0](*a))

  return call, compile_only


def _make_jax(impl: str, case: Case, seed: int = 0):
  """Returns (call, args, to_numpy): ``call(*args)`` runs once and blocks."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  dtype = jnp.dtype(case.dtype)
  q, k, v, ct = (jnp.asarray(x, dtype=dtype) for x in _numpy_inputs(case, seed))
  attn = _jax_attention(impl)
  if case.mode == "fwd":
    fn = jax.jit(lambda q, k, v: attn(q, k, v, case.causal))
    args = (q, k, v)
    to_numpy = lambda out: np.asarray(out.astype(jnp.float32))
  else:
    def loss(q, k, v, ct):
      return jnp.sum(attn(q, k, v, case.causal).astype(jnp.float32) * ct.astype(jnp.float32))
    fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
    args = (q, k, v, ct)
    to_numpy = None

  call, compile_only = _compile_once(fn, args)
  return call, args, to_numpy, compile_only


def _make_torch(case: Case, seed: int = 0):
  import torch  # pylint: disable=import-outside-toplevel
  import torch.nn.functional as F  # pylint: disable=import-outside-toplevel
  torch.set_num_threads(cpu_threads())
  dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[case.dtype]
  # BTNH numpy -> BNTH torch (contiguous).
  q, k, v, ct = (torch.from_numpy(x).transpose(1, 2).contiguous().to(dtype)
                 for x in _numpy_inputs(case, seed))
  gqa = {"enable_gqa": True} if case.kv_heads != case.N else {}
  if case.mode == "fwd":
    def call(q, k, v):
      with torch.no_grad():
        return F.scaled_dot_product_attention(q, k, v, is_causal=case.causal, **gqa)
    args = (q, k, v)
    to_numpy = lambda out: out.transpose(1, 2).float().numpy()
  else:
    q, k, v = (x.requires_grad_() for x in (q, k, v))

    def call(q, k, v, ct):
      for x in (q, k, v):
        x.grad = None
      out = F.scaled_dot_product_attention(q, k, v, is_causal=case.causal, **gqa)
      out.backward(ct)
      return q.grad, k.grad, v.grad
    args = (q, k, v, ct)
    to_numpy = None
  return call, args, to_numpy, lambda: None


def _make_mlx(case: Case, seed: int = 0):
  import mlx.core as mx  # pylint: disable=import-outside-toplevel
  dtype = {"float32": mx.float32, "bfloat16": mx.bfloat16}[case.dtype]
  # BTNH numpy -> BNTH mlx.
  q, k, v, ct = (mx.array(x.transpose(0, 2, 1, 3)).astype(dtype)
                 for x in _numpy_inputs(case, seed))
  mask = "causal" if case.causal else None
  scale = 1.0 / float(np.sqrt(case.D))

  def attn(q, k, v):
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)

  if case.mode == "fwd":
    fn = mx.compile(attn)
    args = (q, k, v)
    to_numpy = lambda out: np.array(out.astype(mx.float32)).transpose(0, 2, 1, 3)
  else:
    def loss(q, k, v, ct):
      return mx.sum(attn(q, k, v).astype(mx.float32) * ct.astype(mx.float32))
    fn = mx.compile(mx.value_and_grad(loss, argnums=(0, 1, 2)))
    args = (q, k, v, ct)
    to_numpy = None

  def call(*a):
    out = fn(*a)
    mx.eval(out)
    return out

  return call, args, to_numpy, lambda: None


def make_runner(impl: str, case: Case, seed: int = 0):
  if impl == "torch":
    return _make_torch(case, seed)
  if impl == "mlx":
    return _make_mlx(case, seed)
  return _make_jax(impl, case, seed)


# ---------------------------------------------------------------------------
# Availability
# ---------------------------------------------------------------------------


def available_impls() -> dict[str, str | None]:
  """Maps each implementation to None when usable, else to the reason it is not."""
  status: dict[str, str | None] = {"xla": None}
  try:
    import jax_fatrain  # pylint: disable=import-outside-toplevel
    avail = getattr(jax_fatrain, "available_implementations", None)
    if not hasattr(jax_fatrain, "dot_product_attention"):
      status["ours"] = "jax_fatrain has no dot_product_attention"
    elif callable(avail) and OURS_IMPLEMENTATION not in avail():
      status["ours"] = (f"implementation {OURS_IMPLEMENTATION!r} not available "
                        f"(available: {', '.join(avail())})")
    else:
      status["ours"] = None
  except Exception as e:  # pylint: disable=broad-except
    status["ours"] = f"import jax_fatrain failed: {type(e).__name__}: {e}"
  try:
    import torch  # pylint: disable=import-outside-toplevel,unused-import
    status["torch"] = None
  except Exception as e:  # pylint: disable=broad-except
    status["torch"] = f"import torch failed: {type(e).__name__}: {e}"
  try:
    import mlx.core  # pylint: disable=import-outside-toplevel,unused-import
    status["mlx"] = None
  except Exception as e:  # pylint: disable=broad-except
    status["mlx"] = f"import mlx.core failed: {type(e).__name__}: {e}"
  return status


# ---------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------


@dataclasses.dataclass
class Measurement:
  seconds: float | None = None
  error: str | None = None
  skipped: str | None = None
  peak_mb: float | None = None
  mem_error: str | None = None
  output: Any = None


def time_call(call: Callable, args: tuple, repeats: int, min_total: float = 0.3,
              max_repeats: int = 50) -> tuple[float, Any]:
  """Median seconds of ``call(*args)`` (already compiled) and its last output.

  The first call is a warm-up, except that a call of a second or more counts as a
  sample (a warm-up matters little there, and skipping it saves much time).
  """
  t0 = time.perf_counter()
  out = call(*args)
  first = time.perf_counter() - t0
  times: list[float] = [first] if first >= 1.0 else []
  while len(times) < repeats or (sum(times) < min_total and len(times) < max_repeats):
    del out
    t0 = time.perf_counter()
    out = call(*args)
    times.append(time.perf_counter() - t0)
  return statistics.median(times), out


def measure(impl: str, case: Case, repeats: int) -> Measurement:
  try:
    call, args, to_numpy, compile_only = make_runner(impl, case)
    compile_only()  # JAX: ahead-of-time compilation, never timed
    seconds, out = time_call(call, args, repeats)
    output = to_numpy(out) if to_numpy is not None else None
    del out, args, call
    gc.collect()
    return Measurement(seconds=seconds, output=output)
  except Exception as e:  # pylint: disable=broad-except
    return Measurement(error=f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")


# ---------------------------------------------------------------------------
# Memory: one fresh subprocess per (implementation, case)
# ---------------------------------------------------------------------------


def _rss_kib(field: str) -> int | None:
  try:
    with open("/proc/self/status", encoding="ascii") as f:
      for line in f:
        if line.startswith(field + ":"):
          return int(line.split()[1])
  except OSError:
    pass
  return None


def _maxrss_kib() -> float:
  r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
  return r / 1024 if sys.platform == "darwin" else r  # macOS reports bytes


def _single(spec: dict) -> dict:
  """Measures one call's peak memory in this (fresh) process.

  After the imports, the inputs, (for JAX) the ahead-of-time compilation and one
  warm-up call whose results are freed, the baseline is taken. The parent starts this
  process with ``MALLOC_MMAP_THRESHOLD_`` set, so that glibc serves large buffers with
  ``mmap`` and returns them to the system when freed (instead of raising its threshold
  and keeping them resident after the warm-up). On Linux the kernel's peak-RSS counter is first reset by writing
  ``5`` to ``/proc/self/clear_refs``, so the baseline is the current RSS and the peak
  is ``VmHWM`` after the call: compilation does not count. Where that is not possible
  the baseline and the peak are both ``getrusage(RUSAGE_SELF).ru_maxrss``, so a
  compile-time peak larger than the call's would hide the call's.
  """
  impl = spec.pop("impl")
  case = Case(**spec)
  call, args, _, compile_only = make_runner(impl, case)
  compile_only()
  warm = call(*args)  # warm-up: one-time runtime set-up is not the call's cost
  del warm
  for x in args:  # torch keeps the warm-up's gradients on the inputs: free them too
    if getattr(x, "grad", None) is not None:
      x.grad = None
  gc.collect()
  method = "ru_maxrss"
  try:
    with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
      f.write("5")
    base = _rss_kib("VmRSS")
    if base is not None and _rss_kib("VmHWM") is not None:
      method = "VmHWM"
  except OSError:
    pass
  if method == "ru_maxrss":
    base = _maxrss_kib()
  out = call(*args)
  peak = _rss_kib("VmHWM") if method == "VmHWM" else _maxrss_kib()
  del out
  return {"peak_mb": max(0.0, (peak - base) / 1024), "method": method}


def measure_memory(impl: str, case: Case, timeout: float = 900) -> tuple[float | None, str | None]:
  spec = dict(dataclasses.asdict(case), impl=impl)
  cmd = [sys.executable, "-m", "jax_fatrain.benchmark", "--_single", json.dumps(spec),
         "--ours-implementation", OURS_IMPLEMENTATION]
  try:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                          check=False, env=env)
  except subprocess.TimeoutExpired:
    return None, "timeout"
  for line in reversed(proc.stdout.splitlines()):
    if line.startswith("{"):
      return json.loads(line)["peak_mb"], None
  err = (proc.stderr.strip().splitlines() or ["no output"])[-1]
  return None, f"rc={proc.returncode}: {err}"


# ---------------------------------------------------------------------------
# Reporting
# ---------------------------------------------------------------------------


def _fmt_ms(m: Measurement | None) -> str:
  if m is None:
    return "-"
  if m.skipped:
    return "skip"
  if m.error:
    return "err"
  return f"{m.seconds * 1e3:.2f}"


def _fmt_gflops(case: Case, m: Measurement | None) -> str:
  if m is None or m.seconds is None:
    return "-"
  return f"{case.flops / m.seconds / 1e9:.1f}"


def _fmt_ratio(num: Measurement | None, den: Measurement | None) -> str:
  if num is None or den is None or num.seconds is None or den.seconds is None:
    return "-"
  return f"{num.seconds / den.seconds:.2f}x"


def _fmt_mem(m: Measurement | None) -> str:
  if m is None or m.seconds is None and m.peak_mb is None:
    return "-"
  if m.mem_error:
    return "err"
  return "-" if m.peak_mb is None else f"{m.peak_mb:.0f}"


def _rel_err(a, b) -> str:
  if a is None or b is None:
    return "-"
  a = np.asarray(a, np.float64)
  b = np.asarray(b, np.float64)
  return f"{np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30):.1e}"


def row_peak(case: Case, peaks: dict[str, float | None]) -> tuple[str, float | None]:
  """The peak our kernels' products can reach on this row: ("bf16 AMX", GFLOP/s) for
  bfloat16 rows that run on AMX tiles (the forward; the backward where D is a
  multiple of 32), ("bf16 dot", GFLOP/s) for bfloat16 rows where they run on
  vdpbf16ps, else ("f32 FMA", GFLOP/s)."""
  if (case.dtype == "bfloat16" and peaks.get("bf16 AMX")
      and (case.mode == "fwd" or case.D % 32 == 0)):
    return "bf16 AMX", peaks["bf16 AMX"]
  if case.dtype == "bfloat16" and peaks.get("bf16 dot"):
    return "bf16 dot", peaks["bf16 dot"]
  return "f32 FMA", peaks.get("f32 FMA")


def build_rows(cases: Sequence[Case], impls: Sequence[str],
               results: dict[tuple[Case, str], Measurement], memory: bool,
               peaks: dict[str, float | None] | None = None):
  peaks = peaks or {}
  show_peak = bool(peaks.get("f32 FMA")) and "ours" in impls
  header = ["T", "D", "causal", "dtype", "pass"]
  header += [f"{i} ms" for i in impls]
  header += [f"{i} GFLOP/s" for i in impls]
  if show_peak:
    header.append("ours % of peak")
    if peaks.get("bf16 dot") or peaks.get("bf16 AMX"):
      header.append("peak")
  others = [i for i in impls if i != "ours"] if "ours" in impls else []
  header += [f"{o}/ours" for o in others]
  if memory:
    header += [f"{i} MB" for i in impls]
  if "ours" in impls and len(others):
    header.append("err vs " + others[0])
  rows = []
  for c in cases:
    ms = {i: results.get((c, i)) for i in impls}
    row = [str(c.T), str(c.D), "yes" if c.causal else "no", c.dtype, c.mode]
    row += [_fmt_ms(ms[i]) for i in impls]
    row += [_fmt_gflops(c, ms[i]) for i in impls]
    if show_peak:
      m = ms["ours"]
      name, peak = row_peak(c, peaks)
      row.append("-" if m is None or m.seconds is None else f"{100 * c.flops / m.seconds / 1e9 / peak:.0f}%")
      if peaks.get("bf16 dot") or peaks.get("bf16 AMX"):
        row.append(name)
    row += [_fmt_ratio(ms[o], ms["ours"]) for o in others]
    if memory:
      row += [_fmt_mem(ms[i]) for i in impls]
    if "ours" in impls and len(others):
      a, b = ms["ours"], ms[others[0]]
      row.append(_rel_err(a.output if a else None, b.output if b else None))
    rows.append(row)
  return header, rows


def format_table(header, rows, markdown: bool) -> str:
  if markdown:
    lines = ["| " + " | ".join(header) + " |",
             "|" + "|".join("---:" if i not in (2, 3, 4) else ":---"
                            for i in range(len(header))) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)
  widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
  fmt = lambda cells: "  ".join(c.rjust(w) for c, w in zip(cells, widths))
  return "\n".join([fmt(header), fmt(["-" * w for w in widths])] + [fmt(r) for r in rows])


def describe_environment(impls: Sequence[str], status: dict[str, str | None]) -> list[str]:
  import jax  # pylint: disable=import-outside-toplevel
  lines = [f"python {platform.python_version()}, {platform.machine()}, "
           f"os.cpu_count()={os.cpu_count()}, {cpu_threads()} usable by this process",
           f"jax {jax.__version__}, timed on {jax.devices('cpu')[0]} "
           f"(default backend {jax.default_backend()})"]
  if status.get("ours") is None:
    import jax_fatrain  # pylint: disable=import-outside-toplevel
    isa = getattr(jax_fatrain, "cpu_isa", None)
    version = getattr(jax_fatrain, "__version__", "?")
    try:
      isa = isa() if callable(isa) else None
    except Exception as e:  # pylint: disable=broad-except
      isa = f"unknown ({type(e).__name__})"
    lines.append(f"jax_fatrain {version}, ours = implementation={OURS_IMPLEMENTATION!r}"
                 + (f", cpu_isa={isa}" if isa else ""))
  if status.get("torch") is None:
    import torch  # pylint: disable=import-outside-toplevel
    lines.append(f"torch {torch.__version__}, torch.set_num_threads({cpu_threads()})")
  if status.get("mlx") is None:
    import mlx.core as mx  # pylint: disable=import-outside-toplevel
    lines.append(f"mlx {mx.__version__} (device {mx.default_device()})")
  try:
    load = os.getloadavg()[0]
    if load > 0.5 * (os.cpu_count() or 1):
      lines.append(f"WARNING: load average {load:.1f} on {os.cpu_count()} CPUs: "
                   "other processes are running, timings will be noisy")
  except OSError:
    pass
  for impl in IMPLS:
    if impl not in impls and status.get(impl):
      lines.append(f"{impl}: unavailable ({status[impl]})")
  return lines


# ---------------------------------------------------------------------------
# Packed sequences (--packed)
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class PackedCase:
  """Causal attention over a pack of ``docs`` documents of T / docs tokens."""

  T: int
  D: int
  N: int
  K: int
  docs: int
  dtype: str
  mode: str
  B: int = 1


def _make_packed(case: PackedCase, packed: bool, implementation: str, seed: int = 0):
  """(call, args, compile_only) for ours with (packed) or without segment ids."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import jax_fatrain  # pylint: disable=import-outside-toplevel
  rng = np.random.default_rng(seed)
  dtype = jnp.dtype(case.dtype)
  q, ct = (jnp.asarray(rng.standard_normal((case.B, case.T, case.N, case.D), np.float32),
                       dtype) for _ in range(2))
  k, v = (jnp.asarray(rng.standard_normal((case.B, case.T, case.K, case.D), np.float32),
                      dtype) for _ in range(2))
  ids = jnp.asarray(np.repeat(np.arange(case.docs, dtype=np.int32), -(-case.T // case.docs))
                    [None, :case.T].repeat(case.B, 0))
  segments = dict(q_segment_ids=ids, kv_segment_ids=ids) if packed else {}

  def attn(q, k, v):
    return jax_fatrain.dot_product_attention(q, k, v, is_causal=True,
                                             implementation=implementation, **segments)

  if case.mode == "fwd":
    fn, args = jax.jit(attn), (q, k, v)
  else:
    def loss(q, k, v, ct):
      return jnp.sum(attn(q, k, v).astype(jnp.float32) * ct.astype(jnp.float32))
    fn, args = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))), (q, k, v, ct)
  call, compile_only = _compile_once(fn, args)
  return call, args, compile_only


def packed_main(args) -> dict[str, Any]:
  """Ours with segment ids against ours dense causal on one packed shape."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax_fatrain  # pylint: disable=import-outside-toplevel
  impl = args.ours_implementation
  t, d = args.seq_lens[0], args.head_dims[0]
  print(f"python {platform.python_version()}, {platform.machine()}, "
        f"os.cpu_count()={os.cpu_count()}; jax {jax.__version__}; "
        f"ours = implementation={impl!r}, cpu_isa={jax_fatrain.cpu_isa()}")
  print(f"packed: B={args.batch} T=S={t}, {args.packed_docs} documents of "
        f"{t // args.packed_docs} tokens, causal, D={d}, heads {args.heads}:{args.kv_heads}; "
        f"'dense' = the same call without segment ids (causal over all T tokens); "
        f"medians of >= {args.repeats} timed calls, in ms")
  rows, results = [], {}
  for dtype in args.dtypes:
    for mode in (["fwd"] if args.fwd_only else list(MODES)):
      case = PackedCase(T=t, D=d, N=args.heads, K=args.kv_heads, docs=args.packed_docs,
                        dtype=dtype, mode=mode, B=args.batch)
      ms = {}
      for name, packed in (("dense", False), ("packed", True)):
        call, cargs, compile_only = _make_packed(case, packed, impl)
        compile_only()
        ms[name], _ = time_call(call, cargs, args.repeats)
        del call, cargs
        gc.collect()
        print(f"{dtype} {mode} {name}: {ms[name] * 1e3:.1f} ms", file=sys.stderr, flush=True)
      results[(dtype, mode)] = ms
      rows.append([str(t), str(d), f"{args.heads}:{args.kv_heads}", str(args.packed_docs),
                   dtype, mode, f"{ms['dense'] * 1e3:.1f}", f"{ms['packed'] * 1e3:.1f}",
                   f"{ms['dense'] / ms['packed']:.2f}x"])
  header = ["T", "D", "heads", "docs", "dtype", "pass", "dense causal ms", "packed ms",
            "dense/packed"]
  print()
  print(format_table(header, rows, args.markdown))
  return {"header": header, "rows": rows, "results": results}


# ---------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------


def _int_list(s: str) -> list[int]:
  return [int(x) for x in s.split(",") if x]


def _dtype_list(s: str) -> list[str]:
  names = {"f32": "float32", "float32": "float32", "bf16": "bfloat16",
           "bfloat16": "bfloat16"}
  out = []
  for x in s.split(","):
    if x not in names:
      raise argparse.ArgumentTypeError(f"unknown dtype {x!r} (use f32, bf16)")
    out.append(names[x])
  return out


def _impl_list(s: str) -> list[str]:
  out = [x for x in s.split(",") if x]
  bad = [x for x in out if x not in IMPLS]
  if bad:
    raise argparse.ArgumentTypeError(f"unknown implementation(s) {bad}; choose from {IMPLS}")
  return out


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
  p = argparse.ArgumentParser(
      prog="python -m jax_fatrain.benchmark",
      description="Time jax_fatrain's CPU attention against XLA and PyTorch.",
      epilog="python -m jax_fatrain.benchmark --cuda [--help]: the NVIDIA GPU benchmark "
      "(ours against cuDNN and XLA), with flags of its own.")
  p.add_argument("--quick", action="store_true",
                 help="small subset (T=512, D=64, causal on and off, f32), < 1 minute")
  p.add_argument("--seq-lens", type=_int_list, default=None, help="default 512,2048,4096")
  p.add_argument("--head-dims", type=_int_list, default=None, help="default 64,128,256")
  p.add_argument("--dtypes", type=_dtype_list, default=None, help="default f32,bf16")
  p.add_argument("--causal", choices=("on", "off", "both"), default="both")
  p.add_argument("--impls", type=_impl_list, default=list(IMPLS),
                 help="comma-separated subset of ours,xla,torch (default all available)")
  p.add_argument("--ours-implementation", choices=("cpu", "xla", "metal"), default="cpu",
                 help="implementation= given to jax_fatrain.dot_product_attention for "
                 "the 'ours' column (default cpu)")
  p.add_argument("--batch", type=int, default=1)
  p.add_argument("--heads", type=int, default=None, help="default 8 (--metal-model: 1)")
  p.add_argument("--kv-heads", type=int, default=None,
                 help="key/value heads (GQA when fewer than --heads; default --heads, "
                 "with --packed heads / 4)")
  p.add_argument("--repeats", type=int, default=3, help="timed calls per cell (min 3)")
  p.add_argument("--rounds", type=int, default=1,
                 help="measure the whole grid this many times and report each cell's median "
                 "(the JSON keeps every round; ratios' spread across rounds shows noise)")
  p.add_argument("--fwd-only", action="store_true", help="skip forward+backward rows")
  p.add_argument("--markdown", action="store_true", help="print a Markdown table")
  mem = p.add_mutually_exclusive_group()
  mem.add_argument("--memory", dest="memory", action="store_true", default=False,
                   help="also measure peak memory, in one fresh subprocess per "
                   "implementation and row (adds a few seconds per cell; off by default)")
  mem.add_argument("--no-memory", dest="memory", action="store_false")
  p.add_argument("--xla-max-seq-len", type=int, default=None,
                 help="skip XLA cells with T above this (the slowest ones)")
  p.add_argument("--_single", default=None, help=argparse.SUPPRESS)
  pk = p.add_argument_group(
      "--packed", "packed sequences: ours with segment ids vs ours dense causal (defaults: "
      "T=8192, D=128, 8 documents, 8 query and 2 key/value heads, f32)")
  pk.add_argument("--packed", action="store_true",
                  help="run the packed-sequence comparison instead of the CPU timings (with "
                  "--metal-model: our Metal kernels' counters and modelled times, dense "
                  "causal vs packed, default T=8192, D=128)")
  pk.add_argument("--packed-docs", type=int, default=8, help="documents per sequence")
  mm = p.add_argument_group(
      "--metal-model", "count our Metal kernels and MLX's steel attention forward in the MSL "
      "emulator and model their time on Apple GPUs (defaults: T=1024,4096, D=64,128,256, "
      "bf16, one head, impls ours,mlx; a model, not a measurement)")
  mm.add_argument("--metal-model", action="store_true",
                  help="run the emulator comparison instead of the CPU timings")
  p.add_argument("--json", default=None, help="save the records to this JSON file")
  p.add_argument("--plot", default=None, help="save a plot to this file (needs matplotlib)")
  mm.add_argument("--sample", default="8",
                  help="threadgroups run per dispatch: a count (default 8), a fraction "
                  "such as 0.25, or 'all'; counters are scaled to the whole grid")
  mm.add_argument("--calibration", choices=("stored", "fresh"), default="stored",
                  help="counters of the calibration points: stored with the data (default) "
                  "or emulated now (needs MLX's kernels, about a minute)")
  mm.add_argument("--gpus", type=lambda s: [x.strip() for x in s.split(",") if x.strip()],
                  default=None, help="comma-separated GPU names of jax_fatrain.emulator.model "
                  "(default M1,M2 Max,M3 Max,M4 Max)")
  args = p.parse_args(argv)
  if args.metal_model and args.packed:
    args.seq_lens = args.seq_lens or [8192]
    args.head_dims = args.head_dims or [128]
  if args.metal_model:
    args.seq_lens = args.seq_lens or [1024, 4096]
    args.dtypes = args.dtypes or ["bfloat16"]
    args.heads = args.heads or 1
    if args.impls == list(IMPLS):
      args.impls = ["ours", "mlx"]
  args.heads = args.heads or 8
  if args.packed:
    args.seq_lens = args.seq_lens or [8192]
    args.head_dims = args.head_dims or [128]
    args.dtypes = args.dtypes or ["float32"]
    args.kv_heads = args.kv_heads or max(1, args.heads // 4)
  if args.quick:
    args.seq_lens = args.seq_lens or [512]
    args.head_dims = args.head_dims or [64]
    args.dtypes = args.dtypes or ["float32"]
  args.seq_lens = args.seq_lens or [512, 2048, 4096]
  args.head_dims = args.head_dims or [64, 128, 256]
  args.dtypes = args.dtypes or ["float32", "bfloat16"]
  args.repeats = max(3, args.repeats)
  args.rounds = max(1, args.rounds)
  if args.kv_heads is not None and (args.kv_heads < 1 or args.heads % args.kv_heads):
    p.error(f"--kv-heads {args.kv_heads} must divide --heads {args.heads}")
  return args


def cpu_threads() -> int:
  """The CPUs this process may run on (its affinity mask, as XLA's CPU thread pool
  and the peak loops count them), else every CPU."""
  if hasattr(os, "sched_getaffinity"):
    return len(os.sched_getaffinity(0))
  return os.cpu_count() or 1


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  """Runs the benchmark and prints the table; returns ``{"header", "rows", ...}``.

  Everything runs on JAX's CPU device, also where a GPU is JAX's default backend
  (there, ``--cuda`` times the GPU)."""
  import jax  # pylint: disable=import-outside-toplevel
  args = parse_args(argv)
  with jax.default_device(jax.devices("cpu")[0]):
    return _run(args)


def _run(args) -> dict[str, Any]:
  global OURS_IMPLEMENTATION  # pylint: disable=global-statement
  OURS_IMPLEMENTATION = args.ours_implementation
  if args._single is not None:
    print(json.dumps(_single(json.loads(args._single))), flush=True)
    return {}
  if args.packed and not args.metal_model:
    return packed_main(args)
  if args.metal_model:
    from jax_fatrain.bench import metal as metal_benchmark  # pylint: disable=import-outside-toplevel
    try:
      return {"records": metal_benchmark.main(args)}
    except metal_benchmark.Unavailable as e:
      print(f"--metal-model: {e}", file=sys.stderr)
      sys.exit(2)

  status = available_impls()
  impls = [i for i in IMPLS if i in args.impls and status.get(i) is None]
  causal = {"on": [True], "off": [False], "both": [False, True]}[args.causal]
  modes = ["fwd"] if args.fwd_only else list(MODES)
  cases = [Case(T=t, D=d, causal=c, dtype=dt, mode=m, B=args.batch, N=args.heads,
                KH=args.kv_heads or 0)
           for dt in args.dtypes for d in args.head_dims for t in args.seq_lens
           for c in causal for m in modes]

  env = describe_environment(impls, status)
  print("\n".join(env))
  print(f"B={args.batch} N={args.heads} q heads, {args.kv_heads or args.heads} kv heads, "
        "T=S, layout BTNH (torch BNTH), "
        f"causal = top-left; times are medians of >= {args.repeats} timed calls after "
        "warm-up, in ms")
  print("GFLOP/s: fwd = 4*B*N*T*S*D (halved if causal), fwd+bwd = 3.5 x fwd; "
        "'xla/ours' = XLA time / our time (> 1: ours is faster)")
  if args.memory:
    print("peak memory (MB): growth of the peak RSS during one call over a baseline "
          "taken after imports, inputs, compilation and a warm-up call, in one fresh "
          "subprocess per cell (Linux: peak reset via /proc/self/clear_refs, then "
          "VmHWM - VmRSS, glibc MALLOC_MMAP_THRESHOLD_=128K; elsewhere ru_maxrss deltas)")
  else:
    print("peak memory: not measured (off by default; pass --memory to measure it in "
          "one fresh subprocess per cell)")
  if "ours" in impls and len(impls) > 1:
    other = [i for i in impls if i != "ours"][0]
    print(f"err vs {other}: ||ours - {other}|| / ||{other}|| of the forward output "
          "(a sanity check, in the benchmark's dtype)")
  sys.stdout.flush()
  if not impls:
    print("no implementation available")
    return {"header": [], "rows": []}

  # Order: every round measures the cells of all implementations but XLA, the
  # implementation measured first rotating from cell to cell and round to
  # round, then XLA's cells last, so that XLA's large allocations never sit
  # between another implementation's runs (they slow the next runs of the
  # others). Each cell's time is the median over rounds.
  peaks_before = measure_peaks()
  sys.stdout.flush()
  samples: dict[tuple[Case, str], list[Measurement]] = {}
  t_start = time.perf_counter()
  first = [i for i in impls if i != "xla"]
  last = ["xla"] if "xla" in impls else []
  for r in range(args.rounds):
    order = [(n, case, impl) for n, case in enumerate(cases)
             for impl in _rotated(first, n + r)]
    order += [(n, case, "xla") for n, case in enumerate(cases) for _ in last]
    for n, case, impl in order:
      if impl == "xla" and args.xla_max_seq_len and case.T > args.xla_max_seq_len:
        m = Measurement(skipped="T above --xla-max-seq-len")
      else:
        m = measure(impl, case, args.repeats)
      samples.setdefault((case, impl), []).append(m)
      print(f"[round {r + 1}/{args.rounds} {time.perf_counter() - t_start:.0f}s] "
            f"{case.label()}: {impl} {_fmt_ms(m)} ms", file=sys.stderr, flush=True)
  results = {key: _median(ms) for key, ms in samples.items()}

  if args.memory:
    jobs = [(case, impl) for case in cases for impl in impls
            if results[(case, impl)].seconds is not None]
    print(f"measuring peak memory in {len(jobs)} subprocesses...", file=sys.stderr,
          flush=True)
    with concurrent.futures.ThreadPoolExecutor(max(1, min(2, os.cpu_count() or 1))) as ex:
      futures = {ex.submit(measure_memory, impl, case): (case, impl) for case, impl in jobs}
      for fut in concurrent.futures.as_completed(futures):
        m = results[futures[fut]]
        m.peak_mb, m.mem_error = fut.result()

  peaks_after = measure_peaks()
  peaks = {k: max(filter(None, (v, peaks_after.get(k))), default=None)
           for k, v in peaks_before.items()}
  print(describe_peaks(peaks))
  peak = peaks["f32 FMA"]
  header, rows = build_rows(cases, impls, results, args.memory, peaks)
  print()
  print(format_table(header, rows, args.markdown))
  errors = [f"  {impl} {case.label()}: {m.error or m.mem_error}"
            for (case, impl), m in results.items() if m.error or m.mem_error]
  if errors:
    print("errors:\n" + "\n".join(errors))
  print(f"total time {time.perf_counter() - t_start:.0f} s")
  record = _record(args, env, peaks, cases, impls, samples, results)
  if args.json:
    with open(args.json, "w") as f:
      json.dump(record, f, indent=1)
    print(f"wrote {args.json}")
  if args.plot:
    _plot(record, args.plot)
    print(f"wrote {args.plot}")
  return {"header": header, "rows": rows, "impls": impls, "fma_peak_gflops": peak,
          "results": {(c.label(), i): m.seconds for (c, i), m in results.items()}}


def _rotated(items: list[str], k: int) -> list[str]:
  if not items:
    return []
  k %= len(items)
  return items[k:] + items[:k]


def _median(ms: list[Measurement]) -> Measurement:
  timed = [m for m in ms if m.seconds is not None]
  if not timed:
    return ms[-1]
  out = dataclasses.replace(timed[-1])
  out.seconds = statistics.median(m.seconds for m in timed)
  return out


def measure_peaks() -> dict[str, float | None]:
  """{"f32 FMA": GFLOP/s, "bf16 dot": GFLOP/s or None, "bf16 AMX": GFLOP/s or None} on
  all cores, from the cpu extension's loops; the bf16 dot-product peak only where our
  kernels run vdpbf16ps, the AMX peak only where they run AMX tiles."""
  try:
    from jax_fatrain import _cpu_ffi  # pylint: disable=import-outside-toplevel
  except ImportError:
    return {"f32 FMA": None, "bf16 dot": None, "bf16 AMX": None}
  bf16 = float(_cpu_ffi.bf16_dot_peak_gflops(0, 0.3))
  amx = float(_cpu_ffi.amx_bf16_peak_gflops(0, 0.3))
  return {"f32 FMA": float(_cpu_ffi.fma_peak_gflops(0, 0.3)), "bf16 dot": bf16 or None,
          "bf16 AMX": amx or None}


def describe_peaks(peaks: dict[str, float | None]) -> str:
  if not peaks.get("f32 FMA"):
    return "float32 FMA peak: not measured (no cpu extension)"
  text = (f"float32 FMA peak of this machine (a vector FMA loop on every core, the larger of "
          f"two readings, before and after the runs): {peaks['f32 FMA']:.0f} GFLOP/s")
  if peaks.get("bf16 AMX"):
    text += (f"; AMX bf16 peak (TDPBF16PS on tiles held in the tile registers): "
             f"{peaks['bf16 AMX']:.0f} GFLOP/s, what our bfloat16 rows that run on AMX are "
             "compared with")
  elif peaks.get("bf16 dot"):
    text += (f"; bf16 dot-product peak (vdpbf16ps, 4 FLOPs a lane): {peaks['bf16 dot']:.0f} "
             "GFLOP/s, what our bfloat16 rows are compared with")
  else:
    text += "; our bfloat16 rows run on FMAs and are compared with it"
  return text


def _record(args, env, peaks, cases, impls, samples, results) -> dict:
  """Everything measured, for --json and --plot."""
  rows = []
  for c in cases:
    row = {"T": c.T, "S": c.S, "D": c.D, "B": c.B, "N": c.N, "KH": c.kv_heads,
           "causal": c.causal, "dtype": c.dtype, "pass": c.mode, "gflop": c.flops / 1e9,
           "seconds": {}, "rounds": {}, "gflops": {}, "ratio_to_ours": {}}
    for i in impls:
      m = results.get((c, i))
      row["rounds"][i] = [x.seconds for x in samples.get((c, i), [])]
      if m is not None and m.seconds is not None:
        row["seconds"][i] = m.seconds
        row["gflops"][i] = c.flops / m.seconds / 1e9
    ours = row["seconds"].get("ours")
    for i in impls:
      if i != "ours" and ours and i in row["seconds"]:
        per_round = [a / b for a, b in zip(row["rounds"][i], row["rounds"]["ours"])
                     if a is not None and b is not None]
        row["ratio_to_ours"][i] = {"median": row["seconds"][i] / ours,
                                   "min": min(per_round, default=None),
                                   "max": max(per_round, default=None)}
    rows.append(row)
  return {"command": "python -m jax_fatrain.benchmark " + " ".join(sys.argv[1:]),
          "date": time.strftime("%Y-%m-%d"), "environment": env,
          "fma_peak_gflops": peaks["f32 FMA"], "bf16_dot_peak_gflops": peaks.get("bf16 dot"),
          "amx_bf16_peak_gflops": peaks.get("bf16 AMX"),
          "impls": list(impls), "rounds": args.rounds, "rows": rows}


def _plot(record: dict, path: str) -> None:
  """GFLOP/s against T, one line per implementation, a panel per (D, dtype, causal, pass)."""
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  keys = sorted({(r["dtype"], r["pass"], r["D"], r["causal"]) for r in record["rows"]})
  cols = min(4, len(keys))
  nrows = (len(keys) + cols - 1) // cols
  fig, axes = plt.subplots(nrows, cols, figsize=(4 * cols, 3.2 * nrows), squeeze=False)
  for ax, key in zip(axes.flat, keys):
    rows = sorted((r for r in record["rows"]
                   if (r["dtype"], r["pass"], r["D"], r["causal"]) == key), key=lambda r: r["T"])
    for impl in record["impls"]:
      pts = [(r["T"], r["gflops"][impl]) for r in rows if impl in r["gflops"]]
      if pts:
        ax.plot(*zip(*pts), marker="o", label=impl)
    if record.get("fma_peak_gflops"):
      ax.axhline(record["fma_peak_gflops"], color="gray", linestyle="--", linewidth=0.8,
                 label="f32 FMA peak")
    if record.get("bf16_dot_peak_gflops"):
      ax.axhline(record["bf16_dot_peak_gflops"], color="gray", linestyle=":", linewidth=0.8,
                 label="bf16 dot peak")
    dtype, mode, d, causal = key
    ax.set_title(f"{dtype} {mode} D={d} {'causal' if causal else 'full'}", fontsize=9)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("T")
    ax.set_ylabel("GFLOP/s")
    ax.legend(fontsize=7)
  for ax in list(axes.flat)[len(keys):]:
    ax.axis("off")
  fig.suptitle(f"{record['command']}  ({record['date']})", fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


if __name__ == "__main__":
  main()
