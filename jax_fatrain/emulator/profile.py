"""Cost counters of the Metal kernels, measured by the MSL emulator.

The ``metal_emulated`` implementation runs the unmodified Metal kernels on the
CPU. Inside :func:`record`, every dispatch it executes also counts what decides
its cost on an Apple GPU, and the block yields one dict per dispatch::

  from jax_fatrain.emulator import profile as metal_profile

  with metal_profile.record() as launches:
    out = jax_fatrain.dot_product_attention(q, k, v, implementation="metal_emulated")
    jax.block_until_ready(out)   # the calls must finish inside the block
  for launch in launches:
    print(launch["kernel"], launch["simdgroup_mma"], metal_profile.coalescing(launch))

Each record has the keys ``kernel``, ``grid``, ``threadgroup`` (3-tuples),
``threadgroup_memory_length``, the counters of :data:`COUNTERS`,
``race_reports`` (the first few races, as text), ``sampled_fraction``,
``call`` (the FFI call's number within the recording) and ``target``
(``"forward"`` or ``"backward"``).

Counters (integers, summed over a dispatch's threadgroups):

* ``simdgroup_mma``: 8x8x8 ``simdgroup_multiply_accumulate`` operations, once
  per simdgroup;
* ``device_bytes_read`` / ``device_bytes_written``: bytes lanes requested from
  device buffers (setBytes data excluded); reads through ``const`` pointers are
  loads, accesses through the others stores;
* ``device_load_instrs`` / ``device_store_instrs``: simdgroup-wide instructions,
  i.e. the k-th execution of an access site by the lanes of a simdgroup between
  two simdgroup synchronisations (``simdgroup_load``/``store`` count once);
* ``device_lines64`` / ``device_lines128``: distinct 64- and 128-byte lines of
  the buffer each instruction touches, summed (see :func:`coalescing`);
* ``device_lines128_merged``: distinct 128-byte lines the lanes of a simdgroup
  touch between two simdgroup synchronisations, summed: what the accesses need
  once a compiler merges each lane's contiguous scalar accesses into vector
  accesses and the cache serves repeats within the interval (see
  :func:`coalescing`);
* ``tg_bytes_read`` / ``tg_bytes_written``: threadgroup-memory bytes;
* ``barriers``: ``threadgroup_barrier`` executions, once per threadgroup;
  ``simd_barriers``: ``simdgroup_barrier`` executions, once per simdgroup;
* ``peak_tg_bytes``: threadgroup memory of one threadgroup (a maximum);
* ``threadgroups_executed``, ``threadgroups_total``, ``threads_per_threadgroup``;
* ``races``: threadgroup-memory accesses that raced with another thread's
  (outside recording a race fails the call instead);
* ``transcendentals``: per-lane calls of exp, exp2, log, log2, log10, pow,
  sqrt, rsqrt, sin, cos, tanh (vector forms per element);
* ``bfloat_conversions``: per-lane float <-> bfloat conversions (software on
  M1/M2; half converts for free in the ALUs' operands and is not counted,
  nor are simdgroup_matrix operands);
* ``simd_shuffles`` / ``simd_reductions``: simd_shuffle*/simd_broadcast and
  simd_sum/max/min/.../simd_prefix_* operations, once per simdgroup;
* ``tg_lines``: distinct 128-byte device lines each threadgroup touches,
  summed; ``tg_lines_new_x`` / ``tg_lines_new_y`` / ``tg_lines_new_xy``: the
  part of them its neighbour in grid x (in y, or z for a one-row grid, resp.
  in neither) does not touch, from per-buffer overlaps measured on a probe
  threadgroup and its two neighbours (three extra threadgroups per dispatch,
  run on saved copies of the buffers). :func:`wave_lines` turns them into the
  lines a wave of threadgroups running at once touches.

With ``sample``, each dispatch runs only some of its threadgroups, spread
evenly over grid x (query or key tiles, so causal work is represented) and over
heads and batches; the sums are scaled to the whole grid and
``sampled_fraction`` says which fraction ran. Outputs of sampled calls are
incomplete: use them for measuring only. The counters are exact for what the
emulator executes; what they imply for time on a GPU is a model's business.
"""

from __future__ import annotations

import contextlib
import math
from typing import Iterator, Sequence

