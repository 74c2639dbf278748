"""Calibration of :mod:`jax_fatrain.emulator.model` against published MLX timings.

``jax_fatrain/emulator/calibration.json`` holds published wall-clock times
of MLX's steel GEMM and steel attention forward on named Macs (each with its
source address and the quoted row), and the emulator's counters for each
point's dispatch (stored, so that tests and quick runs need no emulation;
``python -m jax_fatrain.emulator.calibration --store`` recomputes them). MLX's
kernels run from the pinned mlx-metal wheel through the emulator
(:mod:`jax_fatrain.emulator.mlx_reference`), each point on a sample of its
threadgroups; for very large grids on a smaller copy along the batch or M
axis (every threadgroup of those grids does the same work, so the counters
scale with the threadgroup count, recorded in ``emulated``).

:func:`fit` chooses the model's four global parameters (:class:`metal_model.Fitted`)
by least squares on log(modelled / measured) over the points; :func:`leave_one_out`
refits without each point in turn and predicts it: those signed relative
errors are the model's stated error.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import sys
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from jax_fatrain.emulator import model as metal_model

DATA = Path(__file__).resolve().with_name("calibration.json")

# Emulation of a point: threadgroups sampled per dispatch, and the largest
# batch / M the emulator allocates (the counters are scaled to the real grid).
SAMPLE = 8
MAX_BATCH = 4
MAX_M = 4096

_ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}


def load(path: Path | str = DATA) -> list[dict[str, Any]]:
  with open(path, encoding="utf-8") as f:
    return json.load(f)


def save(points: Sequence[Mapping[str, Any]], path: Path | str = DATA) -> None:
  with open(path, "w", encoding="utf-8") as f:
    json.dump(list(points), f, indent=1)
    f.write("\n")


def label(pt: Mapping[str, Any]) -> str:
  if pt["kernel"] == "mlx_steel_gemm":
    return f"GEMM {pt['batch']}x{pt['M']}x{pt['N']}x{pt['K']}"
  return (f"attn T={pt['seq_len']} D={pt['head_dim']} H={pt['heads']}"
          f"{' causal' if pt['causal'] else ''}")


def compulsory_bytes(pt: Mapping[str, Any]) -> int:
  """The bytes a point's dispatch must move to or from DRAM: its operands."""
  s = _ITEMSIZE[pt["dtype"]]
  if pt["kernel"] == "mlx_steel_gemm":
    b, m, n, k = pt["batch"], pt["M"], pt["N"], pt["K"]
    return s * b * (m * k + k * n + m * n)
  return 4 * s * pt["batch"] * pt["heads"] * pt["seq_len"] * pt["head_dim"]


def _scale(record: dict[str, Any], factor: float, axis: int) -> dict[str, Any]:
  """The counters of a grid ``factor`` times larger along ``axis`` (1: y, 2: z)."""
  from jax_fatrain.emulator import profile as metal_profile  # pylint: disable=import-outside-toplevel
  out = dict(record)
  for name in metal_profile.COUNTERS:
    if name not in ("peak_tg_bytes", "threads_per_threadgroup", "races",
                    "threadgroups_executed"):
      out[name] = int(round(record[name] * factor))
  grid = list(record["grid"])
  grid[axis] = int(round(grid[axis] * factor))
  out["grid"] = tuple(grid)
  out["threadgroups_total"] = grid[0] * grid[1] * grid[2]
  out["sampled_fraction"] = out["threadgroups_executed"] / out["threadgroups_total"]
  return out


