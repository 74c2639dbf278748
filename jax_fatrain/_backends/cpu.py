"""The ``cpu`` implementation: XLA FFI calls into the C++ kernels of cpp/cpu/.

Its forward, backward and bias gradient are ``_ffi.stage_functions`` over the
extension's handlers (``jax_fatrain_cpu_*``); shapes of the results are computed
there, before any kernel runs.
"""

from __future__ import annotations

from jax_fatrain._backends import _ffi
from jax_fatrain._registry import Implementation

# Only a broken install lacks it.
_EXTENSION = _ffi.Extension("_cpu_ffi", "cpu", "cpu",
                            lambda e: f"the CPU extension failed to import: {e}")
IMPORT_ERROR = _EXTENSION.import_error
_extension, _register_targets = _EXTENSION.get, _EXTENSION.register_targets

MAX_HEAD_DIM = 256


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


forward, backward, bias_grad = _ffi.stage_functions("jax_fatrain_cpu", _register_targets)


IMPLEMENTATION = None if IMPORT_ERROR is not None else Implementation(
    "cpu", forward, backward, bias_grad, max_head_dim=MAX_HEAD_DIM, platforms=("cpu",))
