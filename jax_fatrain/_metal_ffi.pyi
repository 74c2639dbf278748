"""XLA FFI handlers of jax_fatrain's Metal backend on macOS (cpp/ffi/metal_ffi.cc)."""

from typing import Any

def registrations() -> dict[str, Any]:
  """FFI target name -> handler capsule, for jax.ffi.register_ffi_target (platform "cpu")."""

def device_name() -> str:
  """The default Metal device's name ("" when there is none)."""

def unsupported_reason() -> str:
  """Why the Metal kernels cannot run on this machine, or "" when they can."""

def initialize(source: str, metallib_path: str = "") -> str:
  """Builds the kernel library (from the metallib when given, else the source); "" or an error."""

def planned_kernel_names() -> list[str]:
  """Every kernel name the dispatch plan can ask for."""
