"""Our Metal kernels against MLX's steel attention, counted by the MSL emulator.

``python -m jax_fatrain.benchmark --metal-model [--json FILE] [--plot FILE]``
first calibrates :mod:`jax_fatrain.emulator.model` on published MLX timings
(:mod:`jax_fatrain.emulator.calibration`: MLX's steel GEMM and attention on
named Macs, their counters from the emulator; ``--calibration fresh``
re-emulates them, the default uses the counters stored with the data) and
prints measured, modelled and leave-one-out error per point. Then it runs, in
one process and on the same problems, our forward and forward+backward
(``implementation="metal_emulated"``, whatever dispatches the plan makes; the
backward's plan depends on the GPU's core count, so it runs once per core
count among the GPUs modelled) and
MLX's steel attention forward (the kernel MLX 0.32.4 dispatches at each head
dim), all through the MSL emulator with cost counters recording
(:mod:`jax_fatrain.emulator.profile`). Nothing is timed on this machine: the
calibrated model turns the counts into times on named Apple GPUs, with the
calibration's median leave-one-out error as the band. Those times are a
MODEL, not measurements.

The emulator is slow (every GPU thread is a CPU fiber), so by default each
dispatch runs a stratified sample of its threadgroups (``--sample``: a count
per dispatch, or a fraction) and the counters are scaled to the whole grid;
the sampled fraction is in every record. A sampled run's outputs are
incomplete, which does not change the counts: the kernels' loads, stores,
matrix operations and barriers do not depend on the values.

Records (``--json``): one per (implementation, pass, problem) with the fields
``implementation`` ("ours"/"mlx"), ``pass`` ("fwd"/"fwd+bwd"), ``dtype``,
``head_dim``, ``seq_len``, ``causal``, ``flops`` (FlashAttention convention:
4·B·N·T·S·D forward, halved when causal, x3.5 forward+backward),
``device_bytes`` (requested by lanes, read + written), ``coalescing``
(device bytes / (128-byte lines touched x 128), lines counted per simdgroup
and synchronisation interval, i.e. once a compiler has merged each lane's
contiguous accesses into vector accesses; ``coalescing_per_instruction``
counts them per access as the source issues it), ``threadgroup_bytes`` (read +
written), ``mma``, ``barriers``, ``races``, ``sampled_fraction`` and
``modelled_seconds`` ({GPU: seconds}) and ``modelled_band`` ({GPU: [low,
high] seconds}), plus the per-dispatch counters and model terms under
``dispatches``. ``gpu_cores`` is the core count the backward was planned for
(None for a forward, whose plan does not depend on it): a problem has one
forward+backward record per core count, each modelling only the GPUs of that
count. Calibration points are records with ``implementation`` =
"calibration": ``chip``, ``kernel``, ``dtype``, ``head_dim``, ``seq_len``
(attention; GEMMs have ``M``, ``N``, ``K``, ``batch``), ``measured_seconds``,
``modelled_seconds``, ``loo_error`` (signed relative error of the
leave-one-out prediction) and ``source``.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import json
import math
import sys
import time
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from jax_fatrain.emulator import model as metal_model

MODEL_NOTE = ("modelled_seconds: jax_fatrain.emulator.model calibrated on published MLX timings "
              "(a model over emulator counters), not measurements; modelled_band: +- the "
              "calibration's median leave-one-out error")

class Unavailable(RuntimeError):
  """A part the comparison needs is missing from this build or installation."""


# Counter keys summed over a pass's dispatches.
_SUMMED = ("simdgroup_mma", "device_bytes_read", "device_bytes_written", "device_lines64",
           "device_lines128", "device_lines128_merged", "tg_bytes_read", "tg_bytes_written",
           "barriers", "races", "threadgroups_executed", "threadgroups_total",
           "transcendentals", "bfloat_conversions", "simd_shuffles", "simd_reductions")


@dataclasses.dataclass(frozen=True)
class Problem:
  """One attention problem: [B, T, N, D] queries, keys and values, T = S;
  with ``documents``, each sequence packs that many documents of T / documents
  tokens (segment ids), each seeing only itself."""

  seq_len: int
  head_dim: int
  causal: bool
  dtype: str = "bfloat16"
  batch: int = 1
  heads: int = 1
  documents: int | None = None

  def flops(self, pass_: str) -> float:
    """The attention's useful FLOPs: within documents when packed."""
    docs = self.documents or 1
    doc_len = self.seq_len / docs
    f = 4.0 * self.batch * self.heads * docs * doc_len * doc_len * self.head_dim
    if self.causal:
      f /= 2
    return f * 3.5 if pass_ == "fwd+bwd" else f

  @property
  def itemsize(self) -> int:
    return {"bfloat16": 2, "float16": 2, "float32": 4}[self.dtype]

  def label(self) -> str:
    docs = f" {self.documents} documents" if self.documents else ""
    return f"T={self.seq_len} D={self.head_dim} {'causal' if self.causal else 'full'}{docs}"


