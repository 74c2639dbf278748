"""The stage operands of ``_op.py`` by position, and how to call a stage on them."""

from __future__ import annotations

from jax_fatrain._config import AttentionConfig

# Operand roles, by position (the stage operands of _op.py): forward has the
# first 7 and then the two segment-id roles, backward and bias_grad all 10 and
# then the segment ids.
ROLES = ("q", "kv", "kv", "bias", "mask", "len", "len", "q", "lse", "q")
SEGMENT_ROLES = ("qseg", "kvseg")
BIAS = 3   # the bias operand


def operand_roles(n_operands: int) -> tuple[str, ...]:
  return ROLES[:n_operands - 2] + SEGMENT_ROLES


def call(impl, stage: str, config: AttentionConfig, *operands):
  """The implementation's stage on stage operands (segment ids last, passed
  as keywords only when given)."""
  *rest, q_seg, kv_seg = operands
  segments = {} if q_seg is None else dict(q_segment_ids=q_seg, kv_segment_ids=kv_seg)
  return getattr(impl, stage)(*rest, config=config, **segments)


def expand(present, dense):
  """The full operand list from the present ones (None where absent)."""
  it = iter(dense)
  return [next(it) if p else None for p in present]
