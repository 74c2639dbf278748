"""MLX's steel attention forward and steel GEMM, run unmodified by the MSL emulator.

The yardstick for jax_fatrain's Metal kernels: the forward kernel a Mac user of
MLX runs today. MLX's kernel headers ship in the ``mlx-metal`` macOS wheel on
PyPI (``mlx/include/mlx/backend/metal/kernels/``). ``fetch_mlx_kernels()``
downloads the pinned wheel with pip, checks its SHA-256 and unpacks only that
directory into the cache (``$JAX_FATRAIN_CACHE``, default
``~/.cache/jax_fatrain``); ``$JAX_FATRAIN_MLX_METAL_WHEEL`` may name a copy of
the wheel instead (offline use; the hash is checked the same way). Nothing of
MLX is stored in this repository: ``tests/metal_emulator/mlx_steel_attention
.metal`` only includes MLX's header and instantiates its ``attention``
template, and ``jax_fatrain.emulator.msl_standalone`` compiles it for the emulator.

``mlx_attention_forward`` fills MLX's parameter structs and grid as MLX's
host code does for its steel (non-NAX) kernel and returns O; ``mlx_gemm``
does the same for the steel GEMM (``steel_gemm_fused``) and returns A @ B.
Which kernel variant MLX 0.32.4 dispatches: the pinned wheel's compiled
``mlx.metallib`` holds exactly the ``steel_attention_*`` names
``mlx_kernel_name`` forms (at D = 256 only ``wm4_wn2``, with ``bk16`` and, for
M*-Ultra GPUs, ``bk32``; at D = 64 ``bk32_wm4_wn1``; at D = 128
``bk16_wm4_wn1``) and its ``libmlx.dylib`` the name parts ``_bq _bk _bd _bv
_wm _wn``. The GEMM's tile choice follows ``GEMM_TPARAM_MACRO`` and the grid
``steel_matmul_regular_axpby`` in MLX's ``mlx/backend/metal/matmul.cpp``
(github.com/ml-explore/mlx, commit 846d176227a0ac13d2667e58d2bb68b322109ab0 of 2026-08-22, the newest source
at hand; its six tile configurations are the ones in the wheel's metallib). Only tests and
``python -m jax_fatrain.benchmark --metal-model`` use this module; it needs
network access (or the wheel) and a source checkout.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import ml_dtypes  # noqa: F401  (registers the bfloat16 numpy dtype)
import numpy as np

from jax_fatrain.emulator import msl_standalone

__all__ = ["MLX_METAL_VERSION", "MLX_METAL_SHA256", "MlxUnavailable", "fetch_mlx_kernels",
           "mlx_attention_forward", "mlx_gemm", "mlx_gemm_kernel_name", "mlx_gemm_tiles",
           "mlx_kernel_name", "mlx_tiles", "source_checkout"]

MLX_METAL_VERSION = "0.32.4"
MLX_METAL_WHEEL = f"mlx_metal-{MLX_METAL_VERSION}-py3-none-macosx_14_0_arm64.whl"
MLX_METAL_SHA256 = "8019b2db622599267d66cc168b2f0dbf5af929790a6c3b3913e00eabc42a7947"
_KERNELS_IN_WHEEL = "mlx/include/mlx/backend/metal/kernels/"
_INSTANTIATIONS = (Path(__file__).resolve().parents[2] / "tests" / "metal_emulator" /
                   "mlx_steel_attention.metal")
_GEMM_INSTANTIATIONS = _INSTANTIATIONS.with_name("mlx_steel_gemm.metal")


def source_checkout() -> bool:
  """Whether the instantiation files and emulator sources of a source checkout are here
  (a pip-installed package has neither)."""
  return _INSTANTIATIONS.is_file() and _GEMM_INSTANTIATIONS.is_file() and (
      _INSTANTIATIONS.parent.parent.parent / "cpp" / "metal" / "emulator" / "msl_prepass.py"
  ).is_file()

# MLX's function-constant indices and buffer indices of the steel attention
# kernel (mlx/backend/metal/kernels/steel/attn/kernels/steel_attention.h).
_FC_ALIGN_Q, _FC_ALIGN_K = 200, 201
_FC_HAS_MASK, _FC_DO_CAUSAL, _FC_HAS_SINKS, _FC_SAVE_LSE = 300, 301, 302, 303
_BUF_Q, _BUF_K, _BUF_V, _BUF_O, _BUF_PARAMS = 0, 1, 2, 3, 4
_BUF_MASK_PARAMS, _BUF_MASK, _BUF_LSE = 5, 6, 8


class MlxUnavailable(RuntimeError):
  """MLX's kernel headers could not be obtained (no network, no pip, bad hash)."""


