"""XLA FFI handlers of the metal_emulated implementation: jax_fatrain's Metal kernels on
the MSL emulator (cpp/ffi/metal_emulated_ffi.cc)."""

from typing import Any

def registrations() -> dict[str, Any]:
  """FFI target name -> handler capsule, for jax.ffi.register_ffi_target (platform "cpu")."""

def kernel_names() -> list[str]:
  """Kernels compiled into the emulator."""

def selftest() -> tuple[int, str]:
  """Runs the emulator's self-test: (number of failed checks, log)."""

def planned_kernel_names() -> list[str]:
  """Every kernel name the Metal dispatch plan can ask for."""

def profile_start(fraction: float = 1.0, max_threadgroups: int = 0) -> None:
  """Starts recording per-dispatch counters (jax_fatrain.emulator.profile.record)."""

def profile_stop() -> list[dict[str, Any]]:
  """Stops recording and returns one record per dispatch since profile_start."""

def profile_recording() -> bool:
  """Whether dispatches are being recorded."""

def counter_names() -> list[str]:
  """The counters of a record, in the emulator's order."""