def compulsory_bytes(kernel: str, p: Problem, grid: Sequence[int] | None = None,
                     accum_bytes: float | None = None) -> float | None:
  """Bytes a dispatch must move to or from DRAM at least once (its operands).

  From the kernel's role, which its name says: our forward reads Q, K, V and
  writes O and the float32 logsumexp L; compute-D reads O and dO and writes
  float32 Delta; dQ reads Q, K, V, dO, L, Delta and writes dQ; dK/dV reads the
  same and writes dK and dV; the fused dK/dV/dQ kernel reads the same, writes
  dK, dV and its float32 dQ accumulators; the dQ reduce reads the
  accumulators and writes dQ; MLX's attention forward reads Q, K, V and
  writes O. The accumulator bytes are ``accum_bytes`` (what the fused kernel
  writes and the reduce reads: causal splits leave the rows above their
  first key unwritten and unread); without it, every split's T x D floats,
  nsplit = ``grid`` x of the fused dispatch (else one split). None for a
  kernel of unknown role (the model then has no DRAM term).
  """
  tensor = p.batch * p.heads * p.seq_len * p.head_dim * p.itemsize
  rows = p.batch * p.heads * p.seq_len * 4  # one float32 per query row
  if accum_bytes is None:
    nsplit = int(grid[0]) if grid is not None else 1
    accum_bytes = nsplit * p.batch * p.heads * p.seq_len * p.head_dim * 4
  if kernel.startswith("flash_attn_train_fwd"):
    return 4 * tensor + rows
  if kernel.startswith("flash_attn_train_bwd_compute_d"):
    return 2 * tensor + rows
  if kernel.startswith("flash_attn_train_bwd_dkdv_dq"):
    return 6 * tensor + 2 * rows + accum_bytes
  if kernel.startswith("flash_attn_train_bwd_dq_reduce"):
    return tensor + accum_bytes
  if kernel.startswith("flash_attn_train_bwd_dq"):
    return 5 * tensor + 2 * rows
  if kernel.startswith("flash_attn_train_bwd_dkdv"):
    return 6 * tensor + 2 * rows
  if "attention" in kernel:  # MLX's steel attention forward
    return 4 * tensor
  return None


@dataclasses.dataclass(frozen=True)
class Calibration:
  """The fitted model parameters and its stated relative error."""

  fitted: metal_model.Fitted = metal_model.FITTED_DEFAULT
  error: float = 0.0


