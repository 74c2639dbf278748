"""The ``metal_emulated`` implementation: the Metal kernels on the MSL emulator.

``jax_fatrain/metal/*.metal`` run, unmodified, through the MSL emulator
(``cpp/metal/emulator``) driven by the Metal dispatch plan (``cpp/metal/plan``),
as XLA FFI calls on the ``cpu`` platform. It exists to test the Metal kernels
off-Mac and is slow (every GPU thread is a CPU fiber).

The Python-side adaptations (head-dim padding, bias/mask folding, key-axis
expansion) and the bias gradient (the CPU backend's) are shared with the
macOS ``metal`` implementation: ``_metal_common.py``.
"""

from __future__ import annotations

from jax_fatrain._backends import _ffi, _metal_common
from jax_fatrain._registry import Implementation

# Missing when not built (JAX_FATRAIN_METAL_EMULATOR=OFF) or broken.
_EXTENSION = _ffi.Extension("_metal_emulated_ffi", "metal_emulated", "cpu",
                            lambda e: f"the MSL emulator extension is not built ({e})")
IMPORT_ERROR = _EXTENSION.import_error
_extension, _register_targets = _EXTENSION.get, _EXTENSION.register_targets

MAX_HEAD_DIM = _metal_common.MAX_HEAD_DIM

_FORWARD = "jax_fatrain_metal_emulated_forward"
_BACKWARD = "jax_fatrain_metal_emulated_backward"


def selftest() -> tuple[int, str]:
  """Runs the emulator's self-test: (number of failed checks, log)."""
  return _extension().selftest()


def kernel_names() -> list[str]:
  """Kernels compiled into the emulator extension."""
  return list(_extension().kernel_names())


def planned_kernel_names() -> list[str]:
  """Every kernel name the Metal dispatch plan can ask for."""
  return list(_extension().planned_kernel_names())


def forward(q, k, v, bias, mask, q_lengths, kv_lengths, config, q_segment_ids=None,
            kv_segment_ids=None):
  _register_targets()
  return _metal_common.forward(_FORWARD, "metal_emulated", q, k, v, bias, mask, q_lengths,
                              kv_lengths, config, q_segment_ids, kv_segment_ids)


def backward(q, k, v, bias, mask, q_lengths, kv_lengths, o, lse, d_o, config,
             q_segment_ids=None, kv_segment_ids=None):
  _register_targets()
  return _metal_common.backward(_BACKWARD, "metal_emulated", q, k, v, bias, mask, q_lengths,
                               kv_lengths, o, lse, d_o, config, q_segment_ids, kv_segment_ids)


bias_grad = _metal_common.bias_grad


# The Metal kernels on the MSL emulator (a test tool; never chosen by default).
IMPLEMENTATION = None if IMPORT_ERROR is not None else Implementation(
    "metal_emulated", forward, backward, bias_grad, max_head_dim=MAX_HEAD_DIM,
    platforms=("cpu",))
