"""The implementations and how ``implementation=`` picks one.

An implementation is three plain functions (forward, backward, bias_grad) with
the signatures described in ``_config.py`` plus a few facts about where it runs.
Each module of ``jax_fatrain/_backends`` ends with its ``IMPLEMENTATION`` (or
``None`` and an ``IMPORT_ERROR`` that says why it is unavailable here); this
module collects them and maps ``implementation=`` to one.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
from typing import Callable

import jax
import jax.numpy as jnp


# Every implementation, in the order ``implementation=None`` considers them on
# the cpu platform (see ``resolve_implementation``).
BACKENDS = ("xla", "cpu", "cuda", "metal", "metal_emulated")


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


def _module(name: str):
  return importlib.import_module(f"jax_fatrain._backends.{name}")


@functools.lru_cache(maxsize=None)
def _table() -> tuple[dict[str, Implementation], dict[str, str]]:
  """(available implementations, reasons the others are unavailable)."""
  available, unavailable = {}, {}
  for name in BACKENDS:
    module = _module(name)
    if module.IMPLEMENTATION is not None:
      available[name] = module.IMPLEMENTATION
    else:
      unavailable[name] = module.IMPORT_ERROR
  return available, unavailable


def available_implementations() -> tuple[str, ...]:
  """Names accepted by ``implementation=`` on this installation."""
  return tuple(sorted(_table()[0]))


def _choose(name: str | None, dtype=None, head_dim: int | None = None
            ) -> tuple[Implementation, str]:
  """(implementation, why it is the one) for ``implementation=name``; raises
  ValueError for a name that is unknown or not available here."""
  available, unavailable = _table()
  if name is not None and not isinstance(name, str):
    raise TypeError(f"implementation must be a string or None, got {name!r}")
  if name is None:
    backend = jax.default_backend()
    # On an NVIDIA GPU our CUDA kernels where they are built (JAX calls the
    # backend "gpu", the platform "cuda"; ROCm GPUs are "gpu" too, hence
    # the device check), for the problems they run on tensor cores; the
    # others (float32, other head dims) would take their float32 SIMT
    # kernels, so those go to the XLA path, whose matrix products XLA runs
    # on tensor cores.
    if backend == "gpu" and "cuda" in available and _module("cuda").gpu_present():
      if dtype is None or _module("cuda").has_tensor_core_kernels(dtype, head_dim):
        problem = ("" if dtype is None else
                   f", with tensor-core kernels for {jnp.dtype(dtype).name} "
                   f"head dim {head_dim}")
        return (available["cuda"],
                "jax's default backend is an NVIDIA GPU and the cuda extension is built"
                f"{problem}")
      return (available["xla"],
              "jax's default backend is an NVIDIA GPU, but the cuda extension has no "
              f"tensor-core kernels for {jnp.dtype(dtype).name} head dim {head_dim}, "
              "so XLA's composite (its matrix products on tensor cores) runs instead")
    # On a Mac with a Metal device, "metal" (its handlers live on XLA's cpu
    # platform too); elsewhere the CPU kernels. metal_emulated is a test tool
    # and never chosen.
    for candidate, what in (("metal", "the Metal extension is built and an Apple GPU "
                             "is present"),
                            ("cpu", "the CPU extension is built")):
      impl = available.get(candidate)
      if impl is not None and backend in impl.platforms:
        return impl, f"jax's default backend is {backend} and {what}"
    missing = "cuda" if backend == "gpu" else "cpu"
    detail = f" ({missing}: {unavailable[missing]})" if missing in unavailable else ""
    return (available["xla"],
            f"jax's default backend is {backend} and no extension of ours runs there"
            f"{detail}, so the pure-JAX composite runs")
  if name in available:
    return available[name], "requested explicitly"
  known = sorted(set(available) | set(unavailable))
  why = unavailable.get(name)
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
