"""The ``cpu`` implementation: XLA FFI calls into the C++ kernels of cpp/cpu/.

The three functions here have the signature every implementation shares (see
``_config.py``); shapes of the results are computed here, before any kernel runs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jax_fatrain._config import AttentionConfig

try:
  from jax_fatrain import _cpu_ffi
except ImportError as e:  # pragma: no cover - only on a broken install
  _cpu_ffi = None
  IMPORT_ERROR = str(e)
else:
  IMPORT_ERROR = None

MAX_HEAD_DIM = 256

# Must match kLayoutBTNH / kLayoutBNTH in cpp/ffi/cpu_ffi.cc.
_LAYOUT_CODES = {"BTNH": 0, "BNTH": 1}

_FORWARD = "jax_fatrain_cpu_forward"
_BACKWARD = "jax_fatrain_cpu_backward"
_BIAS_GRAD = "jax_fatrain_cpu_bias_grad"

_registered = False


def _register_targets() -> None:
  global _registered
  if _registered:
    return
  if _cpu_ffi is None:
    raise RuntimeError(f"jax_fatrain's CPU extension failed to import: {IMPORT_ERROR}")
  for name, capsule in _cpu_ffi.registrations().items():
    jax.ffi.register_ffi_target(name, capsule, platform="cpu")
  _registered = True


def selected_isa() -> str:
  """The instruction set the CPU kernels use on this machine."""
  if _cpu_ffi is None:
    raise RuntimeError(f"jax_fatrain's CPU extension failed to import: {IMPORT_ERROR}")
  return _cpu_ffi.selected_isa()


# Absent optional operands are passed as empty placeholders; the attributes say
# which ones are real.
def _placeholder(dtype):
  return jnp.zeros((0,), dtype)


def _operands(bias, mask, q_lengths, kv_lengths):
  return (
      _placeholder(jnp.float32) if bias is None else bias,
      _placeholder(jnp.bool_) if mask is None else mask,
      _placeholder(jnp.int32) if q_lengths is None else q_lengths,
      _placeholder(jnp.int32) if kv_lengths is None else kv_lengths,
  )


def _attributes(config: AttentionConfig, bias, mask, q_lengths, kv_lengths):
  return dict(
      scale=np.float32(config.scale),
      is_causal=bool(config.is_causal),
      window_left=np.int64(config.window_left),
      window_right=np.int64(config.window_right),
      layout=np.int32(_LAYOUT_CODES[config.layout]),
      has_bias=bias is not None,
      has_mask=mask is not None,
      has_q_lengths=q_lengths is not None,
      has_kv_lengths=kv_lengths is not None,
  )


def _lse_shape(q, config: AttentionConfig):
  b = q.shape[0]
  t, n = q.shape[config.seq_axis], q.shape[config.head_axis]
  return jax.ShapeDtypeStruct((b, n, t), jnp.float32)


def forward(q, k, v, bias, mask, q_lengths, kv_lengths, config):
  _register_targets()
  call = jax.ffi.ffi_call(
      _FORWARD,
      (jax.ShapeDtypeStruct(q.shape, q.dtype), _lse_shape(q, config)),
  )
  return call(q, k, v, *_operands(bias, mask, q_lengths, kv_lengths),
              **_attributes(config, bias, mask, q_lengths, kv_lengths))


def backward(q, k, v, bias, mask, q_lengths, kv_lengths, o, lse, d_o, config):
  _register_targets()
  call = jax.ffi.ffi_call(
      _BACKWARD,
      (jax.ShapeDtypeStruct(q.shape, q.dtype),
       jax.ShapeDtypeStruct(k.shape, k.dtype),
       jax.ShapeDtypeStruct(v.shape, v.dtype)),
  )
  return call(q, k, v, *_operands(bias, mask, q_lengths, kv_lengths), o, lse, d_o,
              **_attributes(config, bias, mask, q_lengths, kv_lengths))


def bias_grad(q, k, v, bias, mask, q_lengths, kv_lengths, o, lse, d_o, config):
  _register_targets()
  call = jax.ffi.ffi_call(_BIAS_GRAD, jax.ShapeDtypeStruct(bias.shape, jnp.float32))
  return call(q, k, v, *_operands(bias, mask, q_lengths, kv_lengths), o, lse, d_o,
              **_attributes(config, bias, mask, q_lengths, kv_lengths))