def _sha256(path: Path) -> str:
  h = hashlib.sha256()
  with open(path, "rb") as f:
    for block in iter(lambda: f.read(1 << 20), b""):
      h.update(block)
  return h.hexdigest()


def _download_wheel(dest: Path) -> Path:
  local = os.environ.get("JAX_FATRAIN_MLX_METAL_WHEEL")
  if local:
    return Path(local)
  cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
         "--only-binary=:all:", "--platform", "macosx_14_0_arm64", "--python-version", "3.11",
         f"mlx-metal=={MLX_METAL_VERSION}", "-d", str(dest)]
  try:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
  except (OSError, subprocess.TimeoutExpired) as e:
    raise MlxUnavailable(f"could not run pip to download mlx-metal=={MLX_METAL_VERSION}: {e}")
  wheel = dest / MLX_METAL_WHEEL
  if proc.returncode != 0 or not wheel.is_file():
    tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-3:])
    raise MlxUnavailable(f"pip could not download mlx-metal=={MLX_METAL_VERSION} (offline?): "
                         f"{tail}")
  return wheel


def fetch_mlx_kernels() -> Path:
  """The include root of MLX's Metal kernels (it contains mlx/backend/metal/kernels/).

  Downloads and unpacks the pinned mlx-metal wheel on first use; raises
  MlxUnavailable with the reason when that is impossible.
  """
  root = msl_standalone.cache_root() / f"mlx-metal-{MLX_METAL_VERSION}"
  marker = root / ".sha256"
  if marker.is_file() and marker.read_text().strip() == MLX_METAL_SHA256:
    return root / "include"
  root.parent.mkdir(parents=True, exist_ok=True)
  with tempfile.TemporaryDirectory(prefix="fatrain_mlx_", dir=root.parent) as tmp:
    wheel = _download_wheel(Path(tmp))
    if not wheel.is_file():
      raise MlxUnavailable(f"no mlx-metal wheel at {wheel}")
    digest = _sha256(wheel)
    if digest != MLX_METAL_SHA256:
      raise MlxUnavailable(f"{wheel.name}: SHA-256 {digest}, expected {MLX_METAL_SHA256}")
    staging = Path(tmp) / "unpacked"
    with zipfile.ZipFile(wheel) as z:
      for info in z.infolist():
        name = info.filename
        if not name.startswith(_KERNELS_IN_WHEEL) or name.endswith("/"):
          continue
        rel = Path(name[len("mlx/include/"):])
        if rel.is_absolute() or ".." in rel.parts:
          raise MlxUnavailable(f"{wheel.name}: unexpected member {name}")
        target = staging / "include" / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        with z.open(info) as src, open(target, "wb") as dst:
          shutil.copyfileobj(src, dst)
    (staging / ".sha256").write_text(MLX_METAL_SHA256 + "\n")
    if root.exists():
      shutil.rmtree(root)
    os.replace(staging, root)
  return root / "include"


_DTYPE_NAMES = {"float32": "float32", "float16": "float16", "bfloat16": "bfloat16"}


