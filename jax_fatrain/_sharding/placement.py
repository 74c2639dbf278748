"""Which shardings of the operands a stage runs with (``Plan``), decided from the
shardings XLA settled on, and the PartitionSpecs of its operands and results."""

from __future__ import annotations

import dataclasses
import math

from jax.sharding import NamedSharding, PartitionSpec

from jax_fatrain._sharding.operands import BIAS, expand, operand_roles


@dataclasses.dataclass(frozen=True)
class Plan:
  batch: tuple[str, ...]
  heads: tuple[str, ...]
  seq: tuple[str, ...]
  head_mode: str          # "none", "split" (kv heads sharded too), "slice"
  mesh_shape: tuple[tuple[str, int], ...]

  def size(self, axes):
    shape = dict(self.mesh_shape)
    return math.prod(shape[a] for a in axes)


def _axes_of(entry) -> tuple[str, ...]:
  if entry is None:
    return ()
  if isinstance(entry, (tuple, list)):
    return tuple(entry)
  return (entry,)


def _entry(axes):
  if not axes:
    return None
  return axes[0] if len(axes) == 1 else tuple(axes)


def _spec_of(x, ndim, mesh):
  """The PartitionSpec of an operand over `mesh`, or None if it has none."""
  sharding = getattr(x, "sharding", None)
  if isinstance(sharding, NamedSharding):
    spec = tuple(sharding.spec)
  else:
    # decode_shardings=False: we decode here so that a sharding which is not
    # a plain PartitionSpec of the mesh (e.g. over a sub-axis) falls back to
    # running replicated instead of failing inside the partitioner.
    try:
      from jax._src import sharding_impls  # pylint: disable=import-outside-toplevel
      hlo = sharding._to_xla_hlo_sharding(ndim)
      spec = tuple(sharding_impls.parse_flatten_op_sharding(hlo, mesh)[0])
    except Exception:  # pylint: disable=broad-except
      return None
  return spec + (None,) * (ndim - len(spec))


def make_plan(config, present, mesh, shapes) -> Plan | None:
  full = expand(present, shapes)
  q, k = full[0], full[1]
  q_spec, k_spec = _spec_of(q, 4, mesh), _spec_of(k, 4, mesh)
  if q_spec is None or k_spec is None:
    return None
  seq_ax, head_ax = config.seq_axis, config.head_axis
  mesh_shape = tuple(mesh.shape.items())
  sizes = dict(mesh_shape)
  size = lambda axes: math.prod(sizes[a] for a in axes)
  b, t, n = q.shape[0], q.shape[seq_ax], q.shape[head_ax]
  s, kh = k.shape[seq_ax], k.shape[head_ax]

  batch = _axes_of(q_spec[0])
  if b % size(batch):
    batch = ()
  heads = _axes_of(q_spec[head_ax])
  if n % size(heads):
    heads = ()
  seq = _axes_of(q_spec[seq_ax]) or _axes_of(k_spec[seq_ax])
  seq = tuple(a for a in seq if a not in batch and a not in heads)

  ph = size(heads)
  if ph == 1:
    head_mode = "none"
  elif kh % ph == 0:
    head_mode = "split"
  elif ph % kh == 0:
    head_mode = "slice"
  else:
    heads, head_mode = (), "none"

  ps = size(seq)
  if ps > 1:
    problems = []
    if any(full[i] is not None for i in range(3, 7)):
      problems.append("bias, mask and sequence lengths")
    if config.window_left >= 0 or config.window_right >= 0:
      problems.append("local_window_size")
    if config.is_causal and t != s:
      problems.append(f"causal attention with query length {t} != key length {s}")
    if problems:
      raise NotImplementedError(
          f"jax_fatrain: sequence-sharded (ring) attention over mesh axes {seq} "
          f"does not support {', '.join(problems)}. Shard over batch/heads only, "
          "or replicate the sequence axis of query/key/value.")
    blocks = 2 * ps if config.is_causal else ps
    if t % blocks or s % blocks:
      raise NotImplementedError(
          f"jax_fatrain: sequence-sharded (ring) attention over {ps} devices needs "
          f"query and key lengths divisible by {blocks}"
          f"{' (2 blocks per device for causal load balance)' if config.is_causal else ''}"
          f"; got {t} and {s}. Pad the sequence.")
  return Plan(batch, heads, seq, head_mode, mesh_shape)


def specs(plan: Plan, config, present, shapes, stage):
  """(operand specs, result specs) for the plan."""
  full = expand(present, shapes)
  q = full[0]
  seq_ax, head_ax = config.seq_axis, config.head_axis
  b, n = q.shape[0], q.shape[head_ax]

  def layout(heads):
    dims = [_entry(plan.batch), None, None, None]
    dims[seq_ax], dims[head_ax] = _entry(plan.seq), _entry(heads)
    return PartitionSpec(*dims)

  q_spec = layout(plan.heads)
  kv_spec = layout(plan.heads if plan.head_mode == "split" else ())
  lse_spec = PartitionSpec(_entry(plan.batch), _entry(plan.heads), _entry(plan.seq))

  def score_spec(x):
    bb, nb = x.shape[0], x.shape[1]
    return PartitionSpec(_entry(plan.batch) if bb == b and bb != 1 else None,
                         _entry(plan.heads) if nb == n and nb != 1 else None,
                         None, None)

  args = []
  roles = operand_roles(len(full))
  seg_spec = PartitionSpec(_entry(plan.batch), _entry(plan.seq))
  for i, x in enumerate(full):
    if x is None:
      continue
    role = roles[i]
    if role in ("bias", "mask"):
      args.append(score_spec(x))
    else:
      args.append({"q": q_spec, "kv": kv_spec, "lse": lse_spec,
                   "len": PartitionSpec(_entry(plan.batch)),
                   "qseg": seg_spec, "kvseg": seg_spec}[role])
  if stage == "forward":
    results = (q_spec, lse_spec)
  elif stage == "backward":
    results = (q_spec, kv_spec, kv_spec)
  else:
    results = score_spec(full[BIAS])
  return args, results
