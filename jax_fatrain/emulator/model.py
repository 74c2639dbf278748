"""A cost model of Metal dispatches on named Apple GPUs, calibrated on published timings.

This is a MODEL, not a measurement. It turns the cost counters the MSL emulator
records for one dispatch (:mod:`jax_fatrain.emulator.profile`) into a predicted
time on an Apple GPU. Its structure and per-core rates come from public
sources (each number below says where from, or that it is an assumption);
four global factors are fitted to published MLX timings on real Macs
(:mod:`jax_fatrain.emulator.calibration`, ``jax_fatrain/emulator/calibration.json``),
and the fit's leave-one-out error is the model's stated error.

Per dispatch, on GPU ``g``:

* **Occupancy.** A core holds ``R`` threadgroups at once: as many as its
  threadgroup memory and thread slots allow (``resident_per_core``). The
  busiest core runs ``k = ceil(threadgroups / cores)`` of them, so the
  dispatch proceeds like ``threadgroups / k`` fully busy cores (a grid of 64
  threadgroups on 40 cores takes two rounds, as long as 32 cores doing one).
  ``S = min(R, k)`` threadgroups' simdgroups share a core; fewer than
  ``SIMDGROUPS_TO_SATURATE`` of them leave the ALUs idle part of the time
  (latency not hidden): the compute term is divided by ``min(1, S / 16)``.
* **compute** (issue slots of the FP32 ALUs, which also run simdgroup_matrix):
  matrix multiply-accumulates at the measured simdgroup_matrix rate, plus
  transcendental calls (4 slots each: 32 per core-cycle against 128 lanes),
  software bfloat conversions (M1/M2 only), and simd shuffles and reductions
  (a reduction = 5 shuffle steps) at the shuffle bandwidth; these share the
  instruction issue, so they add.
* **memory**, one term per level, each at its bandwidth: threadgroup memory;
  the L1 and the GPU's L2 (every 128-byte line a simdgroup requests passes
  both); the system-level cache (what misses the L2); DRAM (what misses the
  SLC, at least the dispatch's compulsory bytes). Hit rates come from the
  working set of one wave of resident threadgroups
  (``metal_profile.wave_lines``): a line requested again within a wave hits
  a cache of size C with probability ``min(1, C / working set)``.
* **barriers**: each threadgroup_barrier stalls its threadgroup for a fixed
  latency (fitted), overlapped across the resident threadgroups of a core.

``time = max(compute / (eta_compute * occupancy), memory terms / eta_memory)
+ barriers``: compute and memory traffic overlap (the slowest sets the
pace), barrier stalls do not (every simdgroup of the threadgroup waits).
``eta_compute``, ``eta_memory`` and the barrier latency are fitted, with a
fourth parameter that only the calibration uses: the host's cost per timed
call in the published measurements (Python, command-buffer commit and wait),
added to each calibration point's prediction and to nothing else
(:data:`FITTED_DEFAULT` until a fit replaces them).

Not modelled: register pressure and spills (the Metal compiler decides
registers; occupancy here counts threadgroup memory and threads only),
instruction-cache misses, integer and FP32 arithmetic outside the counted
operations (index math, max, scaling), bank conflicts in threadgroup memory,
DRAM page effects, clocks below the maximum and thermal limits, and the
neural accelerators of M5 GPUs (MLX uses other kernels there).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Iterable, Mapping, Sequence

# FMAs in one 8x8x8 simdgroup matrix multiply-accumulate (a FMA is 2 FLOPs).
MMA_FMAS = 8 * 8 * 8

# ---------------------------------------------------------------------------
# Per-core rates and limits.
#
# [MB] Philip Turner, "metal-benchmarks", README at commit dc2adc640a1588246f4471d415aa6873cb6e3499
#      (2024-09-22), https://github.com/philipturner/metal-benchmarks --
#      microbenchmarks of the Apple 7 and 8 (M1, M2) GPU cores.
# Apple 9 (M3, M4): ASSUMED equal to Apple 8 where nothing was published.
# ---------------------------------------------------------------------------

# simdgroup_matrix FMAs per core-cycle inside a matrix multiplication, [MB]
# "Matrix FFMA16 / FFMA32" table, "A15+, M1+" column.
MATRIX_FMA_PER_CORE_CYCLE_F16 = 102.5
MATRIX_FMA_PER_CORE_CYCLE_F32 = 101.7
# FP32 lanes per core-cycle ([MB] "F32 OPs (FMA) 256" per core-cycle = 128
# FMA lanes) and transcendental throughput ([MB] "F32 Exp2 32", the same for
# LOG2; RSQRT is 16 and RECIP 21, counted at the exp2 rate here).
ALU_LANES_PER_CORE_CYCLE = 128
TRANSCENDENTAL_LANES_PER_CORE_CYCLE = 32
# float <-> bfloat in software on Apple 7/8 (no bfloat hardware; Metal
# FlashAttention enables native bfloat only on Apple 9): ASSUMED 2 integer
# ALU operations per conversion on average (bfloat -> float is one shift,
# float -> bfloat with round-to-nearest-even about four). Apple 9 converts in
# hardware: 0. half <-> float is free in the ALUs' operands ([MB]: "Most
# pipelines can accept 16-bit operands or write 16-bit results, with zero
# additional cost") and not counted.
BFLOAT_CONVERSION_OPS_SOFTWARE = 2.0
# SIMD shuffle bandwidth, [MB] "SIMD Shuffle BW/Cycle 256 B" per core; a
# shuffle moves 32 lanes x 4 bytes; a reduction over 32 lanes is 5 steps.
SHUFFLE_BYTES_PER_CORE_CYCLE = 256.0
REDUCTION_SHUFFLE_STEPS = 5
# Threadgroup-memory bandwidth: ASSUMED 64 bytes per core-cycle ([MB] listed
# 64 B in earlier revisions and "TBD" now).
TG_BYTES_PER_CORE_CYCLE = 64.0
# L1 ("On-Core Data BW/Cycle 64 B") and L2 ("On-GPU Data BW/Cycle ~32 B")
# bandwidth per core-cycle and the line size ("Global Cache Line 128 B"), [MB]
# "On-Chip Memory" table.
L1_BYTES_PER_CORE_CYCLE = 64.0
L2_BYTES_PER_CORE_CYCLE = 32.0
CACHE_LINE_BYTES = 128
# SLC bandwidth relative to DRAM: [MB] gives ~15.4-19.8 B (SLC) against
# ~7.7-9.9 B (RAM) per core-cycle for the largest Apple 7/8 GPUs: 2x.
SLC_TO_DRAM_BANDWIDTH = 2.0
# Per-core occupancy limits. Threadgroup memory: [MB] "Shared Memory ~60 KB"
# per core (Apple 7/8). Threads: [MB] "Max Threads 384-3072" per core,
# depending on registers per thread, which the Metal compiler decides and the
# emulator cannot see: ASSUMED 1024. Latency hiding: [MB] "ALU utilization
# maxes out at 24 simds/core" for dependent scalar instructions (ILP = 1);
# matrix code has more independent instructions per simdgroup. FITTED: 16,
# the largest of 8, 12, 16, 20, 24 whose calibration meets the error targets
# (24 leaves the published attention timings up to 67% slower in the model).
TG_MEMORY_PER_CORE = 60 * 1024
THREADS_PER_CORE = 1024
SIMDGROUPS_TO_SATURATE = 16


@dataclasses.dataclass(frozen=True)
class AppleGPU:
  """One Apple GPU configuration."""

  name: str
  family: str            # MTLGPUFamily
  cores: int
  clock_ghz: float       # maximum GPU clock
  dram_gb_s: float       # unified-memory bandwidth, GB/s (10^9 bytes/s)
  l2_kib: float          # GPU L2 cache
  slc_mib: float         # system-level cache
  device_class: str      # last letter of MLX's architecture name: g base, s/c Pro/Max, d Ultra
  matrix_fma_per_core_cycle_f16: float = MATRIX_FMA_PER_CORE_CYCLE_F16
  matrix_fma_per_core_cycle_f32: float = MATRIX_FMA_PER_CORE_CYCLE_F32

  @property
  def bfloat_native(self) -> bool:
    return self.family not in ("Apple7", "Apple8")

  @property
  def fp32_alu_tflops(self) -> float:
    """FP32 ALU peak (128 FMA lanes per core), for reference only."""
    return self.cores * ALU_LANES_PER_CORE_CYCLE * 2 * self.clock_ghz / 1e3

  def matrix_fma_per_core_cycle(self, dtype: str) -> float:
    return (self.matrix_fma_per_core_cycle_f16 if _is_f16(dtype)
            else self.matrix_fma_per_core_cycle_f32)

  def matrix_tflops(self, dtype: str = "float32") -> float:
    """The modelled simdgroup_matrix rate of the whole GPU, TFLOPS."""
    return self.cores * self.matrix_fma_per_core_cycle(dtype) * 2 * self.clock_ghz / 1e3


# Sources for each row:
# * core counts and memory bandwidths: Apple's announcements (apple.com/newsroom):
#   M1 2020-11-10 (8-core GPU); M1 Pro/Max 2021-10-18 (up to 32 cores,
#   200/400 GB/s); M1 Ultra 2022-03-08 (up to 64 cores, 800 GB/s); M2 2022-06-06
#   (10 cores, 100 GB/s); M2 Pro/Max 2023-01-17 (up to 19/38 cores, 200/400
#   GB/s); M2 Ultra 2023-06-05 (up to 76 cores, 800 GB/s); M3 family
#   2023-10-30 (M3 10 cores 100 GB/s, M3 Max 40 cores 400 GB/s); M3 Ultra
#   2025-03-05 (up to 80 cores, 819 GB/s); M4 family 2024-10-30 (M4 10 cores
#   120 GB/s, M4 Pro 20 cores 273 GB/s, M4 Max 40 cores 546 GB/s). M1's
#   68.25 GB/s: LPDDR4X-4266 x 128 bit (AnandTech, 2020-11-17). The 48-core
#   M1 Ultra and 16-core M1 Pro/M2 Pro rows are the smaller configurations of
#   the published timings.
# * clocks: [MB] "GPU | Gen | GHz" table for M1 (1.278), M1 Pro/Max/Ultra
#   (1.296), M2 family (1.398); M3 family 1.398 (hmc-tech.com GPU database:
#   an ESTIMATE); M4 family 1.578 (powermetrics maximum on an M4 Pro, The
#   Eclectic Light Company, 2025-01-22; M4/M4 Max ASSUMED equal).
# * L2 and SLC sizes: [MB] table "L2 $" / "L3 $" for M1, M1 Pro/Max/Ultra, M2,
#   M2 Pro/Max; Ultras ASSUMED twice the Max; M3 and M4 families ASSUMED equal to
#   the M2 chip of the same tier (not published).
# * device class: MLX's host picks GEMM tiles by the architecture name's last
#   letter (an M1 Max reports applegpu_g13s; base chips g, Ultras d).
GPUS: dict[str, AppleGPU] = {g.name: g for g in (
    AppleGPU("M1", "Apple7", 8, 1.278, 68.25, 768, 8, "g"),
    AppleGPU("M1 Pro", "Apple7", 16, 1.296, 200.0, 256, 24, "s"),
    AppleGPU("M1 Max", "Apple7", 32, 1.296, 400.0, 512, 48, "s"),
    AppleGPU("M1 Ultra", "Apple7", 48, 1.296, 800.0, 1024, 96, "d"),
    AppleGPU("M2", "Apple8", 10, 1.398, 100.0, 1536, 8, "g"),
    AppleGPU("M2 Pro", "Apple8", 16, 1.398, 200.0, 512, 24, "s"),
    AppleGPU("M2 Max", "Apple8", 38, 1.398, 400.0, 1024, 48, "s"),
    AppleGPU("M2 Ultra", "Apple8", 76, 1.398, 800.0, 2048, 96, "d"),
    AppleGPU("M3", "Apple9", 10, 1.398, 100.0, 1536, 8, "g"),
    AppleGPU("M3 Max", "Apple9", 40, 1.398, 400.0, 1024, 48, "s"),
    AppleGPU("M3 Ultra", "Apple9", 80, 1.398, 819.0, 2048, 96, "d"),
    AppleGPU("M3 Ultra 60", "Apple9", 60, 1.398, 819.0, 2048, 96, "d"),
    AppleGPU("M4", "Apple9", 10, 1.578, 120.0, 1536, 8, "g"),
    AppleGPU("M4 Pro", "Apple9", 20, 1.578, 273.0, 512, 24, "s"),
    AppleGPU("M4 Max", "Apple9", 40, 1.578, 546.0, 1024, 48, "s"),
)}

# The GPUs the comparison reports by default.
DEFAULT_GPUS: tuple[str, ...] = ("M1", "M2 Max", "M3 Max", "M4 Max")

TERMS = ("compute", "threadgroup", "l1", "l2", "slc", "dram", "barriers")
MEMORY_TERMS = ("threadgroup", "l1", "l2", "slc", "dram")


@dataclasses.dataclass(frozen=True)
class Fitted:
  """The model's fitted global parameters (see the module docstring)."""

  eta_compute: float = 0.8        # achieved share of the compute term's rate
  eta_memory: float = 0.8         # achieved share of the memory bandwidths
  barrier_cycles: float = 100.0   # stall per threadgroup_barrier, core cycles
  host_overhead_s: float = 20e-6  # per timed call of the published measurements

  def as_dict(self) -> dict[str, float]:
    return dataclasses.asdict(self)


