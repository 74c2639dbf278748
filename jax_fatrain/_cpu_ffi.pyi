"""XLA FFI handlers of jax_fatrain's CPU backend (cpp/ffi/cpu_ffi.cc)."""

from typing import Any

def registrations() -> dict[str, Any]:
  """FFI target name -> handler capsule, for jax.ffi.register_ffi_target (platform "cpu")."""

def selected_isa() -> str:
  """The instruction set the CPU kernels dispatch to on this machine."""
