"""A lower-bound cost model of Metal dispatches on named Apple GPUs.

This is a MODEL, not a measurement. It turns the cost counters that the MSL
emulator records for one dispatch (``jax_fatrain.metal_profile``: simdgroup
matrix multiply-accumulates, device-memory cache lines, threadgroup-memory
bytes, threadgroups) into a predicted lower bound on that dispatch's time on an
Apple GPU, from the GPU's public core count, clock and memory bandwidth and a
few per-core rates measured by others (each number below says where it comes
from, or that it is an assumption). A kernel cannot run faster than any of:

* ``compute``: its 8x8x8 simdgroup matrix multiply-accumulates at the
  measured ``simdgroup_matrix`` rate of the cores that can be busy;
* ``threadgroup``: its threadgroup-memory bytes (read + written) at the
  threadgroup-memory bandwidth of those cores;
* ``device``: the 128-byte cache lines its simdgroup-wide device loads and
  stores touch, moved through the cores' L1 data caches at their bandwidth
  (an uncoalesced access pays for every line it touches);
* ``dram``: the bytes it must move to or from DRAM at least once (given by the
  caller as ``dram_bytes``: the dispatch's compulsory traffic), at the chip's
  memory bandwidth;

so the model's time is the largest of these terms. "Cores that can be busy" is
``min(cores, threadgroups)``: a threadgroup runs on one core, so a grid of 32
threadgroups cannot use more than 32 cores. What the model leaves out makes a
real GPU slower, never faster: instruction issue and latency, occupancy and
register spills, ALU work outside the matrix unit (exp2, max, scaling),
barrier stalls, cache misses beyond the compulsory ones, dispatch overhead and
clocks below the maximum. No public measurement gives a per-barrier or
per-dispatch cost precise enough to add without turning the bound into a
guess, so neither is added; barrier counts are reported next to the model.
A forward or forward+backward pass is the sum of its dispatches (Metal runs
the dispatches of one compute encoder in order here: each reads the previous
one's output).

Only a Mac measures times. Use the model to compare kernels' structure (two
kernels on the same problem, or a kernel against its own lower bound), not to
predict a wall clock.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable, Mapping, Sequence

# FMAs in one 8x8x8 simdgroup matrix multiply-accumulate (a FMA is 2 FLOPs).
MMA_FMAS = 8 * 8 * 8

# ---------------------------------------------------------------------------
# Per-core rates shared by the Apple GPU families below.
#
# [MB] Philip Turner, "metal-benchmarks", README, revision of 2024-09-22,
#      https://github.com/philipturner/metal-benchmarks -- microbenchmarks of
#      the M1/M2 (Apple 7/8) GPU cores.
# ---------------------------------------------------------------------------

# simdgroup_matrix throughput inside a matrix multiplication kernel, FMAs per
# core per cycle, "A15+, M1+" column of [MB]'s "Matrix FFMA16 / FFMA32" table
# (102.5 and 101.7; the ALU peak is 128 FMAs per core-cycle, [MB] "F32 OPs
# (FMA) 256" per core-cycle). Apple 9 (M3, M4): ASSUMED equal; no per-core
# matrix rate has been published for them. Consistency check: 101.7 FMAs x 2 x
# 10 cores x 1.578 GHz = 3.2 TFLOPS for the M4, above the 2.9 TFLOPS FP32 GEMM
# that Hübner et al. measured on it ("Apple vs. Oranges", arXiv:2502.05317).
MATRIX_FMA_PER_CORE_CYCLE_F16 = 102.5
MATRIX_FMA_PER_CORE_CYCLE_F32 = 101.7

# Threadgroup-memory bandwidth per core-cycle: ASSUMED 64 bytes. [MB] listed
# "Shared BW/Cycle 64 B" for Apple 7/8 in its earlier revisions and marks it
# "TBD" in the current one, noting that Apple "reduces
# the amount of threadgroup memory bandwidth" (the same table gives 128 B/cycle
# for AMD and Nvidia cores).
TG_BYTES_PER_CORE_CYCLE = 64.0

# L1 data-cache bandwidth per core-cycle ("On-Core Data BW/Cycle 64 B", Apple
# 7/8, [MB] "On-Chip Memory" table) and the global cache line size ("Global
# Cache Line 128 B", same table). Apple 9: ASSUMED unchanged. ASSUMED: every
# line an instruction touches costs a whole line of that bandwidth (no
# partial-line transfers), so an instruction that uses half of each line it
# touches costs twice its bytes.
L1_BYTES_PER_CORE_CYCLE = 64.0
CACHE_LINE_BYTES = 128


@dataclasses.dataclass(frozen=True)
class AppleGPU:
  """One Apple GPU configuration (the largest GPU of the named chip)."""

  name: str
  family: str            # MTLGPUFamily
  cores: int
  clock_ghz: float       # maximum GPU clock
  dram_gb_s: float       # unified-memory bandwidth, GB/s (10^9 bytes/s)
  matrix_fma_per_core_cycle_f16: float = MATRIX_FMA_PER_CORE_CYCLE_F16
  matrix_fma_per_core_cycle_f32: float = MATRIX_FMA_PER_CORE_CYCLE_F32
  tg_bytes_per_core_cycle: float = TG_BYTES_PER_CORE_CYCLE
  l1_bytes_per_core_cycle: float = L1_BYTES_PER_CORE_CYCLE
  cache_line_bytes: int = CACHE_LINE_BYTES

  @property
  def fp32_alu_tflops(self) -> float:
    """FP32 ALU peak (128 FMA lanes per core), for reference only."""
    return self.cores * 128 * 2 * self.clock_ghz / 1e3

  def matrix_fma_per_core_cycle(self, dtype: str) -> float:
    return (self.matrix_fma_per_core_cycle_f16 if _is_f16(dtype)
            else self.matrix_fma_per_core_cycle_f32)

  def matrix_tflops(self, dtype: str = "float32") -> float:
    """The modelled simdgroup_matrix rate of the whole GPU, TFLOPS."""
    return self.cores * self.matrix_fma_per_core_cycle(dtype) * 2 * self.clock_ghz / 1e3


# Sources for each row:
# * core counts and memory bandwidths: Apple's announcements of each chip
#   (apple.com/newsroom): M1 2020-11-10 (8-core GPU, "2.6 teraflops"); M1 Pro
#   and M1 Max 2021-10-18 ("up to 32-core GPU", "400GB/s"); M2 2022-06-06
#   ("10-core GPU", "100GB/s"); M2 Pro and M2 Max 2023-01-17 ("up to 38-core
#   GPU", twice M2 Pro's 200GB/s); M3 family 2023-10-30 (M3 10-core GPU,
#   100GB/s; M3 Max "up to 40-core GPU", 400GB/s with 40 cores); M4 Pro and
#   M4 Max 2024-10-30 (M4 10-core GPU, "120GB/s"; M4 Pro "up to 20-core GPU",
#   "273GB/s"; M4 Max "up to 40-core GPU", "546GB/s").
#   M1's bandwidth is not in Apple's announcement: LPDDR4X-4266 on a 128-bit
#   bus = 4266e6 x 16 bytes = 68.25 GB/s (AnandTech, "The 2020 Mac Mini
#   Unleashed: Putting Apple Silicon M1 To The Test", 2020-11-17).
# * clocks: Apple publishes none. M1/M1 Max/M2/M2 Max: [MB] overview table
#   (1.278 / 1.296 / 1.398 / 1.398 GHz; 8 x 128 x 2 x 1.278 GHz = 2.6 TFLOPS,
#   Apple's M1 figure). M3, M3 Max: 1.398 GHz, third-party GPU database
#   (hmc-tech.com, "Apple 10-Core M3", "40-Core M3 Max"): an ESTIMATE. M4
#   family: 1.578 GHz, the maximum GPU frequency that powermetrics reported on
#   an M4 Pro under load (The Eclectic Light Company, "M4 Pro full on: when
#   CPU and GPU draw over 50 W", 2025-01-22); M4 and M4 Max ASSUMED to reach
#   the same clock (the same GPU core; some databases list 1.678 GHz for the
#   M4 Max, which would make its compute term 6% shorter).
GPUS: dict[str, AppleGPU] = {g.name: g for g in (
    AppleGPU("M1", "Apple7", cores=8, clock_ghz=1.278, dram_gb_s=68.25),
    AppleGPU("M1 Max", "Apple7", cores=32, clock_ghz=1.296, dram_gb_s=400.0),
    AppleGPU("M2", "Apple8", cores=10, clock_ghz=1.398, dram_gb_s=100.0),
    AppleGPU("M2 Max", "Apple8", cores=38, clock_ghz=1.398, dram_gb_s=400.0),
    AppleGPU("M3", "Apple9", cores=10, clock_ghz=1.398, dram_gb_s=100.0),
    AppleGPU("M3 Max", "Apple9", cores=40, clock_ghz=1.398, dram_gb_s=400.0),
    AppleGPU("M4", "Apple9", cores=10, clock_ghz=1.578, dram_gb_s=120.0),
    AppleGPU("M4 Pro", "Apple9", cores=20, clock_ghz=1.578, dram_gb_s=273.0),
    AppleGPU("M4 Max", "Apple9", cores=40, clock_ghz=1.578, dram_gb_s=546.0),
)}

# The GPUs the comparison reports by default.
DEFAULT_GPUS: tuple[str, ...] = ("M1", "M2 Max", "M3 Max", "M4 Max")

TERMS = ("compute", "threadgroup", "device", "dram")


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
  """The model's lower bound for one dispatch on one GPU, with its terms (seconds)."""

  seconds: float
  terms: dict[str, float]
  bound: str          # the term that sets ``seconds``
  active_cores: int