def summarize(impl: str, pass_: str, p: Problem, dispatches: Sequence[Mapping[str, Any]],
              gpus: Sequence[str], seconds: float | None = None,
              calibration: Calibration = Calibration(),
              gpu_cores: int | None = None) -> dict[str, Any]:
  """One record from a pass's per-dispatch counters (see the module docstring);
  ``gpu_cores``: the core count the dispatches were planned for, if any."""
  if not dispatches:
    raise ValueError(f"{impl} {pass_} {p.label()}: no dispatch was recorded")
  ds = []
  # The fused backward's dQ accumulators: the reduce reads each element the
  # fused kernel wrote once and nothing else, so its counted reads (scaled to
  # its grid when sampled) are the accumulator bytes both dispatches move.
  fused_grid = next((d.get("grid") for d in dispatches
                     if str(d.get("kernel", "")).startswith("flash_attn_train_bwd_dkdv_dq")), None)
  accum_bytes = next((float(d["device_bytes_read"]) for d in dispatches
                      if str(d.get("kernel", "")).startswith("flash_attn_train_bwd_dq_reduce")
                      and d.get("device_bytes_read") is not None), None)
  for d in dispatches:
    d = dict(d)
    if d.get("dram_bytes") is None:
      kernel = str(d.get("kernel", ""))
      cb = compulsory_bytes(kernel, p, d.get("grid") if "_dkdv_dq_" in kernel else fused_grid,
                            accum_bytes)
      if cb is not None:
        d["dram_bytes"] = cb
    est = {g: metal_model.dispatch_time(d, g, p.dtype, calibration.fitted) for g in gpus}
    d["modelled_seconds"] = {g: e.seconds for g, e in est.items()}
    d["modelled_bound"] = {g: e.bound for g, e in est.items()}
    d["modelled_terms"] = {g: e.terms for g, e in est.items()}
    ds.append(d)
  tot = {k: sum(float(d.get(k, 0) or 0) for d in ds) for k in _SUMMED}
  device_bytes = tot["device_bytes_read"] + tot["device_bytes_written"]
  lines_bytes = (tot["device_lines128_merged"] or tot["device_lines128"]) * 128
  instr_lines_bytes = tot["device_lines128"] * 128
  flops = p.flops(pass_)
  reports = [r for d in ds for r in (d.get("race_reports") or [])]
  return {
      "implementation": impl,
      "pass": pass_,
      "dtype": p.dtype,
      "batch": p.batch,
      "heads": p.heads,
      "head_dim": p.head_dim,
      "seq_len": p.seq_len,
      "causal": p.causal,
      "documents": p.documents,
      "gpu_cores": gpu_cores,
      "flops": flops,
      "device_bytes": device_bytes,
      "device_bytes_per_flop": device_bytes / flops,
      "device_lines128": tot["device_lines128"],
      "device_lines64": tot["device_lines64"],
      "device_lines128_merged": tot["device_lines128_merged"],
      "coalescing": device_bytes / lines_bytes if lines_bytes else None,
      "coalescing_per_instruction": (device_bytes / instr_lines_bytes
                                     if instr_lines_bytes else None),
      "threadgroup_bytes": tot["tg_bytes_read"] + tot["tg_bytes_written"],
      "peak_threadgroup_bytes": max(int(d.get("peak_tg_bytes", 0) or 0) for d in ds),
      # The fewest threadgroups a core holds at once over the pass's dispatches
      # (threadgroup memory and threads against a core's; metal_model).
      "resident_per_core": min(metal_model.resident_per_core(d) for d in ds),
      "mma": tot["simdgroup_mma"],
      "barriers": tot["barriers"],
      "races": int(tot["races"]),
      "race_reports": reports[:5],
      "threadgroups_executed": tot["threadgroups_executed"],
      "threadgroups_total": tot["threadgroups_total"],
      "sampled_fraction": (tot["threadgroups_executed"] / tot["threadgroups_total"]
                           if tot["threadgroups_total"] else None),
      "modelled_seconds": {g: sum(d["modelled_seconds"][g] for d in ds) for g in gpus},
      "modelled_band": {g: list(metal_model.band(sum(d["modelled_seconds"][g] for d in ds),
                                                 calibration.error)) for g in gpus},
      # Per GPU, the term that sets the most modelled time over the pass's dispatches.
      "modelled_bound": {g: max(("compute",) + metal_model.MEMORY_TERMS,
                                key=lambda t, g=g: sum(d["modelled_seconds"][g] for d in ds
                                                       if d["modelled_bound"][g] == t))
                         for g in gpus},
      "model_note": MODEL_NOTE,
      "emulator_seconds": seconds,
      "dispatches": ds,
  }


# ---------------------------------------------------------------------------
# Running the kernels
# ---------------------------------------------------------------------------


def _profile():
  try:
    return importlib.import_module("jax_fatrain.emulator.profile")
  except ImportError as e:
    raise Unavailable(
        "the emulator's counters API (jax_fatrain.emulator.profile) is not available in this "
        f"build: {e}") from e


def run_ours(p: Problem, sample, passes: Sequence[str],
             gpu_cores: Sequence[int] = (0,)) -> tuple[list[dict], list[dict], float]:
  """Our forward's and backward's dispatch records and the emulator's seconds.

  ``metal_profile.run_problem``: the forward once, then (for "fwd+bwd") the
  backward once per core count in ``gpu_cores`` (each launch says which under
  "gpu_cores"), whose O and L come from the CPU implementation when sampling
  (a sampled forward leaves them incomplete).
  """
  mp = _profile()
  t0 = time.perf_counter()
  launches = mp.run_problem(seq_len=p.seq_len, head_dim=p.head_dim, batch=p.batch,
                            q_heads=p.heads, kv_heads=p.heads, dtype=p.dtype, causal=p.causal,
                            backward="fwd+bwd" in passes, sample=sample,
                            documents=p.documents, gpu_cores=list(gpu_cores))
  seconds = time.perf_counter() - t0
  fwd = [d for d in launches if d.get("target") == "forward"]
  bwd = [d for d in launches if d.get("target") == "backward"]
  return fwd, bwd, seconds


