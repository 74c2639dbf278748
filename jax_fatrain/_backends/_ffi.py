"""What every FFI-backed implementation (cpu, cuda, metal, metal_emulated) shares.

The C++ handlers of all backends take the same operands in the same order
(q, k, v, bias, mask, q_lengths, kv_lengths, q_segment_ids, kv_segment_ids[, o,
lse, d_o]) and the same attribute dictionary (see ``Attributes`` in
cpp/ffi/attention_ffi.h); absent optional operands are passed as empty
placeholders and flagged by ``has_*``.
"""

from __future__ import annotations

import importlib
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jax_fatrain._config import AttentionConfig

# Must match kLayoutBTNH / kLayoutBNTH in the C++ handlers.
LAYOUT_CODES = {"BTNH": 0, "BNTH": 1}


def register_targets(extension, platform: str, registered: set) -> None:
  """Registers the extension's handlers with XLA once per process."""
  if extension.__name__ in registered:
    return
  for name, capsule in extension.registrations().items():
    jax.ffi.register_ffi_target(name, capsule, platform=platform)
  registered.add(extension.__name__)


class Extension:
  """A compiled extension an implementation calls, imported when its module loads.

  ``module`` is the extension, or None with ``import_error`` (``why(e)`` of the
  ImportError) saying why; ``get()`` returns it or raises that reason, and
  ``register_targets()`` registers its handlers with XLA on ``platform`` once.
  """

  _registered: set = set()

  def __init__(self, name: str, implementation: str, platform: str,
               why: Callable[[ImportError], str]):
    self.implementation, self.platform = implementation, platform
    try:
      self.module = importlib.import_module(f"jax_fatrain.{name}")
    except ImportError as e:
      self.module, self.import_error = None, why(e)
    else:
      self.import_error = None

  def get(self):
    if self.module is None:
      raise RuntimeError(f"implementation {self.implementation!r} is not available: "
                         f"{self.import_error}")
    return self.module

  def register_targets(self) -> None:
    register_targets(self.get(), self.platform, Extension._registered)


def optional_operands(bias, mask, q_lengths, kv_lengths, q_segment_ids=None,
                      kv_segment_ids=None):
  """The operands after q, k, v, placeholders for the absent ones."""
  placeholder = lambda dtype: jnp.zeros((0,), dtype)
  return (
      placeholder(jnp.float32) if bias is None else bias,
      placeholder(jnp.bool_) if mask is None else mask,
      placeholder(jnp.int32) if q_lengths is None else q_lengths,
      placeholder(jnp.int32) if kv_lengths is None else kv_lengths,
      placeholder(jnp.int32) if q_segment_ids is None else q_segment_ids,
      placeholder(jnp.int32) if kv_segment_ids is None else kv_segment_ids,
  )


def attributes(config: AttentionConfig, bias, mask, q_lengths, kv_lengths,
               q_segment_ids=None, **extra):
  return dict(
      scale=np.float32(config.scale),
      is_causal=bool(config.is_causal),
      window_left=np.int64(config.window_left),
      window_right=np.int64(config.window_right),
      layout=np.int32(LAYOUT_CODES[config.layout]),
      has_bias=bias is not None,
      has_mask=mask is not None,
      has_q_lengths=q_lengths is not None,
      has_kv_lengths=kv_lengths is not None,
      has_segment_ids=q_segment_ids is not None,
      **extra,
  )


def result(shape, dtype, like) -> jax.ShapeDtypeStruct:
  """A result type that varies over the same manual mesh axes as ``like``.

  Inside ``shard_map`` every value carries the set of mesh axes it varies
  over; an FFI result must declare it, or ``custom_vjp`` rejects the backward's
  cotangents ("manual axis types do not match").
  """
  aval = jax.typeof(like)
  if hasattr(aval, "manual_axis_type"):
    manual = aval.manual_axis_type
    varying = {"manual_axis_type": manual} if manual is not None and manual.varying else None
  else:
    # jax < 0.10 calls the same thing `vma`: the frozenset of varying axes.
    vma = getattr(aval, "vma", None)
    varying = {"vma": vma} if vma else None
  if varying is None:
    return jax.ShapeDtypeStruct(shape, dtype)
  # The declared axes must belong to the (abstract) mesh of the shard_map.
  sharding = jax.sharding.NamedSharding(aval.sharding.mesh, jax.sharding.PartitionSpec())
  return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding, **varying)


