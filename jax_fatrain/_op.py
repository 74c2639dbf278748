"""The differentiable op: one ``jax.custom_vjp`` over any implementation.

An implementation is three plain functions (forward, backward, bias_grad) with
the signatures described in ``_config.py``. This module

* keeps the registry of implementations and says why one is unavailable,
* wraps each stage in the sharding rules of ``_sharding.py`` and in a batching
  rule that folds ``vmap``-ed axes into the batch dimension (one kernel launch,
  not a loop; FFI calls have no batching rule of their own), and
* ties forward and backward together with ``jax.custom_vjp``: the forward
  saves (q, k, v, bias, mask, lengths, o, lse); the backward calls the backward
  kernel, and the bias gradient is a separate call that XLA removes when
  nothing uses it.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp
from jax.custom_batching import custom_vmap

from jax_fatrain import _cpu, _cuda, _metal, _metal_emulated, _sharding, _xla
from jax_fatrain._config import AttentionConfig


@dataclasses.dataclass(frozen=True)
class Implementation:
  name: str
  forward: Callable
  backward: Callable
  bias_grad: Callable
  # Largest supported head dimension (None: any).
  max_head_dim: int | None
  # JAX platforms the implementation runs on (None: any).
  platforms: tuple[str, ...] | None
  # Fills in the config's process-wide defaults (e.g. the CUDA dQ mode) when
  # a call is traced; None: nothing to fill in.
  resolve_config: Callable[[AttentionConfig], AttentionConfig] | None = None


def _unavailable_reasons() -> dict[str, str]:
  reasons = {}
  if _metal.IMPORT_ERROR is not None:
    reasons["metal"] = _metal.IMPORT_ERROR
  if _cuda.IMPORT_ERROR is not None:
    reasons["cuda"] = _cuda.IMPORT_ERROR
  if _metal_emulated.IMPORT_ERROR is not None:
    reasons["metal_emulated"] = ("the MSL emulator extension is not built "
                                 f"({_metal_emulated.IMPORT_ERROR})")
  if _cpu.IMPORT_ERROR is not None:
    reasons["cpu"] = f"the CPU extension failed to import: {_cpu.IMPORT_ERROR}"
  return reasons


_IMPLEMENTATIONS: dict[str, Implementation] = {
    "xla": Implementation("xla", _xla.forward, _xla.backward, _xla.bias_grad,
                          max_head_dim=None, platforms=None),
}
if _cpu.IMPORT_ERROR is None:
  _IMPLEMENTATIONS["cpu"] = Implementation(
      "cpu", _cpu.forward, _cpu.backward, _cpu.bias_grad,
      max_head_dim=_cpu.MAX_HEAD_DIM, platforms=("cpu",))
if _metal.IMPORT_ERROR is None:
  # Our Metal kernels on the Apple GPU, behind FFI handlers on the cpu platform.
  _IMPLEMENTATIONS["metal"] = Implementation(
      "metal", _metal.forward, _metal.backward, _metal.bias_grad,
      max_head_dim=_metal.MAX_HEAD_DIM, platforms=("cpu",))
if _metal_emulated.IMPORT_ERROR is None:
  # The Metal kernels on the MSL emulator (a test tool; never chosen by default).
  _IMPLEMENTATIONS["metal_emulated"] = Implementation(
      "metal_emulated", _metal_emulated.forward, _metal_emulated.backward,
      _metal_emulated.bias_grad, max_head_dim=_metal_emulated.MAX_HEAD_DIM,
      platforms=("cpu",))


if _cuda.IMPORT_ERROR is None:
  # Our CUDA kernels behind FFI handlers on the CUDA platform.
  _IMPLEMENTATIONS["cuda"] = Implementation(
      "cuda", _cuda.forward, _cuda.backward, _cuda.bias_grad,
      max_head_dim=_cuda.MAX_HEAD_DIM, platforms=("cuda",),
      resolve_config=_cuda.resolve_config)


def available_implementations() -> tuple[str, ...]:
  """Names accepted by ``implementation=`` on this installation."""
  return tuple(sorted(_IMPLEMENTATIONS))


def _choose(name: str | None, dtype=None, head_dim: int | None = None
            ) -> tuple[Implementation, str]:
  """(implementation, why it is the one) for ``implementation=name``; raises
  ValueError for a name that is unknown or not available here."""
  if name is None:
    backend = jax.default_backend()
    # On an NVIDIA GPU our CUDA kernels where they are built (JAX calls the
    # backend "gpu", the platform "cuda"; ROCm GPUs are "gpu" too, hence
    # the device check), for the problems they run on tensor cores; the
    # others (float32, other head dims) would take their float32 SIMT
    # kernels, so those go to the XLA path, whose matrix products XLA runs
    # on tensor cores (not measured against each other).
    if backend == "gpu" and "cuda" in _IMPLEMENTATIONS and _cuda.gpu_present():
      if dtype is None or _cuda.has_tensor_core_kernels(dtype, head_dim):
        problem = ("" if dtype is None else
                   f", with tensor-core kernels for {jnp.dtype(dtype).name} "
                   f"head dim {head_dim}")
        return (_IMPLEMENTATIONS["cuda"],
                f"jax's default backend is an NVIDIA GPU and the cuda extension is built"
                f"{problem}")
      return (_IMPLEMENTATIONS["xla"],
              f"jax's default backend is an NVIDIA GPU, but the cuda extension has no "
              f"tensor-core kernels for {jnp.dtype(dtype).name} head dim {head_dim}, "
              "so XLA's composite (its matrix products on tensor cores) runs instead")
    # On a Mac with a Metal device, "metal" (its handlers live on XLA's cpu
    # platform too); elsewhere the CPU kernels.
    for candidate, what in (("metal", "the Metal extension is built and an Apple GPU "
                             "is present"),
                            ("cpu", "the CPU extension is built")):
      impl = _IMPLEMENTATIONS.get(candidate)
      if impl is not None and backend in impl.platforms:
        return impl, f"jax's default backend is {backend} and {what}"
    unavailable = _unavailable_reasons()
    missing = "cuda" if backend == "gpu" else "cpu"
    detail = f" ({missing}: {unavailable[missing]})" if missing in unavailable else ""
    return (_IMPLEMENTATIONS["xla"],
            f"jax's default backend is {backend} and no extension of ours runs there"
            f"{detail}, so the pure-JAX composite runs")
  if name in _IMPLEMENTATIONS:
    return _IMPLEMENTATIONS[name], "requested explicitly"
  known = sorted(set(_IMPLEMENTATIONS) | set(_unavailable_reasons()))
  why = _unavailable_reasons().get(name)
  detail = (f"implementation {name!r} is not available: {why}" if why else
            f"unknown implementation {name!r} (known: {', '.join(known)})")
  raise ValueError(f"{detail}. Available here: "
                   f"{', '.join(available_implementations())} (or None for the best one).")


def resolve_implementation(name: str | None, dtype=None, head_dim: int | None = None
                           ) -> Implementation:
  """Maps ``implementation=`` to an Implementation, or raises ValueError.

  For None, the query's dtype and head dim (when given) choose too.
  """
  return _choose(name, dtype, head_dim)[0]


def explain_implementation(name: str | None = None, dtype=None,
                           head_dim: int | None = None) -> tuple[str, str]:
  """(implementation name, one-sentence reason) for ``implementation=name``.

  With ``name=None`` this is the implementation that
  ``dot_product_attention(..., implementation=None)`` runs for a query of
  ``dtype`` and ``head_dim`` (when given; on a GPU they decide between our
  kernels and XLA's) and why it is the best one here. Raises ValueError, like
  ``dot_product_attention``, for a name that is unknown or not available.
  """
  impl, reason = _choose(name, dtype, head_dim)
  return impl.name, reason


# ---------------------------------------------------------------------------
# vmap: fold the mapped axis into the batch axis.
# ---------------------------------------------------------------------------
#
# Every operand has the batch as its leading axis (q/k/v/o/dO, lse, bias,
# mask, lengths), so under vmap the rule moves the mapped axis next to it and
# merges the two: [V, B, ...] -> [V*B, ...]. Operands that are not mapped are
# broadcast along V first, except a bias/mask whose batch dim is 1, which
# still broadcasts over the merged batch through its zero stride. Outputs are
# split back into [V, B, ...].

# Argument positions of the operands that broadcast over [B, N, T, S].
_BIAS, _MASK = 3, 4


def _fold(x, batched: bool, axis_size: int, batch: int, keep_unit_batch: bool):
  """[V, b, ...] (or unmapped [b, ...]) -> [V*batch, ...] (or [1, ...] kept)."""
  if x is None:
    return None
  if not batched:
    if keep_unit_batch and x.shape[0] == 1:
      return x
    x = x[None]
  # A mapped bias/mask with batch dim 1 still needs one entry per merged
  # batch element: the merged index v*B + b is not a strided view of v.
  x = jnp.broadcast_to(x, (axis_size, batch) + x.shape[2:])
  return x.reshape((-1,) + x.shape[2:])


def _unfold(y, axis_size: int):
  return y.reshape((axis_size, -1) + y.shape[1:])


@functools.lru_cache(maxsize=None)
def _batched(fn: Callable, stage: str) -> Callable:
  """Wraps ``fn(*operands)`` (config already bound) with the folding rule."""
  wrapped = custom_vmap(fn)

  @wrapped.def_vmap
  def rule(axis_size, in_batched, *args):
    q, q_batched = args[0], bool(in_batched[0])
    batch = q.shape[1] if q_batched else q.shape[0]
    folded = []
    for i, (x, batched) in enumerate(zip(args, in_batched)):
      is_score = i in (_BIAS, _MASK)
      # The bias gradient must come out per mapped element, so its bias is
      # always given the mapped axis.
      keep = is_score and not (stage == "bias_grad" and i == _BIAS)
      folded.append(_fold(x, bool(batched), axis_size, batch, keep_unit_batch=keep))
    out = wrapped(*folded)
    if stage == "bias_grad":
      dbias = _unfold(out, axis_size)
      if args[_BIAS].shape[int(bool(in_batched[_BIAS]))] == 1:
        dbias = dbias.sum(axis=1, keepdims=True)
      return dbias, True
    outs = tuple(_unfold(y, axis_size) for y in out)
    return outs, tuple(True for _ in outs)

  return wrapped


def stage(impl: Implementation, stage: str, config: AttentionConfig) -> Callable:
  """The callable for one stage ("forward", "backward", "bias_grad").

  The config's defaults are filled in first: the callables below are cached
  by config, and JAX caches what it traces through them, so a default read
  later, while tracing, would stay whatever it was the first time.
  """
  if impl.resolve_config is not None:
    config = impl.resolve_config(config)
  return _stage(impl, stage, config)


@functools.lru_cache(maxsize=None)
def _stage(impl: Implementation, stage: str, config: AttentionConfig) -> Callable:
  # Sharding (_sharding.py): the stage is wrapped in custom_partitioning so
  # that under a multi-device jit each device runs the kernel on its shard
  # (batch/heads: no collectives; a sharded sequence: ring attention). On one
  # device it lowers to the plain call. custom_partitioning has no vmap rule,
  # so the folding rule above goes *outside* it, for every implementation:
  # vmap folds its axis into the batch first and the folded call is then
  # partitioned like any other.
  fn = _sharding.partitioned(impl, stage, config)
  return _batched(fn, stage)


# ---------------------------------------------------------------------------
# The custom_vjp.
# ---------------------------------------------------------------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8))
def attention(q, k, v, bias, mask, q_lengths, kv_lengths,
              config: AttentionConfig, impl: Implementation):
  """(o, lse) for canonical operands; differentiable in q, k, v and bias."""
  return stage(impl, "forward", config)(q, k, v, bias, mask, q_lengths, kv_lengths)


def _attention_fwd(q, k, v, bias, mask, q_lengths, kv_lengths, config, impl):
  o, lse = stage(impl, "forward", config)(q, k, v, bias, mask, q_lengths, kv_lengths)
  return (o, lse), (q, k, v, bias, mask, q_lengths, kv_lengths, o, lse)


def _attention_bwd(config, impl, residuals, cotangents):
  q, k, v, bias, mask, q_lengths, kv_lengths, o, lse = residuals
  # The cotangent of lse is ignored: like jax.nn, the residual is returned
  # under stop_gradient (see api.dot_product_attention).
  d_o, _ = cotangents
  d_o = d_o.astype(o.dtype)
  operands = (q, k, v, bias, mask, q_lengths, kv_lengths, o, lse, d_o)
  dq, dk, dv = stage(impl, "backward", config)(*operands)
  dbias = None
  if bias is not None:
    dbias = stage(impl, "bias_grad", config)(*operands).astype(bias.dtype)
  return dq, dk, dv, dbias, None, None, None


attention.defvjp(_attention_fwd, _attention_bwd)