def mlx_tiles(head_dim: int, dtype=None, ultra: bool = False) -> tuple[int, int, int, int]:
  """(BQ, BK, WM, WN) of MLX's steel attention forward at this head dim.

  As mlx-metal 0.32.4's host chooses them: 32 query rows per threadgroup over
  WM = 4 simdgroups; 32-key tiles below D = 128, else 16; at D = 256 the head
  dimension is split over WN = 2 simdgroups, and on M*-Ultra GPUs (``ultra``)
  half and bfloat16 take 32-key tiles there. (On GPUs with neural
  accelerators MLX uses a different kernel.)
  """
  if head_dim not in (64, 128, 256):
    raise ValueError(f"MLX's forward is instantiated here for D = 64, 128, 256, not {head_dim}")
  bk = 32 if head_dim < 128 else 16
  if head_dim == 256 and ultra and dtype is not None and np.dtype(dtype).itemsize == 2:
    bk = 32
  return 32, bk, 4, (2 if head_dim == 256 else 1)


def mlx_kernel_name(dtype, head_dim: int, mask_dtype=None, ultra: bool = False) -> str:
  """MLX's host name of the kernel for this input dtype, head dim and mask dtype.

  ``mask_dtype`` None (no mask) or the input dtype (additive mask) selects the
  kernel whose mask type is the input type, ``bool`` the boolean-mask one.
  """
  name = _DTYPE_NAMES[np.dtype(dtype).name]
  bq, bk, wm, wn = mlx_tiles(head_dim, dtype, ultra)
  if mask_dtype is None or np.dtype(mask_dtype) != np.dtype(bool):
    mname = name
  else:
    mname = "bool_"
  return (f"steel_attention_{name}_bq{bq}_bk{bk}_bd{head_dim}_bv{head_dim}_wm{wm}_wn{wn}"
          f"_mask{mname}")


class _AttnParams(ctypes.Structure):
  # MLX's AttnParams (steel/attn/params.h): 152 bytes, checked against the
  # fetched header by a static_assert in the instantiation file.
  _fields_ = [("B", ctypes.c_int), ("H", ctypes.c_int), ("D", ctypes.c_int),
              ("qL", ctypes.c_int), ("kL", ctypes.c_int), ("gqa_factor", ctypes.c_int),
              ("scale", ctypes.c_float),
              ("NQ", ctypes.c_int), ("NK", ctypes.c_int),
              ("NQ_aligned", ctypes.c_int), ("NK_aligned", ctypes.c_int),
              ("qL_rem", ctypes.c_int), ("kL_rem", ctypes.c_int), ("qL_off", ctypes.c_int),
              ("Q_strides", ctypes.c_int64 * 3), ("K_strides", ctypes.c_int64 * 3),
              ("V_strides", ctypes.c_int64 * 3), ("O_strides", ctypes.c_int64 * 3)]


class _AttnMaskParams(ctypes.Structure):
  _fields_ = [("M_strides", ctypes.c_int64 * 3)]


assert ctypes.sizeof(_AttnParams) == 152 and ctypes.sizeof(_AttnMaskParams) == 24


def _library(kernel: str, instantiations: Path = _INSTANTIATIONS):
  if not instantiations.is_file():
    raise msl_standalone.BuildError(
        f"running MLX's kernel needs a source checkout of jax_fatrain ({instantiations} "
        f"not found)")
  include = fetch_mlx_kernels()
  return msl_standalone.build_library(instantiations, include_dirs=[include], kernels=[kernel])


