"""jax_fatrain: FlashAttention-2 training kernels for JAX.

``dot_product_attention`` is a drop-in for ``jax.nn.dot_product_attention``
whose forward (O and logsumexp) and backward (dQ, dK, dV, dbias) run our own
kernels; ``flash_attn_train_fwd`` / ``flash_attn_train_bwd`` are the lower
level pair in the ``[B, H, L, D]`` layout.
"""

from jax_fatrain._api import (
    dot_product_attention,
    flash_attn_train_bwd,
    flash_attn_train_fwd,
)
from jax_fatrain._flax import flax_attention_fn
from jax_fatrain._registry import available_implementations, explain_implementation


def cpu_isa() -> str:
  """The instruction set the CPU kernels use here: "avx512_amx" (avx512 with
  bf16 products on AMX tiles; the default where the CPU has AMX and Linux
  grants the process its tile state), "avx512_bf16" (avx512 with bf16
  problems multiplied as bf16 pairs; the default where vdpbf16ps runs at full
  rate, i.e. on AMD), "avx512", "avx2" or "baseline"; or another variant
  the CPU supports that JAX_FATRAIN_CPU_ISA asks for (avx512_bf16 on Intel,
  the avx2_bf16_emulated test variant)."""
  from jax_fatrain._backends import cpu
  return cpu.selected_isa()


__version__ = "0.1.0"
__all__ = [
    "available_implementations",
    "cpu_isa",
    "explain_implementation",
    "dot_product_attention",
    "flax_attention_fn",
    "flash_attn_train_bwd",
    "flash_attn_train_fwd",
]