# Placeholder values used until a calibration fit replaces them (ASSUMED).
FITTED_DEFAULT = Fitted()


def _is_f16(dtype: str) -> bool:
  return str(dtype) in ("float16", "f16", "half")


def gpu(name: str | AppleGPU) -> AppleGPU:
  if isinstance(name, AppleGPU):
    return name
  try:
    return GPUS[name]
  except KeyError:
    raise ValueError(f"unknown Apple GPU {name!r}; known: {', '.join(GPUS)}") from None


@dataclasses.dataclass(frozen=True)
class DispatchEstimate:
  """The model's time for one dispatch on one GPU, with its terms (seconds)."""

  seconds: float
  terms: dict[str, float]
  bound: str               # the overlapped term that sets the pace
  active_cores: float      # threadgroups / ceil(threadgroups / cores)
  resident: int            # threadgroups a core holds at once
  occupancy: float         # the compute term's latency-hiding factor, (0, 1]
  working_set_bytes: float


def _get(counters: Mapping[str, Any], key: str) -> float:
  v = counters.get(key, 0)
  return float(v or 0)


def resident_per_core(counters: Mapping[str, Any]) -> int:
  """Threadgroups one core holds at once: threadgroup memory and thread slots."""
  tg_bytes = _get(counters, "peak_tg_bytes") or _get(counters, "threadgroup_memory_length")
  threads = _get(counters, "threads_per_threadgroup") or 32.0
  by_memory = math.floor(TG_MEMORY_PER_CORE / tg_bytes) if tg_bytes else 64
  by_threads = math.floor(THREADS_PER_CORE / threads)
  return max(1, min(by_memory, by_threads))