_MLX_MODULES = ("jax_fatrain.emulator.mlx_reference",)


def mlx_runner() -> tuple[Any, str | None]:
  """(module, None) for MLX's attention on the emulator, or (None, why not)."""
  errors = []
  for name in _MLX_MODULES:
    try:
      mod = importlib.import_module(name)
    except ImportError as e:
      errors.append(f"{name}: {e}")
      continue
    if hasattr(mod, "mlx_attention_forward"):
      return mod, None
    errors.append(f"{name} has no mlx_attention_forward")
  return None, "MLX's steel attention on the emulator is not available (" + "; ".join(errors) + ")"


def mlx_supports(mod, p: Problem) -> bool:
  """Whether MLX's runner has a kernel for this problem (none takes segment ids)."""
  if p.documents:
    return False
  try:
    mod.mlx_kernel_name(p.dtype, p.head_dim)
  except (ValueError, KeyError):
    return False
  return True


def run_mlx(mod, p: Problem, sample) -> tuple[list[dict], float]:
  """MLX's forward dispatch record(s) and the emulator's seconds."""
  import ml_dtypes  # pylint: disable=import-outside-toplevel
  rng = np.random.default_rng(0)
  dt = {"bfloat16": ml_dtypes.bfloat16}.get(p.dtype, p.dtype)
  shape = (p.batch, p.heads, p.seq_len, p.head_dim)  # MLX's layout
  q, k, v = (rng.standard_normal(shape, dtype=np.float32).astype(dt) for _ in range(3))
  kwargs = {}
  if sample is not None:
    if "sample" not in inspect.signature(mod.mlx_attention_forward).parameters:
      raise Unavailable("MLX's runner cannot sample threadgroups; pass --sample all")
    kwargs["sample"] = sample
  counters: dict[str, Any] = {}
  t0 = time.perf_counter()
  try:
    mod.mlx_attention_forward(q, k, v, scale=1.0 / math.sqrt(p.head_dim), causal=p.causal,
                              counters=counters, **kwargs)
  except RuntimeError as e:  # BuildError: no source checkout or no C++ compiler
    if type(e).__name__ != "BuildError":
      raise
    raise Unavailable(f"MLX's kernel could not be built for the emulator: {e}") from e
  seconds = time.perf_counter() - t0
  if not counters:
    raise Unavailable("MLX's runner returned no counters")
  counters.setdefault("kernel", mod.mlx_kernel_name(p.dtype, p.head_dim))
  return [counters], seconds


# ---------------------------------------------------------------------------
# Reporting
# ---------------------------------------------------------------------------


def _fmt_us(s: float | None) -> str:
  return "-" if s is None else f"{s * 1e6:.1f}"


def _fmt_x(a: float | None, b: float | None) -> str:
  if a is None or b is None or not b:
    return "-"
  return f"{a / b:.2f}x"


def _key(r: Mapping[str, Any]) -> tuple:
  return (r["seq_len"], r["head_dim"], r["causal"], r["dtype"], r.get("documents") or 0)


def _mode(causal: bool, documents: int | None) -> str:
  """The table's "causal" cell: yes / no, and the documents of a pack."""
  return ("yes" if causal else "no") + (f", {documents} docs" if documents else "")


def _by_gpu(records: Sequence[Mapping[str, Any]]) -> dict[tuple, Mapping[str, Any]]:
  """{(implementation, pass, problem key, GPU): the record that models that GPU}."""
  return {(r["implementation"], r["pass"], _key(r), g): r
          for r in records for g in r["modelled_seconds"]}


