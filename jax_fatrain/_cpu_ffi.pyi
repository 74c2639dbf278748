"""XLA FFI handlers of jax_fatrain's CPU backend (cpp/ffi/cpu_ffi.cc)."""

from typing import Any

def registrations() -> dict[str, Any]:
  """FFI target name -> handler capsule, for jax.ffi.register_ffi_target (platform "cpu")."""

def selected_isa() -> str:
  """The instruction set the CPU kernels dispatch to on this machine."""

def fma_peak_gflops(threads: int = 0, seconds: float = 0.2) -> float:
  """This machine's float32 FMA rate in GFLOP/s with the selected ISA (threads=0: one per
  CPU this process may run on)."""

def bf16_dot_peak_gflops(threads: int = 0, seconds: float = 0.2) -> float:
  """This machine's bf16 pair dot-product (vdpbf16ps) rate in GFLOP/s, 4 FLOPs a lane;
  0 where the selected kernels do not run it."""

def amx_bf16_peak_gflops(threads: int = 0, seconds: float = 0.2) -> float:
  """This machine's AMX bf16 tile product (TDPBF16PS) rate in GFLOP/s; 0 where the
  selected kernels do not run it."""

def tile_visits(reset: bool = False) -> dict[str, int]:
  """Tiles each pass has computed so far ("forward", "backward_dq",
  "backward_dkdv", "bias_grad"); reset=True also sets the counts to zero."""

def tile_sizes() -> tuple[int, int]:
  """(query rows, keys) per tile of the CPU kernels."""