def _wave_lines(counters: Mapping[str, Any], wave: float) -> float:
  from jax_fatrain.emulator import profile as metal_profile  # pylint: disable=import-outside-toplevel
  if not counters.get("grid"):
    return 0.0
  return metal_profile.wave_lines(dict(counters), int(wave))


def dispatch_time(counters: Mapping[str, Any], g: str | AppleGPU, dtype: str = "float32",
                  fitted: Fitted = FITTED_DEFAULT) -> DispatchEstimate:
  """The modelled time of one dispatch on GPU ``g``.

  ``counters`` is one dispatch's record from ``metal_profile.record`` (or a
  standalone dispatch; counters scaled to the whole grid where sampled),
  optionally with ``dram_bytes`` (the compulsory DRAM traffic: the bytes of
  its operands). ``dtype`` selects the FP16 matrix rate for ``"float16"``.
  """
  g = gpu(g)
  n = _get(counters, "threadgroups_total") or _get(counters, "threadgroups_executed") or 1.0
  simds = max(1.0, _get(counters, "threads_per_threadgroup") / 32.0)
  per_core = math.ceil(n / g.cores)
  active = n / per_core
  resident = resident_per_core(counters)
  sharing = min(resident, per_core)
  occupancy = min(1.0, sharing * simds / SIMDGROUPS_TO_SATURATE)
  hz = g.clock_ghz * 1e9
  cyc = active * hz  # core-cycles per second over the effectively busy cores

  mma = _get(counters, "simdgroup_mma") * MMA_FMAS / g.matrix_fma_per_core_cycle(dtype)
  alu = (_get(counters, "transcendentals")
         * ALU_LANES_PER_CORE_CYCLE / TRANSCENDENTAL_LANES_PER_CORE_CYCLE
         + (0.0 if g.bfloat_native else
            _get(counters, "bfloat_conversions") * BFLOAT_CONVERSION_OPS_SOFTWARE)
         ) / ALU_LANES_PER_CORE_CYCLE
  shuffle = ((_get(counters, "simd_shuffles")
              + REDUCTION_SHUFFLE_STEPS * _get(counters, "simd_reductions"))
             * 32 * 4 / SHUFFLE_BYTES_PER_CORE_CYCLE)
  compute = (mma + alu + shuffle) / cyc

  lines = _get(counters, "device_lines128_merged") or _get(counters, "device_lines128")
  requested = lines * CACHE_LINE_BYTES
  wave = min(n, g.cores * resident)
  ws = _wave_lines(counters, wave) * CACHE_LINE_BYTES
  if ws <= 0:
    ws = requested / max(1.0, n / wave)
  distinct = min(requested, ws * n / wave)  # first touches within each wave
  again = requested - distinct
  l2_hit = min(1.0, g.l2_kib * 1024 / ws) if ws else 1.0
  slc_hit = min(1.0, g.slc_mib * 2**20 / ws) if ws else 1.0
  to_slc = requested - again * l2_hit
  compulsory = _get(counters, "dram_bytes")
  to_dram = max(compulsory, compulsory + (to_slc - compulsory) * (1.0 - slc_hit))
  bw = g.dram_gb_s * 1e9

  terms = {
      "compute": compute,
      "threadgroup": (_get(counters, "tg_bytes_read") + _get(counters, "tg_bytes_written"))
                     / (TG_BYTES_PER_CORE_CYCLE * cyc),
      "l1": requested / (L1_BYTES_PER_CORE_CYCLE * cyc),
      "l2": requested / (L2_BYTES_PER_CORE_CYCLE * cyc),
      "slc": to_slc / (SLC_TO_DRAM_BANDWIDTH * bw),
      "dram": to_dram / bw,
      "barriers": _get(counters, "barriers") * fitted.barrier_cycles
                  / (active * sharing * hz),
  }
  paced = {"compute": terms["compute"] / (fitted.eta_compute * occupancy)}
  paced.update({t: terms[t] / fitted.eta_memory for t in MEMORY_TERMS})
  bound = max(paced, key=paced.get)
  seconds = paced[bound] + terms["barriers"]
  return DispatchEstimate(seconds=seconds, terms=terms, bound=bound, active_cores=active,
                          resident=resident, occupancy=occupancy, working_set_bytes=ws)