def emulate(pt: Mapping[str, Any], sample: int = SAMPLE) -> list[dict[str, Any]]:
  """The point's dispatch record(s), MLX's kernel run by the emulator."""
  import ml_dtypes  # pylint: disable=import-outside-toplevel
  from jax_fatrain.emulator import mlx_reference as mlx  # pylint: disable=import-outside-toplevel
  rng = np.random.default_rng(0)
  dt = {"bfloat16": ml_dtypes.bfloat16}.get(pt["dtype"], pt["dtype"])
  gpu = metal_model.gpu(pt["chip"])
  counters: dict[str, Any] = {}
  if pt["kernel"] == "mlx_steel_gemm":
    # The tiles MLX picks for the real shape; a copy with at most MAX_BATCH
    # batches and MAX_M rows runs (a multiple of every tile's BM, so its row
    # tiles are as full as the real ones wherever M is a multiple of BM).
    tiles = mlx.mlx_gemm_tiles(gpu.device_class, np.dtype(dt), pt["M"], pt["N"], pt["K"],
                               pt["batch"])
    batch, m = min(pt["batch"], MAX_BATCH), min(pt["M"], MAX_M)
    a = rng.standard_normal((batch, m, pt["K"]), np.float32).astype(dt)
    b = rng.standard_normal((batch, pt["K"], pt["N"]), np.float32).astype(dt)
    mlx.mlx_gemm(a if pt["batch"] > 1 else a[0], b if pt["batch"] > 1 else b[0],
                 device_class=gpu.device_class, counters=counters, sample=sample, tiles=tiles)
    record = counters
    if pt["batch"] > batch:
      record = _scale(record, pt["batch"] / batch, 2)
    if pt["M"] > m:
      record = _scale(record, -(-pt["M"] // tiles[0]) / record["grid"][1], 1)
  else:
    shape = (pt["batch"], pt["heads"], pt["seq_len"], pt["head_dim"])
    q, k, v = (rng.standard_normal(shape, np.float32).astype(dt) for _ in range(3))
    mlx.mlx_attention_forward(q, k, v, scale=1.0 / math.sqrt(pt["head_dim"]),
                              causal=pt["causal"], counters=counters, sample=sample,
                              ultra=gpu.device_class == "d")
    record = counters
  record = {k: (list(v) if isinstance(v, tuple) else v) for k, v in record.items()}
  record["dram_bytes"] = compulsory_bytes(pt)
  return [record]


def predict(pt: Mapping[str, Any], dispatches: Sequence[Mapping[str, Any]],
            fitted: metal_model.Fitted) -> float:
  """The modelled time of a published measurement: the kernel's modelled time
  plus the host's cost of one timed call."""
  return (metal_model.pass_time(dispatches, pt["chip"], pt["dtype"], fitted)
          + fitted.host_overhead_s)


_PARAMS = ("eta_compute", "eta_memory", "barrier_cycles", "host_overhead_s")
_LOWER = (0.05, 0.05, 0.0, 0.0)
_UPPER = (1.0, 1.0, 2000.0, 5e-3)


def fit(points: Sequence[Mapping[str, Any]],
        dispatches: Sequence[Sequence[Mapping[str, Any]]]) -> metal_model.Fitted:
  """The parameters minimising the squared log error over the points."""
  from scipy.optimize import least_squares  # pylint: disable=import-outside-toplevel
  measured = np.array([pt["measured_seconds"] for pt in points])
  # Overhead in microseconds and barrier latency in hundreds of cycles keep the
  # unknowns of order one.
  scale = np.array([1.0, 1.0, 100.0, 1e-6])

  def residuals(x):
    f = metal_model.Fitted(**dict(zip(_PARAMS, x * scale)))
    return np.log([predict(pt, d, f) for pt, d in zip(points, dispatches)]) - np.log(measured)

  best = None
  for start in ((0.6, 0.6, 1.0, 50.0), (0.9, 0.3, 0.1, 200.0), (0.3, 0.9, 5.0, 10.0)):
    r = least_squares(residuals, np.array(start), bounds=(np.array(_LOWER) / scale,
                                                          np.array(_UPPER) / scale))
    if best is None or r.cost < best.cost:
      best = r
  return metal_model.Fitted(**{k: float(v) for k, v in zip(_PARAMS, best.x * scale)})


def leave_one_out(points: Sequence[Mapping[str, Any]],
                  dispatches: Sequence[Sequence[Mapping[str, Any]]]) -> list[float]:
  """Signed relative error (predicted / measured - 1) of each point predicted
  by the model fitted to the other points."""
  errors = []
  for i, pt in enumerate(points):
    rest = [j for j in range(len(points)) if j != i]
    f = fit([points[j] for j in rest], [dispatches[j] for j in rest])
    errors.append(predict(pt, dispatches[i], f) / pt["measured_seconds"] - 1.0)
  return errors


def summary(errors: Sequence[float]) -> dict[str, float]:
  a = np.abs(np.asarray(errors))
  return {"median_abs": float(np.median(a)), "worst_abs": float(a.max()), "points": len(a)}


_STORED: dict[str, dict[str, Any]] = {}  # calibrate() of the stored data, per process


def calibrate(points: Sequence[Mapping[str, Any]] | None = None, fresh: bool = False,
              sample: int = SAMPLE, log=lambda s: None) -> dict[str, Any]:
  """Fits the model on the points (stored counters, or fresh emulator runs)
  and returns {"fitted", "points": [... with modelled_seconds and loo_error],
  "error": summary of the leave-one-out errors}. The points default to the
  data file's (the result is then computed once per process)."""
  if points is None and not fresh:
    if "stored" not in _STORED:
      _STORED["stored"] = calibrate(load(), sample=sample, log=log)
    return copy.deepcopy(_STORED["stored"])
  points = [dict(p) for p in (points if points is not None else load())]
  dispatches = []
  for pt in points:
    if fresh or not pt.get("dispatches"):
      log(f"emulating {pt['chip']} {label(pt)}")
      pt["dispatches"] = emulate(pt, sample)
    dispatches.append(pt["dispatches"])
  fitted = fit(points, dispatches)
  errors = leave_one_out(points, dispatches)
  for pt, d, e in zip(points, dispatches, errors):
    pt["modelled_seconds"] = predict(pt, d, fitted)
    pt["loo_error"] = e
  return {"fitted": fitted, "points": points, "error": summary(errors)}


def store(path: Path | str = DATA, sample: int = SAMPLE) -> None:
  """Re-emulates every point and writes its counters into the data file."""
  points = load(path)
  for pt in points:
    print(f"emulating {pt['chip']} {label(pt)}", file=sys.stderr, flush=True)
    pt["dispatches"] = emulate(pt, sample)
    pt["emulated"] = {"sample": sample, "max_batch": MAX_BATCH, "max_m": MAX_M}
  save(points, path)


def main(argv: Sequence[str] | None = None) -> int:
  ap = argparse.ArgumentParser(prog="python -m jax_fatrain.emulator.calibration",
                               description=__doc__.split("\n\n")[0])
  ap.add_argument("--store", action="store_true",
                  help="re-emulate every point and store its counters in the data file")
  args = ap.parse_args(argv)
  if args.store:
    store()
  result = calibrate()
  for pt in result["points"]:
    print(f"{pt['chip']:12s} {label(pt):34s} measured {pt['measured_seconds'] * 1e3:9.3f} ms  "
          f"modelled {pt['modelled_seconds'] * 1e3:9.3f} ms  loo {pt['loo_error']:+.1%}")
  print(result["fitted"], result["error"])
  return 0


if __name__ == "__main__":
  sys.exit(main())