def build_table(records: Sequence[Mapping[str, Any]], gpus: Sequence[str]):
  """(header, rows): one row per record; "cores": the core count the backward
  was planned for ("-": a forward), us cells "-" for GPUs a record does not model."""
  header = ["impl", "pass", "T", "D", "causal", "B/FLOP", "coalesc", "TG MB", "MMA M",
            "barriers", "races", "sampled", "cores", f"{gpus[0]} bound"] + [
                f"{g} us" for g in gpus]
  rows = []
  for r in records:
    rows.append([
        r["implementation"], r["pass"], str(r["seq_len"]), str(r["head_dim"]),
        _mode(r["causal"], r.get("documents")),
        f"{r['device_bytes_per_flop']:.4f}",
        "-" if r["coalescing"] is None else f"{r['coalescing']:.2f}",
        f"{r['threadgroup_bytes'] / 1e6:.1f}",
        f"{r['mma'] / 1e6:.2f}",
        f"{r['barriers']:.0f}",
        str(r["races"]),
        "-" if r["sampled_fraction"] is None else f"{r['sampled_fraction']:.3f}",
        "-" if r.get("gpu_cores") is None else str(r["gpu_cores"]),
        r["modelled_bound"].get(gpus[0], "-"),
    ] + [_fmt_us(r["modelled_seconds"].get(g)) for g in gpus])
  return header, rows


def build_ratios(records: Sequence[Mapping[str, Any]], gpus: Sequence[str]):
  """(header, rows): per problem, ours/MLX forward and our fwd+bwd / our fwd."""
  by = _by_gpu(records)
  keys = sorted({_key(r) for r in records})
  header = (["T", "D", "causal", "B/FLOP ours/mlx", "coalesc ours/mlx"]
            + [f"fwd {g} ours/mlx" for g in gpus]
            + [f"fwd+bwd/fwd {g}" for g in gpus])
  rows = []
  def seconds(impl, pass_, key, g):
    r = by.get((impl, pass_, key, g))
    return r and r["modelled_seconds"][g]

  for key in keys:
    ours, mlx = by.get(("ours", "fwd", key, gpus[0])), by.get(("mlx", "fwd", key, gpus[0]))
    row = [str(key[0]), str(key[1]), _mode(key[2], key[4])]
    row.append(_fmt_x(ours and ours["device_bytes_per_flop"], mlx and mlx["device_bytes_per_flop"]))
    row.append(_fmt_x(ours and ours["coalescing"], mlx and mlx["coalescing"]))
    row += [_fmt_x(seconds("ours", "fwd", key, g), seconds("mlx", "fwd", key, g)) for g in gpus]
    row += [_fmt_x(seconds("ours", "fwd+bwd", key, g), seconds("ours", "fwd", key, g))
            for g in gpus]
    rows.append(row)
  return header, rows


def build_packed_ratios(records: Sequence[Mapping[str, Any]], gpus: Sequence[str]):
  """(header, rows): per packed problem and pass, our dense causal over our
  packed (segment ids) on the same shape: matrix operations (as planned for
  the first GPU) and modelled time."""
  by = _by_gpu(records)
  header = ["T", "D", "docs", "pass", "MMA dense/packed"] + [f"{g} dense/packed" for g in gpus]
  rows = []
  cases = sorted({(r["implementation"], r["pass"], _key(r)) for r in records},
                 key=lambda c: (c[2], c[1]))
  for impl, pass_, key in cases:
    if impl != "ours" or not key[4]:
      continue
    dense_key = key[:4] + (0,)
    packed, dense = by.get((impl, pass_, key, gpus[0])), by.get((impl, pass_, dense_key, gpus[0]))
    if dense is None or packed is None:
      continue
    cells = []
    for g in gpus:
      d, q = by.get((impl, pass_, dense_key, g)), by.get((impl, pass_, key, g))
      cells.append(_fmt_x(d and d["modelled_seconds"][g], q and q["modelled_seconds"][g]))
    rows.append([str(key[0]), str(key[1]), str(key[4]), pass_,
                 _fmt_x(dense["mma"], packed["mma"])] + cells)
  return header, rows


def calibration_records(result: Mapping[str, Any]) -> list[dict[str, Any]]:
  """JSON records (implementation "calibration") of a metal_calibration.calibrate result."""
  out = []
  for pt in result["points"]:
    r = {"implementation": "calibration", "chip": pt["chip"], "kernel": pt["kernel"],
         "dtype": pt["dtype"], "head_dim": pt.get("head_dim"), "seq_len": pt.get("seq_len"),
         "measured_seconds": pt["measured_seconds"], "modelled_seconds": pt["modelled_seconds"],
         "loo_error": pt["loo_error"], "source": pt["source"]}
    for k in ("batch", "heads", "causal", "M", "N", "K"):
      if pt.get(k) is not None:
        r[k] = pt[k]
    out.append(r)
  return out