def lse_result(q, config: AttentionConfig) -> jax.ShapeDtypeStruct:
  """lse: float32 [B, N, T]."""
  b, t, n = q.shape[0], q.shape[config.seq_axis], q.shape[config.head_axis]
  return result((b, n, t), jnp.float32, q)


def ffi_call(target: str, results, q, k, v, bias, mask, q_lengths, kv_lengths,
             config: AttentionConfig, q_segment_ids, kv_segment_ids, *after, **extra):
  """Calls the FFI target ``target`` with the operands every handler takes (q, k,
  v, the optional ones, then ``after``: o, lse, d_o in the backward stages) and
  the shared attributes plus ``extra``; returns its ``results``."""
  return jax.ffi.ffi_call(target, results)(
      q, k, v, *optional_operands(bias, mask, q_lengths, kv_lengths, q_segment_ids,
                                  kv_segment_ids),
      *after, **attributes(config, bias, mask, q_lengths, kv_lengths, q_segment_ids, **extra))


def stage_functions(target_prefix: str, register: Callable[[], None], *,
                    workspace: Callable | None = None, extra_attributes: Callable | None = None):
  """(forward, backward, bias_grad) of an implementation whose C++ handlers
  are the FFI targets ``{target_prefix}_forward``, ``_backward`` and
  ``_bias_grad`` (cpu, cuda), with the signatures every implementation shares
  (``_registry.Implementation``).

  ``register()`` registers the targets (once) before a call is built.
  ``workspace(q, k, config, stage, q_segment_ids)``, where given, is one more
  result, the scratch memory the handler needs (dropped from what the
  functions return); ``extra_attributes(config)`` adds attributes.
  """

  def call(stage, results, q, k, v, bias, mask, q_lengths, kv_lengths, config, q_segment_ids,
           kv_segment_ids, *after):
    register()
    if workspace is not None:
      results = results + (workspace(q, k, config, stage, q_segment_ids),)
    extra = extra_attributes(config) if extra_attributes is not None else {}
    outs = ffi_call(f"{target_prefix}_{stage}", results, q, k, v, bias, mask, q_lengths,
                    kv_lengths, config, q_segment_ids, kv_segment_ids, *after, **extra)
    return outs[:-1] if workspace is not None else outs

  def forward(q, k, v, bias, mask, q_lengths, kv_lengths, config, q_segment_ids=None,
              kv_segment_ids=None):
    o, lse = call("forward", (result(q.shape, q.dtype, q), lse_result(q, config)), q, k, v,
                  bias, mask, q_lengths, kv_lengths, config, q_segment_ids, kv_segment_ids)
    return o, lse

  def backward(q, k, v, bias, mask, q_lengths, kv_lengths, o, lse, d_o, config,
               q_segment_ids=None, kv_segment_ids=None):
    dq, dk, dv = call("backward", (result(q.shape, q.dtype, q), result(k.shape, k.dtype, k),
                                   result(v.shape, v.dtype, v)),
                      q, k, v, bias, mask, q_lengths, kv_lengths, config, q_segment_ids,
                      kv_segment_ids, o, lse, d_o)
    return dq, dk, dv

  def bias_grad(q, k, v, bias, mask, q_lengths, kv_lengths, o, lse, d_o, config,
                q_segment_ids=None, kv_segment_ids=None):
    (dbias,) = call("bias_grad", (result(bias.shape, jnp.float32, bias),), q, k, v, bias, mask,
                    q_lengths, kv_lengths, config, q_segment_ids, kv_segment_ids, o, lse, d_o)
    return dbias

  return forward, backward, bias_grad
