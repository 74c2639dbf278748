"""The static description of one attention call, shared by every implementation.

Every implementation (``cpu``, ``xla``, ``metal``, ``metal_emulated``, ``cuda``) receives the
operands in one canonical form and this frozen, hashable config:

* ``query``  ``[B, T, N, H]`` (layout ``"BTNH"``) or ``[B, N, T, H]`` (``"BNTH"``)
* ``key``, ``value``  ``[B, S, K, H]`` / ``[B, K, S, H]`` in the same layout
* ``bias``  ``None`` or a float array of rank 4 whose dims are each 1 or the full
  extent of ``[B, N, T, S]`` (never materialised to full size)
* ``mask``  ``None`` or a bool array of the same kind (True = keep)
* ``q_lengths`` / ``kv_lengths``  ``None`` or int32 ``[B]``
* ``q_segment_ids`` / ``kv_segment_ids``  ``None`` (both) or int32 ``[B, T]`` /
  ``[B, S]``: query i sees key j only where the ids are equal

The three functions of an implementation are

* ``forward(q, k, v, bias, mask, q_lengths, kv_lengths, config, *,
  q_segment_ids=None, kv_segment_ids=None) -> (o, lse)``
* ``backward(q, k, v, bias, mask, q_lengths, kv_lengths, o, lse, d_o, config, *,
  q_segment_ids=None, kv_segment_ids=None) -> (dq, dk, dv)``
* ``bias_grad(`` the backward's arguments ``) -> dbias`` (float32, bias' shape)

Implementations return ``lse`` as float32 ``[B, N, T]`` in natural log.
"""

from __future__ import annotations

import dataclasses

LAYOUTS = ("BTNH", "BNTH")


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
  scale: float
  is_causal: bool = False
  # Sliding window: query i sees key j iff i - left <= j <= i + right;
  # -1 means unbounded on that side.
  window_left: int = -1
  window_right: int = -1
  layout: str = "BTNH"
  # Bitwise-reproducible gradients (the public ``deterministic`` keyword).
  # Only the CUDA backward has a faster mode that is not (dQ added with
  # float32 atomics); the other implementations always are and ignore it.
  deterministic: bool = False

  def __post_init__(self):
    if self.layout not in LAYOUTS:
      raise ValueError(f"layout must be one of {LAYOUTS}, got {self.layout!r}")

  @property
  def seq_axis(self) -> int:
    return 1 if self.layout == "BTNH" else 2

  @property
  def head_axis(self) -> int:
    return 2 if self.layout == "BTNH" else 1