def build_calibration_table(records: Sequence[Mapping[str, Any]]):
  """(header, rows): measured, modelled and leave-one-out error per calibration point."""
  from jax_fatrain.emulator import calibration as metal_calibration  # pylint: disable=import-outside-toplevel
  header = ["chip", "kernel", "problem", "dtype", "measured ms", "modelled ms", "LOO error"]
  rows = [[r["chip"], r["kernel"].replace("mlx_steel_", ""), metal_calibration.label(r),
           r["dtype"], f"{r['measured_seconds'] * 1e3:.3f}", f"{r['modelled_seconds'] * 1e3:.3f}",
           f"{r['loo_error']:+.1%}"] for r in records]
  return header, rows


def format_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
  widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h)
            for i, h in enumerate(header)]
  fmt = lambda cells: "  ".join(c.rjust(w) for c, w in zip(cells, widths))
  return "\n".join([fmt(header), fmt(["-" * w for w in widths])] + [fmt(r) for r in rows])


def save_json(records: Sequence[Mapping[str, Any]], path: str) -> None:
  with open(path, "w", encoding="utf-8") as f:
    json.dump(list(records), f, indent=1, default=float)
    f.write("\n")


def _matplotlib():
  try:
    import matplotlib  # pylint: disable=import-outside-toplevel
  except ImportError as e:
    raise Unavailable("--plot needs matplotlib (pip install matplotlib)") from e
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  return plt


