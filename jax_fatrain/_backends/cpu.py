"""The ``cpu`` implementation: XLA FFI calls into the C++ kernels of cpp/cpu/.

The three functions here have the signature every implementation shares (see
``_config.py``); shapes of the results are computed here, before any kernel runs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_fatrain._backends import _ffi
from jax_fatrain._registry import Implementation

try:
  from jax_fatrain import _cpu_ffi
except ImportError as e:  # pragma: no cover - only on a broken install
  _cpu_ffi = None
  IMPORT_ERROR = f"the CPU extension failed to import: {e}"
else:
  IMPORT_ERROR = None

MAX_HEAD_DIM = 256

_FORWARD = "jax_fatrain_cpu_forward"
_BACKWARD = "jax_fatrain_cpu_backward"
_BIAS_GRAD = "jax_fatrain_cpu_bias_grad"

_registered: set = set()


def _extension():
  if _cpu_ffi is None:
    raise RuntimeError(f"implementation 'cpu' is not available: {IMPORT_ERROR}")
  return _cpu_ffi


def _register_targets() -> None:
  _ffi.register_targets(_extension(), "cpu", _registered)


def selected_isa() -> str:
  """The instruction set the CPU kernels use on this machine."""
  return _extension().selected_isa()


def tile_visits(reset: bool = False) -> dict[str, int]:
  """Tiles (query tile x key tile pairs) each pass has computed, process-wide:
  ``{"forward", "backward_dq", "backward_dkdv", "bias_grad"}``; tiles the
  kernels skip (masked out by causality, windows, lengths or segment ids) are
  not counted. ``reset=True`` also sets the counts to zero. A test tool."""
  return dict(_extension().tile_visits(reset))


def tile_sizes() -> tuple[int, int]:
  """(query rows, keys) per tile of the CPU kernels."""
  return tuple(_extension().tile_sizes())


def forward(q, k, v, bias, mask, q_lengths, kv_lengths, config, q_segment_ids=None,
            kv_segment_ids=None):
  _register_targets()
  call = jax.ffi.ffi_call(
      _FORWARD, (_ffi.result(q.shape, q.dtype, q), _ffi.lse_result(q, config)))
  return call(q, k, v, *_ffi.optional_operands(bias, mask, q_lengths, kv_lengths,
                                               q_segment_ids, kv_segment_ids),
              **_ffi.attributes(config, bias, mask, q_lengths, kv_lengths, q_segment_ids))


def backward(q, k, v, bias, mask, q_lengths, kv_lengths, o, lse, d_o, config,
             q_segment_ids=None, kv_segment_ids=None):
  _register_targets()
  call = jax.ffi.ffi_call(
      _BACKWARD,
      (_ffi.result(q.shape, q.dtype, q), _ffi.result(k.shape, k.dtype, k),
       _ffi.result(v.shape, v.dtype, v)))
  return call(q, k, v, *_ffi.optional_operands(bias, mask, q_lengths, kv_lengths,
                                               q_segment_ids, kv_segment_ids),
              o, lse, d_o,
              **_ffi.attributes(config, bias, mask, q_lengths, kv_lengths, q_segment_ids))


def bias_grad(q, k, v, bias, mask, q_lengths, kv_lengths, o, lse, d_o, config,
              q_segment_ids=None, kv_segment_ids=None):
  _register_targets()
  call = jax.ffi.ffi_call(_BIAS_GRAD, _ffi.result(bias.shape, jnp.float32, bias))
  return call(q, k, v, *_ffi.optional_operands(bias, mask, q_lengths, kv_lengths,
                                               q_segment_ids, kv_segment_ids),
              o, lse, d_o,
              **_ffi.attributes(config, bias, mask, q_lengths, kv_lengths, q_segment_ids))


IMPLEMENTATION = None if IMPORT_ERROR is not None else Implementation(
    "cpu", forward, backward, bias_grad, max_head_dim=MAX_HEAD_DIM, platforms=("cpu",))