def pass_time(dispatches: Iterable[Mapping[str, Any]], g: str | AppleGPU,
              dtype: str = "float32", fitted: Fitted = FITTED_DEFAULT) -> float:
  """The modelled time of a pass: the sum over its dispatches, seconds (Metal
  runs the dispatches of one compute encoder in order; each reads the previous
  one's output)."""
  return sum(dispatch_time(d, g, dtype, fitted).seconds for d in dispatches)


def modelled_seconds(dispatches: Sequence[Mapping[str, Any]],
                     gpus: Iterable[str] = DEFAULT_GPUS, dtype: str = "float32",
                     fitted: Fitted = FITTED_DEFAULT) -> dict[str, float]:
  """``{gpu name: modelled seconds}`` of a pass (a model)."""
  return {name: pass_time(dispatches, name, dtype, fitted) for name in gpus}


def band(seconds: float, error: float) -> tuple[float, float]:
  """(low, high) seconds: the modelled time widened by the calibration's
  relative error (the median absolute leave-one-out error)."""
  return seconds * (1.0 - error), seconds * (1.0 + error)


def describe(gpus: Iterable[str] = DEFAULT_GPUS, fitted: Fitted = FITTED_DEFAULT) -> list[str]:
  """Lines describing the model and the GPUs' parameters, for printed reports."""
  lines = [
      "MODEL, not a measurement: per dispatch, max(compute / (eta_c x occupancy), "
      "threadgroup, L1, L2, SLC, DRAM terms / eta_m) + barrier stalls; summed over a pass.",
      f"  fitted: eta_compute {fitted.eta_compute:.3f}, eta_memory {fitted.eta_memory:.3f}, "
      f"barrier {fitted.barrier_cycles:.0f} cycles (host overhead of the published timings "
      f"{fitted.host_overhead_s * 1e6:.0f} us, calibration only)",
  ]
  for name in gpus:
    g = gpu(name)
    lines.append(f"  {g.name}: {g.cores} cores, {g.clock_ghz:.3f} GHz, "
                 f"{g.matrix_tflops():.1f} TFLOPS matrix (float), {g.dram_gb_s:g} GB/s, "
                 f"L2 {g.l2_kib:g} KiB, SLC {g.slc_mib:g} MiB")
  return lines