def plot(records: Sequence[Mapping[str, Any]], gpus: Sequence[str], path: str) -> None:
  """The calibration (modelled against measured), ratios ours/MLX of the
  modelled forward time, and modelled times per GPU with their bands."""
  plt = _matplotlib()

  calib = [r for r in records if r["implementation"] == "calibration"]
  records = [r for r in records if r["implementation"] != "calibration"]
  by = _by_gpu(records)
  keys = sorted({_key(r) for r in records})
  labels = [f"T={k[0]}\nD={k[1]}\n{'causal' if k[2] else 'full'}"
            + (f"\n{k[4]} docs" if k[4] else "") for k in keys]
  x = np.arange(len(keys))
  ncols = 2
  nrows = 2 + (len(gpus) + ncols - 1) // ncols
  fig = plt.figure(figsize=(max(8.0, 1.1 * max(1, len(keys)) * ncols), 3.2 * nrows))
  grid = fig.add_gridspec(nrows, ncols)

  ax = fig.add_subplot(grid[0, :])
  if calib:
    for chip in sorted({r["chip"] for r in calib}):
      pts = [r for r in calib if r["chip"] == chip]
      ax.scatter([r["measured_seconds"] * 1e3 for r in pts],
                 [r["measured_seconds"] * (1 + r["loo_error"]) * 1e3 for r in pts],
                 label=chip, s=14)
    lo = min(r["measured_seconds"] for r in calib) * 1e3 / 1.5
    hi = max(r["measured_seconds"] for r in calib) * 1e3 * 1.5
    ax.plot([lo, hi], [lo, hi], color="black", linewidth=0.8)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.legend(fontsize=6, ncol=4)
  else:
    ax.text(0.5, 0.5, "no calibration records", transform=ax.transAxes, ha="center")
  ax.set_xlabel("measured ms (published)")
  ax.set_ylabel("leave-one-out modelled ms")
  ax.set_title("Calibration: published MLX timings against the model fitted without each point",
               fontsize=9)

  ax = fig.add_subplot(grid[1, :])
  width = 0.8 / max(1, len(gpus))
  plotted = False
  for i, g in enumerate(gpus):
    vals = []
    for k in keys:
      ours, mlx = by.get(("ours", "fwd", k, g)), by.get(("mlx", "fwd", k, g))
      vals.append(ours["modelled_seconds"][g] / mlx["modelled_seconds"][g]
                  if ours and mlx and mlx["modelled_seconds"][g] else np.nan)
    plotted |= not all(np.isnan(vals))
    ax.bar(x + (i - (len(gpus) - 1) / 2) * width, vals, width, label=g)
  ax.axhline(1.0, color="black", linewidth=0.8)
  ax.set_xticks(x, labels, fontsize=7)
  ax.set_ylabel("ours / MLX")
  ax.set_title("Modelled forward time, ours / MLX (a model, not a measurement)")
  if plotted:
    ax.legend(fontsize=7)
  else:
    ax.text(0.5, 0.5, "no MLX records", transform=ax.transAxes, ha="center")

  series = [("ours", "fwd"), ("mlx", "fwd"), ("ours", "fwd+bwd")]
  width = 0.8 / len(series)
  for j, g in enumerate(gpus):
    ax = fig.add_subplot(grid[2 + j // ncols, j % ncols])
    for i, (impl, pass_) in enumerate(series):
      vals = [by[(impl, pass_, k, g)]["modelled_seconds"][g] * 1e6
              if (impl, pass_, k, g) in by else np.nan for k in keys]
      band = np.array([[v - by[(impl, pass_, k, g)]["modelled_band"][g][0] * 1e6,
                        by[(impl, pass_, k, g)]["modelled_band"][g][1] * 1e6 - v]
                       if (impl, pass_, k, g) in by and "modelled_band" in by[(impl, pass_, k, g)]
                       else [0.0, 0.0] for k, v in zip(keys, vals)]).T
      ax.bar(x + (i - (len(series) - 1) / 2) * width, vals, width, yerr=band, capsize=2,
             label=f"{impl} {pass_}")
    ax.set_yscale("log")
    ax.set_xticks(x, labels, fontsize=6)
    ax.set_ylabel("modelled us")
    ax.set_title(f"{g}: modelled time (band: calibration error)", fontsize=9)
    ax.legend(fontsize=6)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


# ---------------------------------------------------------------------------
# The command
# ---------------------------------------------------------------------------


def parse_sample(s: str | None):
  """``--sample``: "all" (None), an int (threadgroups per dispatch) or a fraction."""
  if s is None or s == "all":
    return None
  if "." in s or "e" in s.lower():
    f = float(s)
    if not 0 < f <= 1:
      raise ValueError(f"--sample fraction must be in (0, 1], got {s}")
    return f
  n = int(s)
  if n < 1:
    raise ValueError(f"--sample count must be >= 1, got {s}")
  return n


def check_available(impls: Sequence[str]):
  """Raises Unavailable unless every part ``impls`` needs is there; MLX's runner or None."""
  _profile()
  if "mlx" not in impls:
    return None
  mlx, why = mlx_runner()
  if mlx is None:
    raise Unavailable(why + "; pass --impls ours to run our kernels alone")
  checkout = getattr(mlx, "source_checkout", None)
  if callable(checkout) and not checkout():
    raise Unavailable("MLX's kernels run in the emulator only from a source checkout of "
                      "jax_fatrain (tests/metal_emulator and cpp/metal/emulator are not "
                      "installed with the package); pass --impls ours to run our kernels alone")
  fetch = getattr(mlx, "fetch_mlx_kernels", None)
  if callable(fetch):
    try:
      fetch()
    except RuntimeError as e:  # MlxUnavailable: no network, no pip, wrong hash
      raise Unavailable(f"MLX's kernel headers are not available: {e}; pass --impls ours to "
                        "run our kernels alone") from e
  return mlx


def run(problems: Sequence[Problem], *, impls: Sequence[str] = ("ours", "mlx"),
        passes: Sequence[str] = ("fwd", "fwd+bwd"), sample=8,
        gpus: Sequence[str] = metal_model.DEFAULT_GPUS,
        log: Callable[[str], None] = lambda s: print(s, file=sys.stderr, flush=True),
        calibration: Calibration = Calibration()) -> list[dict[str, Any]]:
  """Runs every (implementation, pass, problem); returns the records."""
  mlx = check_available(impls)
  records = []
  # The backward is planned for the GPU's cores: one plan per core count.
  cores = {g: metal_model.gpu(g).cores for g in gpus}
  core_counts = sorted(set(cores.values()))
  t_start = time.perf_counter()
  for n, p in enumerate(problems, 1):
    done = []
    if "ours" in impls:
      fwd, bwd, t = run_ours(p, sample, passes, core_counts)
      if "fwd" in passes:
        records.append(summarize("ours", "fwd", p, fwd, gpus, t if len(passes) == 1 else None,
                                 calibration))
      if "fwd+bwd" in passes:
        for c in core_counts:
          records.append(summarize("ours", "fwd+bwd", p,
                                   fwd + [d for d in bwd if d.get("gpu_cores") == c],
                                   [g for g in gpus if cores[g] == c], t, calibration,
                                   gpu_cores=c))
      done.append(f"ours {t:.1f}s")
    if mlx is not None and "fwd" in passes:
      if mlx_supports(mlx, p):
        launches, t = run_mlx(mlx, p, sample)
        records.append(summarize("mlx", "fwd", p, launches, gpus, t, calibration))
        done.append(f"mlx {t:.1f}s")
      else:
        done.append("mlx: no kernel")
    log(f"[{n}/{len(problems)} {time.perf_counter() - t_start:.0f}s] {p.dtype} {p.label()}: "
        + ", ".join(done))
  return records


def main(args) -> list[dict[str, Any]]:
  """``python -m jax_fatrain.benchmark --metal-model``: prints, saves, plots."""
  gpus = list(args.gpus or metal_model.DEFAULT_GPUS)
  for g in gpus:
    metal_model.gpu(g)
  packed = getattr(args, "packed", False)
  # (causal, documents) per shape: packed, our dense causal call and our call
  # with segment ids; else the causal modes asked for.
  if packed:
    modes = [(True, None), (True, args.packed_docs)]
  else:
    modes = [(c, None) for c in {"on": [True], "off": [False], "both": [False, True]}[args.causal]]
  problems = [Problem(seq_len=t, head_dim=d, causal=c, dtype=dt, batch=args.batch,
                      heads=args.heads, documents=docs)
              for dt in args.dtypes for t in args.seq_lens for d in args.head_dims
              for c, docs in modes]
  impls = ["ours"] if packed else [i for i in args.impls if i in ("ours", "mlx")]
  passes = ["fwd"] if args.fwd_only else ["fwd", "fwd+bwd"]
  sample = parse_sample(args.sample)
  fresh = getattr(args, "calibration", "stored") == "fresh"
  check_available(list(impls) + (["mlx"] if fresh else []))  # fail now, not after a long run
  if args.plot:
    _matplotlib()
  t0 = time.perf_counter()
  from jax_fatrain.emulator import calibration as metal_calibration  # pylint: disable=import-outside-toplevel
  result = metal_calibration.calibrate(
      fresh=fresh, log=lambda s: print(s, file=sys.stderr, flush=True))
  calib = calibration_records(result)
  error = result["error"]
  calibration = Calibration(result["fitted"], error["median_abs"])
  print(f"Calibration of the model: {error['points']} published MLX timings "
        f"({'counters emulated now' if fresh else 'counters stored with the data'}); "
        f"leave-one-out error median {error['median_abs']:.1%}, worst {error['worst_abs']:.1%}")
  header, rows = build_calibration_table(calib)
  print(format_table(header, rows))
  print()
  print(f"Metal kernels through the MSL emulator, B={args.batch}, {args.heads} query and kv "
        f"head(s), T=S, sample={args.sample} threadgroups per dispatch "
        "(a count, a fraction or all; counters scaled to the whole grid)")
  print("\n".join(metal_model.describe(gpus, calibration.fitted)))
  print(f"  band: +-{calibration.error:.1%} (median leave-one-out error)")
  sys.stdout.flush()
  records = run(problems, impls=impls, passes=passes, sample=sample, gpus=gpus,
                calibration=calibration)
  wall = time.perf_counter() - t0
  header, rows = build_table(records, gpus)
  print()
  print(format_table(header, rows))
  print("B/FLOP: device bytes requested per FLOP; coalesc: device bytes / (128-byte lines "
        "touched x 128); TG MB: threadgroup-memory bytes read + written; MMA M: millions of "
        "8x8x8 simdgroup multiply-accumulates; barriers: threadgroup barriers executed, summed "
        "over threadgroups; bound: the model's term that sets most of the time (compute, "
        "threadgroup, l1, l2, slc, dram); <GPU> us: modelled time (a model, not a "
        f"measurement; band +-{calibration.error:.0%})")
  if packed:
    header, rows = build_packed_ratios(records, gpus)
    print()
    print(format_table(header, rows))
    print("dense/packed: our dense causal call over our call with segment ids on the same "
          "shape (matrix operations counted; modelled times a model, not a measurement)")
  elif "mlx" in impls or "fwd+bwd" in passes:
    header, rows = build_ratios(records, gpus)
    print()
    print(format_table(header, rows))
  print(f"total time {wall:.0f} s")
  records = calib + records
  if args.json:
    save_json(records, args.json)
    print(f"saved {len(records)} records to {args.json}")
  if args.plot:
    plot(records, gpus, args.plot)
    print(f"saved the plot to {args.plot}")
  return records
