"""The ``cuda`` implementation: XLA FFI calls into the CUDA kernels of cpp/cuda/.

Like ``cpu.py``, ``_ffi.stage_functions`` over the extension's handlers
(``jax_fatrain_cuda_*``), plus a ``deterministic`` attribute and a scratch
result each handler needs (sized by the extension). The extension ``_cuda_ffi`` is optional: it is built only
with ``-C cmake.define.JAX_FATRAIN_CUDA=ON`` where nvcc exists, and without it
``IMPORT_ERROR`` says why ``implementation="cuda"`` is unavailable.

Determinism: by default the backward accumulates dQ with float32 atomics (the
FA-2 scheme; the last bits of dQ may differ between runs when several KV tiles
contribute to a row). ``deterministic=True`` (the public keyword, carried in
``AttentionConfig.deterministic``) computes dQ in a separate Q-tile-outer
kernel instead: bitwise reproducible, somewhat slower.
The bias gradient is always deterministic.
"""

from __future__ import annotations

import contextlib
import importlib.util

import jax
import jax.numpy as jnp

from jax_fatrain._backends import _ffi
from jax_fatrain._config import AttentionConfig
from jax_fatrain._registry import Implementation

_BUILD_HINT = ("build with -C cmake.define.JAX_FATRAIN_CUDA=ON on a machine with "
               "nvcc; it runs on NVIDIA GPUs sm_80 and newer")
if importlib.util.find_spec("jax_fatrain._cuda_ffi") is None:
  _cuda_ffi = None
  IMPORT_ERROR = f"the CUDA extension is not part of this build ({_BUILD_HINT})"
else:
  try:
    from jax_fatrain import _cuda_ffi
  except ImportError as e:
    _cuda_ffi = None
    IMPORT_ERROR = f"the CUDA extension failed to import: {e}"
  else:
    IMPORT_ERROR = None

MAX_HEAD_DIM = 256

_registered: set = set()


def gpu_present() -> bool:
  """Whether the extension is built and JAX sees a CUDA GPU."""
  if _cuda_ffi is None:
    return False
  try:
    return len(jax.devices("cuda")) > 0
  except RuntimeError:
    return False


def has_tensor_core_kernels(dtype, head_dim: int) -> bool:
  """Whether problems of this dtype and head dim run on tensor cores here
  (else on the float32 SIMT kernels, exact but slow)."""
  if _cuda_ffi is None:
    return False
  return _cuda_ffi.selected_path(jnp.dtype(dtype).name, int(head_dim)) == "tensor_core"


@contextlib.contextmanager
def recording_launches():
  """Records which of our CUDA kernels run inside the ``with`` block (a test tool).

  Several kernels can serve one problem (``cpp/cuda/kernel_choice.h``); a
  test that expects one checks that it ran::

    with _cuda.recording_launches() as launched:
      jax.block_until_ready(f(q, k, v))
    assert any("bwd_ws_cluster_pair_kernel" in name for name in launched)

  ``launched`` is filled when the block exits with the names of the kernels
  launched since it began, oldest first, demangled where the C++ runtime can
  (``"void fatrain::cuda::(anonymous namespace)::bwd_ws_kernel<__nv_bfloat16,
  64, true, 0, 128>(...)"``), else as the CUDA runtime gives them. Kernels are launched when XLA runs a computation,
  so block on its results inside the ``with``. Not for concurrent use: the
  record is one per process.
  """
  if _cuda_ffi is None:
    raise RuntimeError(f"jax_fatrain's CUDA backend is unavailable: {IMPORT_ERROR}")
  launched: list[str] = []
  _cuda_ffi.take_launch_record()  # drop anything recorded before
  _cuda_ffi.set_launch_recording(True)
  try:
    yield launched
  finally:
    _cuda_ffi.set_launch_recording(False)
    launched.extend(_cuda_ffi.take_launch_record())


@contextlib.contextmanager
def counting_tile_visits():
  """Counts the tiles our tensor-core kernels visit inside the ``with`` block
  (a test tool, process-wide): what causality, windows and segment ids let
  them skip. ``visits`` is filled when the block exits::

    with _cuda.counting_tile_visits() as visits:
      jax.block_until_ready(grad(q, k, v))
    visits  # {"forward": tiles, "backward": tiles}

  Each block adds the length of the tile range it walks (the key tiles of its
  query rows; in the backward the query tiles of its keys) once per work
  item. The units are each kernel's own tiles, so compare only counts of one
  kernel family on one shape; the float32 SIMT kernels count nothing.
  """
  if _cuda_ffi is None:
    raise RuntimeError(f"jax_fatrain's CUDA backend is unavailable: {IMPORT_ERROR}")
  visits: dict[str, int] = {}
  _cuda_ffi.set_tile_visit_counting(True)
  _cuda_ffi.take_tile_visits()  # drop anything counted before
  try:
    yield visits
  finally:
    visits.update(_cuda_ffi.take_tile_visits())
    _cuda_ffi.set_tile_visit_counting(False)


@contextlib.contextmanager
def kernel_family(name: str):
  """Caps the kernel families our CUDA launches use inside the ``with`` block
  (a test tool, process-wide): ``"hopper"`` (no cap, the default),
  ``"mma_sync"`` (the sm_80 kernels, so that both run on one Hopper GPU) or
  ``"simt"``. ``cpp/cuda/kernel_choice.h`` has the rules within a family."""
  if _cuda_ffi is None:
    raise RuntimeError(f"jax_fatrain's CUDA backend is unavailable: {IMPORT_ERROR}")
  _cuda_ffi.set_fastest_kernel_family(name)
  try:
    yield
  finally:
    _cuda_ffi.set_fastest_kernel_family("hopper")


def _register_targets() -> None:
  if _cuda_ffi is None:
    raise RuntimeError(f"jax_fatrain's CUDA backend is unavailable: {IMPORT_ERROR}")
  _ffi.register_targets(_cuda_ffi, "CUDA", _registered)


def _workspace(q, k, config: AttentionConfig, stage: str, q_segment_ids):
  """The uint8 scratch result a stage's handler needs (sized by the extension)."""
  b, t, n, d = (q.shape[0], q.shape[config.seq_axis], q.shape[config.head_axis],
                q.shape[3])
  size = _cuda_ffi.scratch_bytes(stage, b, n, t, d, config.deterministic,
                                 k.shape[config.seq_axis], q_segment_ids is not None)
  return _ffi.result((size,), jnp.uint8, q)


forward, backward, bias_grad = _ffi.stage_functions(
    "jax_fatrain_cuda", _register_targets, workspace=_workspace,
    extra_attributes=lambda config: dict(deterministic=config.deterministic))


# Our CUDA kernels behind FFI handlers on the CUDA platform.
IMPLEMENTATION = None if IMPORT_ERROR is not None else Implementation(
    "cuda", forward, backward, bias_grad, max_head_dim=MAX_HEAD_DIM, platforms=("cuda",))