def _get(counters: Mapping[str, Any], key: str) -> float:
  v = counters.get(key, 0)
  return float(v or 0)


def dispatch_time(counters: Mapping[str, Any], g: str | AppleGPU,
                  dtype: str = "float32") -> DispatchEstimate:
  """The modelled lower-bound time of one dispatch on GPU ``g``.

  ``counters`` is one dispatch's record from ``metal_profile.record`` (counters
  already scaled to the whole grid where the dispatch was sampled): the keys
  used are ``simdgroup_mma``, ``tg_bytes_read``, ``tg_bytes_written``,
  ``device_lines128_merged`` (the lines a simdgroup touches per synchronisation
  interval, i.e. after a compiler merges each lane's contiguous accesses into
  vector accesses; ``device_lines128`` where it is absent), ``threadgroups_total`` (``threadgroups_executed`` when
  the total is absent) and the optional ``dram_bytes`` (compulsory DRAM
  traffic; the ``dram`` term is 0 without it). ``dtype`` is the element type
  of the simdgroup matrices (``"float16"`` selects the FP16 matrix rate; any
  other type the FP32 one: the attention kernels here and MLX's multiply in
  float fragments whatever the input dtype). A model, not a measurement.
  """
  g = gpu(g)
  threadgroups = _get(counters, "threadgroups_total") or _get(counters, "threadgroups_executed")
  active = int(min(g.cores, threadgroups)) if threadgroups >= 1 else g.cores
  core_hz = active * g.clock_ghz * 1e9  # core-cycles per second over the busy cores
  terms = {
      "compute": _get(counters, "simdgroup_mma") * MMA_FMAS
                 / (g.matrix_fma_per_core_cycle(dtype) * core_hz),
      "threadgroup": (_get(counters, "tg_bytes_read") + _get(counters, "tg_bytes_written"))
                     / (g.tg_bytes_per_core_cycle * core_hz),
      "device": (_get(counters, "device_lines128_merged") or _get(counters, "device_lines128"))
                * g.cache_line_bytes
                / (g.l1_bytes_per_core_cycle * core_hz),
      "dram": _get(counters, "dram_bytes") / (g.dram_gb_s * 1e9),
  }
  bound = max(TERMS, key=lambda t: terms[t])
  return DispatchEstimate(seconds=terms[bound], terms=terms, bound=bound, active_cores=active)