COUNTERS = (
    "simdgroup_mma", "device_bytes_read", "device_bytes_written", "device_load_instrs",
    "device_store_instrs", "device_lines64", "device_lines128", "device_lines128_merged",
    "tg_bytes_read",
    "tg_bytes_written", "barriers", "simd_barriers", "peak_tg_bytes", "threadgroups_executed",
    "threadgroups_total", "threads_per_threadgroup", "races", "transcendentals",
    "bfloat_conversions", "simd_shuffles", "simd_reductions", "tg_lines", "tg_lines_new_x",
    "tg_lines_new_y", "tg_lines_new_xy")


def _extension():
  try:
    from jax_fatrain import _metal_emulated_ffi
  except ImportError as e:  # not built (JAX_FATRAIN_METAL_EMULATOR=OFF) or broken
    raise RuntimeError(f"jax_fatrain's metal_emulated extension is not available: {e}") from e
  return _metal_emulated_ffi


def _sample_args(sample) -> tuple[float, int]:
  """(fraction, max threadgroups per dispatch; 0 = no limit) for ``sample``."""
  if sample is None:
    return 1.0, 0
  if isinstance(sample, bool):
    raise TypeError("sample must be None, a fraction in (0, 1] or a number of threadgroups")
  if isinstance(sample, int):
    if sample < 1:
      raise ValueError(f"sample: at least one threadgroup per dispatch, got {sample}")
    return 1.0, sample
  if isinstance(sample, float):
    if not 0.0 < sample <= 1.0:
      raise ValueError(f"sample: a fraction must be in (0, 1], got {sample}")
    return sample, 0
  raise TypeError(f"sample must be None, a float or an int, got {type(sample).__name__}")


def recording() -> bool:
  """Whether metal_emulated dispatches are being recorded now."""
  return bool(_extension().profile_recording())


@contextlib.contextmanager
def record(sample: float | int | None = None) -> Iterator[list[dict]]:
  """Records the cost counters of every metal_emulated dispatch in the block.

  ``sample``: ``None`` runs every threadgroup; a float in (0, 1] runs that
  fraction of each dispatch's threadgroups; an int runs at most that many per
  dispatch. Yields a list that is filled with one dict per dispatch when the
  block exits (in the order the dispatches finished). Results must be computed
  inside the block (``jax.block_until_ready``): a call still in flight when it
  exits is not recorded. Recordings do not nest.
  """
  fraction, max_threadgroups = _sample_args(sample)
  ext = _extension()
  ext.profile_start(fraction, max_threadgroups)
  launches: list[dict] = []
  try:
    yield launches
  finally:
    launches.extend(ext.profile_stop())