def _element_strides(a: np.ndarray) -> tuple[int, ...]:
  return tuple(s // a.itemsize for s in a.strides)


def mlx_attention_forward(q, k, v, *, scale: float, causal: bool = False, mask=None,
                          return_lse: bool = False, worker_threads: int = 0,
                          counters: dict | None = None, sample: float | int | None = None,
                          ultra: bool = False):
  """O = softmax(scale * Q K^T + mask) V by MLX's steel attention kernel.

  Layout [B, H, L, D] (MLX's), numpy arrays (or anything np.asarray takes)
  of float32, float16 or bfloat16; K and V may have fewer heads (GQA,
  H_q % H_kv == 0). ``causal`` is MLX's: aligned to the bottom-right corner
  (query i sees keys j <= i + S - T), the same as top-left when T == S.
  ``mask`` broadcasts to [B, H_q, T, S]: bool (True keeps a score) or
  additive. With ``return_lse`` also returns MLX's logsumexp [B, H_q, T]
  (natural log, float32).

  ``counters``, if given, receives the dispatch's record in the format of
  :mod:`jax_fatrain.emulator.profile` (counters, ``race_reports``,
  ``sampled_fraction``, ...). ``sample`` (a fraction of the threadgroups, or
  at most that many) runs only part of the grid, spread over query tiles: for
  counting only, O is then incomplete. ``ultra``: the kernel MLX picks on an
  M*-Ultra GPU.
  """
  q, k, v = (np.asarray(x) for x in (q, k, v))
  if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
    raise ValueError("q, k, v must be [B, H, L, D]")
  if not (q.dtype == k.dtype == v.dtype) or q.dtype.name not in _DTYPE_NAMES:
    raise ValueError(f"q, k, v must share one of float32/float16/bfloat16, got "
                     f"{q.dtype}, {k.dtype}, {v.dtype}")
  B, H, T, D = q.shape
  Hk, S = k.shape[1], k.shape[2]
  if k.shape != (B, Hk, S, D) or v.shape != k.shape or H % Hk != 0:
    raise ValueError(f"incompatible shapes q {q.shape}, k {k.shape}, v {v.shape}")
  q, k, v = (np.ascontiguousarray(x) for x in (q, k, v))
  bq, bk, wm, wn = mlx_tiles(D, q.dtype, ultra)

  m = None
  if mask is not None:
    m = np.asarray(mask)
    if m.dtype != np.bool_:
      m = m.astype(q.dtype)
    if m.ndim > 4:
      raise ValueError(f"mask shape {m.shape} does not broadcast to {(B, H, T, S)}")
    m = m.reshape((1,) * (4 - m.ndim) + m.shape)
    if any(n not in (1, full) for n, full in zip(m.shape, (B, H, T, S))):
      raise ValueError(f"mask shape {m.shape} does not broadcast to {(B, H, T, S)}")
    if m.shape[3] != S:  # the kernel reads the key axis with stride 1
      m = np.broadcast_to(m, m.shape[:3] + (S,))
    m = np.ascontiguousarray(m)
  kernel = mlx_kernel_name(q.dtype, D, None if m is None else m.dtype, ultra)
  lib = _library(kernel)

  o = np.full(q.shape, np.nan, dtype=q.dtype)  # poisoned: unwritten elements show
  nq, nk = -(-T // bq), -(-S // bk)
  p = _AttnParams()
  p.B, p.H, p.D, p.qL, p.kL, p.gqa_factor, p.scale = B, H, D, T, S, H // Hk, scale
  p.NQ, p.NK, p.NQ_aligned, p.NK_aligned = nq, nk, T // bq, S // bk
  p.qL_rem, p.kL_rem, p.qL_off = T - (T // bq) * bq, S - (S // bk) * bk, S - T
  for field, a in (("Q_strides", q), ("K_strides", k), ("V_strides", v), ("O_strides", o)):
    getattr(p, field)[:] = _element_strides(a)[:3]
  buffers = {_BUF_Q: q, _BUF_K: k, _BUF_V: v, _BUF_O: o, _BUF_PARAMS: bytes(p)}
  if m is not None:
    mp = _AttnMaskParams()
    mp.M_strides[:] = [0 if m.shape[i] == 1 else _element_strides(m)[i] for i in range(3)]
    buffers[_BUF_MASK_PARAMS] = bytes(mp)
    buffers[_BUF_MASK] = m
  lse = None
  if return_lse:
    lse = np.full((B, H, T), np.nan, dtype=np.float32)
    buffers[_BUF_LSE] = lse
  constants = {_FC_ALIGN_Q: T % bq == 0, _FC_ALIGN_K: S % bk == 0, _FC_HAS_MASK: m is not None,
               _FC_DO_CAUSAL: bool(causal), _FC_HAS_SINKS: False, _FC_SAVE_LSE: return_lse}
  record = lib.dispatch(kernel, buffers=buffers, constants=constants, grid=(nq, H, B),
                        threadgroup=(32, wm, wn), worker_threads=worker_threads,
                        count=counters is not None, sample=sample)
  if counters is not None:
    counters.update(record)
  return (o, lse) if return_lse else o


# ---------------------------------------------------------------------------
# Steel GEMM
# ---------------------------------------------------------------------------

# Function constants and buffer indices of steel_gemm_fused.h.
_GEMM_FC_HAS_BATCH, _GEMM_FC_USE_OUT_SOURCE, _GEMM_FC_DO_AXPBY = 10, 100, 110
_GEMM_FC_ALIGN_M, _GEMM_FC_ALIGN_N, _GEMM_FC_ALIGN_K = 200, 201, 202


def mlx_gemm_tiles(device_class: str, dtype, M: int, N: int, K: int, batch: int = 1,
                   transpose_a: bool = False, transpose_b: bool = False
                   ) -> tuple[int, int, int, int, int]:
  """(BM, BN, BK, WM, WN) of MLX's steel GEMM, as ``GEMM_TPARAM_MACRO`` picks them.

  ``device_class`` is the last letter of the GPU's architecture name:
  ``"g"`` for the base chips (M1, M2, ... ``applegpu_g13g``), ``"d"`` for the
  Ultras, anything else (Pro and Max, e.g. ``applegpu_g13s`` on an M1 Max) the
  medium class.
  """
  half = np.dtype(dtype).itemsize == 2
  nt = not transpose_a and transpose_b
  tiles = (64, 64, 16, 2, 2)  # the default, also the medium class's choice
  if device_class in ("g", "p"):
    if nt:
      tiles = (64, 32, 32, 2, 2)
    elif half:
      tiles = (64, 64, 16, 1, 2)
  elif device_class == "d":
    if batch * M * N >= 1 << 20:
      if half:
        if 2 * max(M, N) > K:
          tiles = (64, 64, 16, 1, 2)
        elif nt:
          tiles = (64, 32, 32, 2, 2)
        else:
          tiles = (32, 64, 16, 1, 2)
    elif half:
      tiles = (64, 32, 32, 2, 2) if nt else (64, 64, 16, 1, 2)
    else:
      tiles = (32, 64, 16, 1, 2) if nt else (64, 32, 32, 2, 2)
  return tiles


def mlx_gemm_kernel_name(dtype, tiles: tuple[int, int, int, int, int],
                         transpose_a: bool = False, transpose_b: bool = False) -> str:
  name = _DTYPE_NAMES[np.dtype(dtype).name]
  bm, bn, bk, wm, wn = tiles
  return (f"steel_gemm_fused_{'t' if transpose_a else 'n'}{'t' if transpose_b else 'n'}_"
          f"{name}_{name}_bm{bm}_bn{bn}_bk{bk}_wm{wm}_wn{wn}")


class _GemmParams(ctypes.Structure):
  # MLX's GEMMParams (steel/gemm/params.h): 72 bytes, checked against the
  # fetched header by a static_assert in the instantiation file.
  _fields_ = [("M", ctypes.c_int), ("N", ctypes.c_int), ("K", ctypes.c_int),
              ("lda", ctypes.c_int), ("ldb", ctypes.c_int), ("ldd", ctypes.c_int),
              ("tiles_n", ctypes.c_int), ("tiles_m", ctypes.c_int),
              ("batch_stride_a", ctypes.c_int64), ("batch_stride_b", ctypes.c_int64),
              ("batch_stride_d", ctypes.c_int64), ("swizzle_log", ctypes.c_int),
              ("gemm_k_iterations_aligned", ctypes.c_int), ("batch_ndim", ctypes.c_int)]


assert ctypes.sizeof(_GemmParams) == 72


def mlx_gemm(a, b, *, transpose_b: bool = False, device_class: str = "s",
             worker_threads: int = 0, counters: dict | None = None,
             sample: float | int | None = None,
             tiles: tuple[int, int, int, int, int] | None = None):
  """A @ B (or A @ B^T with ``transpose_b``) by MLX's steel GEMM kernel.

  ``a`` is [M, K] or [batch, M, K] and ``b`` [K, N] (or [N, K] transposed),
  with the same leading batch dimension if any, row-major numpy arrays of one
  of float32/float16/bfloat16. Tiles as MLX picks them for ``device_class``
  (``mlx_gemm_tiles``), grid (tiles_n, tiles_m, batch) and threadgroup (32,
  WN, WM) as ``steel_matmul_regular_axpby`` sets them (no swizzle, one batch
  dimension, no C input). ``counters`` and ``sample`` as in
  ``mlx_attention_forward``; ``tiles`` overrides the choice (the tiles MLX
  picks for a larger problem run on a part of it).
  """
  a, b = np.ascontiguousarray(a), np.ascontiguousarray(b)
  if (a.ndim not in (2, 3) or b.ndim != a.ndim or a.dtype != b.dtype
      or a.dtype.name not in _DTYPE_NAMES or (a.ndim == 3 and a.shape[0] != b.shape[0])):
    raise ValueError(f"a, b must be 2-D (or 3-D with one batch) arrays of one float dtype, got "
                     f"{a.shape} {a.dtype}, {b.shape} {b.dtype}")
  batch = a.shape[0] if a.ndim == 3 else 1
  M, K = a.shape[-2:]
  N = b.shape[-2] if transpose_b else b.shape[-1]
  if (b.shape[-1] if transpose_b else b.shape[-2]) != K:
    raise ValueError(f"incompatible shapes {a.shape} and {b.shape} (transpose_b={transpose_b})")
  if tiles is None:
    tiles = mlx_gemm_tiles(device_class, a.dtype, M, N, K, batch, False, transpose_b)
  bm, bn, bk, wm, wn = tiles
  kernel = mlx_gemm_kernel_name(a.dtype, tiles, False, transpose_b)
  lib = _library(kernel, _GEMM_INSTANTIATIONS)
  d = np.full(a.shape[:-1] + (N,), np.nan, dtype=a.dtype)
  tn, tm = -(-N // bn), -(-M // bm)
  p = _GemmParams(M, N, K, K, K if transpose_b else N, N, tn, tm, M * K, K * N, M * N, 0,
                  K // bk, 1 if a.ndim == 3 else 0)
  constants = {_GEMM_FC_HAS_BATCH: False, _GEMM_FC_USE_OUT_SOURCE: False,
               _GEMM_FC_DO_AXPBY: False, _GEMM_FC_ALIGN_M: M % bm == 0,
               _GEMM_FC_ALIGN_N: N % bn == 0, _GEMM_FC_ALIGN_K: K % bk == 0}
  # MLX's kernel reads its epilogue's alpha and beta even without a C input
  # (Apple's compiler drops the unused reads; the emulator needs data there).
  addmm = struct.pack("<iiqff", N, 1, M * N, 1.0, 0.0)  # GEMMAddMMParams, 24 bytes
  record = lib.dispatch(kernel, buffers={0: a, 1: b, 3: d, 4: bytes(p), 5: addmm},
                        constants=constants, grid=(tn, tm, batch), threadgroup=(32, wn, wm),
                        worker_threads=worker_threads, count=counters is not None,
                        sample=sample)
  if counters is not None:
    counters.update(record)
  return d