def pass_time(dispatches: Iterable[Mapping[str, Any]], g: str | AppleGPU,
              dtype: str = "float32") -> float:
  """The modelled lower bound of a pass: the sum over its dispatches, seconds."""
  return sum(dispatch_time(d, g, dtype).seconds for d in dispatches)


def modelled_seconds(dispatches: Sequence[Mapping[str, Any]],
                     gpus: Iterable[str] = DEFAULT_GPUS,
                     dtype: str = "float32") -> dict[str, float]:
  """``{gpu name: modelled lower-bound seconds}`` of a pass (a model)."""
  return {name: pass_time(dispatches, name, dtype) for name in gpus}


def describe(gpus: Iterable[str] = DEFAULT_GPUS) -> list[str]:
  """Lines describing the model and the GPUs' parameters, for printed reports."""
  lines = [
      "MODEL, not a measurement: lower bound per dispatch = max(compute, threadgroup, device, "
      "dram), summed over a pass's dispatches; on min(cores, threadgroups) busy cores:",
      f"  compute = MMAs x {MMA_FMAS} FMA / simdgroup_matrix rate "
      f"({MATRIX_FMA_PER_CORE_CYCLE_F32} FMA/core-cycle float, measured on M1/M2, assumed on "
      "M3/M4)",
      f"  threadgroup = TG bytes / {TG_BYTES_PER_CORE_CYCLE:.0f} B/core-cycle (assumed); "
      f"device = merged lines128 x {CACHE_LINE_BYTES} B / {L1_BYTES_PER_CORE_CYCLE:.0f} B/core-cycle "
      "(L1); dram = compulsory bytes / memory bandwidth",
  ]
  for name in gpus:
    g = gpu(name)
    lines.append(f"  {g.name}: {g.cores} cores, {g.clock_ghz:.3f} GHz, "
                 f"{g.matrix_tflops():.1f} TFLOPS matrix (float), {g.dram_gb_s:g} GB/s")
  return lines