def wave_lines(launch: dict, wave: int) -> float:
  """Distinct 128-byte lines that ``wave`` consecutive threadgroups touch (an estimate).

  Threadgroups start in linear grid order (x fastest), so a wave spans
  ``nx = min(wave, grid x)`` threadgroups along x and ``ny = ceil(wave / grid
  x)`` rows (y, then z). Per threadgroup (averages over the grid): ``tg_lines``
  lines, of which each further x adds ``tg_lines_new_x``, each further row
  ``tg_lines_new_y`` and each further (x, row) pair beyond the first
  ``tg_lines_new_xy`` minus what the row already added::

    lines = t + (nx - 1) nx_new + (ny - 1) ny_new + (nx - 1)(ny - 1) nxy_new

  Exact where every buffer is either shared or not along each direction
  (attention: Q, O private; K, V shared along x), an interpolation otherwise.
  """
  total = launch.get("threadgroups_total") or 0
  if not total or not launch.get("tg_lines"):
    return 0.0
  gx = int(launch["grid"][0])
  rows = total // max(1, gx)
  wave = max(1, min(int(wave), total))
  nx = min(wave, gx)
  ny = min(rows, -(-wave // gx))
  t, new_x, new_y, new_xy = (launch[k] / total for k in (
      "tg_lines", "tg_lines_new_x", "tg_lines_new_y", "tg_lines_new_xy"))
  return t + (nx - 1) * new_x + (ny - 1) * new_y + (nx - 1) * (ny - 1) * new_xy


def coalescing(launch: dict, merged: bool = False) -> float:
  """Device bytes requested / bytes of the 128-byte lines touched (1 = ideal).

  Per simdgroup-wide instruction as the kernel's source issues them, or with
  ``merged``, per simdgroup and synchronisation interval (each lane's
  contiguous accesses merged, as a vectorising compiler does).
  """
  lines = launch["device_lines128_merged" if merged else "device_lines128"]
  if lines == 0:
    return 1.0
  return (launch["device_bytes_read"] + launch["device_bytes_written"]) / (128.0 * lines)


def total(launches: Sequence[dict]) -> dict:
  """The counters of several dispatches together: sums, except
  ``peak_tg_bytes`` and ``threads_per_threadgroup`` (maxima) and
  ``sampled_fraction`` (the smallest)."""
  out = {name: 0 for name in COUNTERS}
  out["sampled_fraction"] = 1.0
  for launch in launches:
    for name in COUNTERS:
      if name in ("peak_tg_bytes", "threads_per_threadgroup"):
        out[name] = max(out[name], launch[name])
      else:
        out[name] += launch[name]
    out["sampled_fraction"] = min(out["sampled_fraction"], launch["sampled_fraction"])
  return out


def run_problem(*, seq_len: int, head_dim: int, kv_len: int | None = None, batch: int = 1,
                q_heads: int = 1, kv_heads: int = 1, dtype="bfloat16", causal: bool = False,
                backward: bool = False, sample: float | int | None = None,
                seed: int = 0, documents: int | None = None, mask: str | None = None,
                gpu_cores: int | Sequence[int] = 0) -> list[dict]:
  """Runs our Metal forward (and with ``backward`` our backward) once on
  random ``[B, H, L, D]`` inputs through the emulator; returns the launches.

  ``gpu_cores``: the core count of the GPU the backward is planned for (the
  plan fills it with two threadgroups per core; 0: not known), or several,
  for each of which the backward runs once. Every backward launch carries
  the count it was planned for under ``"gpu_cores"`` (the forward's plan does
  not depend on it).

  ``documents``: a packed sequence of that many documents of equal length
  (segment ids 0, 1, ...; needs ``kv_len == seq_len`` divisible by it).
  ``mask``: ``"additive"`` (standard normal in ``dtype``) or ``"bool"``
  (``True`` with probability 0.7), a ``[1, 1, L, S]`` mask broadcast over
  the batch and heads.
  The backward's O and L come from the CPU implementation when sampling (a
  sampled forward leaves them incomplete), else from the emulated forward.
  """
  import jax
  import jax.numpy as jnp
  import numpy as np

  import jax_fatrain

  kv_len = seq_len if kv_len is None else kv_len
  rng = np.random.default_rng(seed)
  dt = jnp.dtype(dtype)

  def rand(heads, length):
    return jnp.asarray(rng.standard_normal((batch, heads, length, head_dim), np.float32), dt)

  q, k, v, d_o = rand(q_heads, seq_len), rand(kv_heads, kv_len), rand(kv_heads, kv_len), \
      rand(q_heads, seq_len)
  scale = 1.0 / math.sqrt(head_dim)
  segments = {}
  if mask not in (None, "additive", "bool"):
    raise ValueError(f"mask: None, 'additive' or 'bool', got {mask!r}")
  m = None
  if mask == "additive":
    m = jnp.asarray(rng.standard_normal((1, 1, seq_len, kv_len), np.float32), dt)
  elif mask == "bool":
    m = jnp.asarray(rng.random((1, 1, seq_len, kv_len)) < 0.7)
  if documents is not None:
    if kv_len != seq_len or seq_len % documents:
      raise ValueError(f"documents: {documents} equal documents need kv_len == seq_len "
                       f"divisible by it, got {seq_len} and {kv_len}")
    ids = jnp.asarray(np.repeat(np.arange(documents, dtype=np.int32), seq_len // documents)
                      [None].repeat(batch, 0))
    segments = dict(q_segment_ids=ids, kv_segment_ids=ids)
  with record(sample) as launches:
    o, lse = jax.block_until_ready(jax_fatrain.flash_attn_train_fwd(
        q, k, v, m, scale=scale, causal=causal, implementation="metal_emulated", **segments))
  if not backward:
    return launches
  if sample is not None:
    o, lse = jax_fatrain.flash_attn_train_fwd(q, k, v, m, scale=scale, causal=causal,
                                              implementation="cpu", **segments)
  ext = _extension()
  previous = ext.gpu_cores()
  bwd = []
  try:
    for cores in ([gpu_cores] if isinstance(gpu_cores, int) else list(gpu_cores)):
      ext.set_gpu_cores(cores)
      with record(sample) as planned:
        jax.block_until_ready(jax_fatrain.flash_attn_train_bwd(
            q, k, v, o, lse, d_o, m, scale=scale, causal=causal,
            implementation="metal_emulated", **segments))
      bwd += [dict(launch, gpu_cores=cores) for launch in planned]
  finally:
    ext.set_gpu_cores(previous)
  return launches + bwd
