"""XLA FFI handlers of jax_fatrain's CUDA backend (cpp/ffi/cuda_ffi.cc)."""

from typing import Any

def registrations() -> dict[str, Any]:
  """FFI target name -> handler capsule, for jax.ffi.register_ffi_target (platform "CUDA")."""

def device_count() -> int:
  """Number of CUDA devices the runtime sees (0 when none or no driver)."""

def selected_path(dtype: str, head_dim: int) -> str:
  """"tensor_core" or "simt": the kernel family problems of this dtype and head dim use."""

def scratch_bytes(stage: str, batch: int, q_heads: int, q_len: int, head_dim: int,
                  deterministic: bool, kv_len: int = 0, segment_ids: bool = False) -> int:
  """Device scratch bytes the stage's handler needs ("forward", "backward", "bias_grad");
  kv_len matters only with segment ids."""

def set_launch_recording(on: bool) -> None:
  """Starts or stops recording the kernels the handlers launch (a test tool)."""

def take_launch_record() -> list[str]:
  """The recorded kernels' symbol names since the last call, oldest first."""

def set_fastest_kernel_family(name: str) -> None:
  """Caps the kernel families later launches may use: "hopper" (no cap), "mma_sync"
  or "simt" (a test tool; process-wide). ValueError for any other name."""
