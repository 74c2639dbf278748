"""The ``metal`` implementation: our MSL kernels on the Apple GPU (macOS).

jax-metal has no FFI (see docs/metal.md), so the handlers are XLA FFI targets
on the ``cpu`` platform: XLA:CPU gives them host pointers, and the C++ Metal
executor (cpp/metal/host/executor.cc) runs the kernels on that memory through
unified memory (bound in place when page aligned, else staged through pooled
shared buffers). Which dispatches to run comes from the portable dispatch
plan (cpp/metal/plan), the same one ``metal_emulated`` executes off-Mac; the
Python-side adaptations are shared with it (``_metal_common.py``).

The kernel library is compiled once per process from the packaged ``.metal``
sources (or loaded from ``metal/flash_attn.metallib`` when the build made
one), on first use.
"""

from __future__ import annotations

import os
import pathlib
import sys
import threading

from jax_fatrain._backends import _ffi, _metal_common
from jax_fatrain._registry import Implementation

METAL_DIR = pathlib.Path(__file__).resolve().parents[1] / "metal"
_SOURCES = ("flash_attn_train_fwd.metal", "flash_attn_train_bwd.metal")
METALLIB = "flash_attn.metallib"

try:
  from jax_fatrain import _metal_ffi
except ImportError as e:
  _metal_ffi = None
  if sys.platform != "darwin":
    IMPORT_ERROR = (f"it needs macOS with an Apple GPU (this is {sys.platform}; the Metal "
                    "host is only built on macOS). The Metal kernels run off-Mac, slowly, "
                    "as implementation='metal_emulated'")
  else:
    IMPORT_ERROR = f"jax_fatrain's Metal extension failed to import: {e}"
else:
  DEVICE_NAME = _metal_ffi.device_name()
  IMPORT_ERROR = _metal_ffi.unsupported_reason() or None

MAX_HEAD_DIM = _metal_common.MAX_HEAD_DIM

_FORWARD = "jax_fatrain_metal_forward"
_BACKWARD = "jax_fatrain_metal_backward"

_registered: set = set()
_init_lock = threading.Lock()
_init_error: str | None = None


def _inline_local_includes(name: str, seen: set[str]) -> str:
  """``name``'s text with its ``#include "..."`` of packaged headers inlined, once each."""
  out = [f'#line 1 "{name}"\n']
  for number, line in enumerate((METAL_DIR / name).read_text().splitlines(True), start=1):
    stripped = line.strip()
    if stripped == "#pragma once":
      out.append("\n")
    elif stripped.startswith('#include "') and stripped.endswith('"'):
      header = stripped[len('#include "'):-1]
      if header not in seen:
        seen.add(header)
        out.append(_inline_local_includes(header, seen))
        out.append(f'#line {number + 1} "{name}"\n')
      else:
        out.append("\n")
    else:
      out.append(line)
  return "".join(out)


def kernel_source() -> str:
  """The packaged .metal sources as one MSL translation unit (headers inlined)."""
  seen: set[str] = set()
  return "\n".join(_inline_local_includes(name, seen) for name in _SOURCES)


def _metallib_path() -> str:
  """A metallib built at install time, unless JAX_FATRAIN_METALLIB=0."""
  if os.environ.get("JAX_FATRAIN_METALLIB", "1") == "0":
    return ""
  candidates = [METAL_DIR / METALLIB]
  if _metal_ffi is not None:  # editable installs keep built files beside the extension
    candidates.append(pathlib.Path(_metal_ffi.__file__).resolve().parent / "metal" / METALLIB)
  for path in candidates:
    if path.is_file() and path.stat().st_size > 0:  # empty: the build could not make it
      return str(path)
  return ""


def _extension():
  if IMPORT_ERROR is not None:
    raise RuntimeError(f"implementation 'metal' is not available: {IMPORT_ERROR}")
  return _metal_ffi


def _initialize() -> None:
  global _init_error
  ext = _extension()
  with _init_lock:
    if _init_error is None:
      _init_error = ext.initialize(kernel_source(), _metallib_path())
  if _init_error:
    raise RuntimeError(f"jax_fatrain metal: {_init_error}")


def _register_targets() -> None:
  _initialize()
  _ffi.register_targets(_extension(), "cpu", _registered)


def forward(q, k, v, bias, mask, q_lengths, kv_lengths, config, q_segment_ids=None,
            kv_segment_ids=None):
  _register_targets()
  return _metal_common.forward(_FORWARD, "metal", q, k, v, bias, mask, q_lengths, kv_lengths,
                              config, q_segment_ids, kv_segment_ids)


def backward(q, k, v, bias, mask, q_lengths, kv_lengths, o, lse, d_o, config,
             q_segment_ids=None, kv_segment_ids=None):
  _register_targets()
  return _metal_common.backward(_BACKWARD, "metal", q, k, v, bias, mask, q_lengths, kv_lengths,
                               o, lse, d_o, config, q_segment_ids, kv_segment_ids)


bias_grad = _metal_common.bias_grad


# Our Metal kernels on the Apple GPU, behind FFI handlers on the cpu platform.
IMPLEMENTATION = None if IMPORT_ERROR is not None else Implementation(
    "metal", forward, backward, bias_grad, max_head_dim=MAX_HEAD_DIM, platforms=("cpu",))
