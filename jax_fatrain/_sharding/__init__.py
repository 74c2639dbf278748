"""Sharded execution: each device runs the kernels on its own shard.

Without a partitioning rule XLA treats an FFI call as opaque: it gathers every
operand onto every device and runs the whole attention there. This package wraps
each stage (forward, backward, bias_grad) of every implementation in
``jax.experimental.custom_partitioning``:

* a Shardy ``sharding_rule`` (the einsum-like string, built per call from the
  operand shapes) tells the propagation pass how the dims of q/k/v/bias/mask/
  lengths/o/lse relate, so shardings flow through the op in both directions;
* the ``partition`` callback looks at the shardings XLA settled on, picks the
  operand/result shardings we support and returns the per-device function.

What the per-device function does:

* **Batch / heads** (dim 0, and the head dim of the layout): every device runs
  the unchanged kernel on its shard; no collective at all, forward or backward.
  GQA: query head ``n`` uses kv head ``n // G`` (``G = N // K``), so sharding
  the heads over ``P`` devices keeps whole groups together when ``K % P == 0``
  (kv heads are sharded the same way). When ``P % K == 0`` (a group is split
  over several devices, e.g. ``K = 1``) k/v are replicated over the head axes
  and each device slices out the one kv head its query heads use; the backward
  then sums the dK/dV of the devices sharing a kv head (an all-reduce over the
  head axes of k/v-sized arrays). Any other combination falls back to
  replicated heads (XLA gathers q over the head axes).
* **Sequence** (the T dim of q / S dim of k and v): ring attention over the
  mesh axes that shard the sequence. K/V blocks travel around the ring with
  ``lax.ppermute`` (in the backward together with their dK/dV partial sums);
  partial outputs are merged through the logsumexp. Causal attention is load
  balanced with a zig-zag layout: the user's contiguous shards are permuted
  inside the op (two collective-permutes of half shards per tensor) so that
  device ``d`` holds sequence blocks ``d`` and ``2P-1-d``, and the results are
  permuted back. Each ring step calls the unchanged kernels on local blocks.
* Operands whose dims are broadcast (size 1 bias/mask dims) are replicated on
  those dims; full-size dims follow the batch/head sharding of q; lengths
  follow the batch sharding; segment ids follow the batch and sequence
  sharding of q (query ids) and k (key ids), and in ring attention the key
  ids travel around the ring with their K/V blocks. The head dim H is never
  split.

Modules: ``operands`` (the stage operands by position), ``rule`` (the Shardy
rule), ``placement`` (the plan and its PartitionSpecs), ``per_device`` (the
per-device function, ring attention included); this module holds the
``custom_partitioning`` glue.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec

from jax_fatrain._config import AttentionConfig
from jax_fatrain._sharding import operands, per_device, placement, rule

# Measurement/debugging switch: when True, stages are not partitioned (XLA
# gathers the operands and runs the whole attention on every device). Read at
# trace time.
DISABLED = False


def partitioned(impl, stage: str, config: AttentionConfig) -> Callable:
  """``fn(*operands)`` (None for absent ones) that partitions over a mesh."""
  plain = functools.partial(operands.call, impl, stage, config)

  def call(*operands):
    if DISABLED:
      return plain(*operands)
    present = tuple(x is not None for x in operands)
    dense = tuple(x for x in operands if x is not None)
    return _custom(impl, stage, config, present)(*dense)

  return call


@functools.lru_cache(maxsize=None)
def _custom(impl, stage: str, config: AttentionConfig, present: tuple[bool, ...]):
  plain = functools.partial(operands.call, impl, stage, config)

  @custom_partitioning
  def fn(*dense):
    return plain(*operands.expand(present, dense))

  def sharding_rule(mesh, operand_types, result_types):
    del mesh, result_types
    from jax._src.lib.mlir import ir  # pylint: disable=import-outside-toplevel
    shapes = [tuple(ir.RankedTensorType(t).shape) for t in operand_types]
    return rule.sharding_rule(stage, config, present, shapes)

  def partition(mesh, arg_shapes, result_shape):
    return _partition(impl, stage, config, present, mesh, arg_shapes, result_shape)

  fn.def_partition(partition=partition, sharding_rule=sharding_rule, decode_shardings=False,
                   infer_sharding_from_operands=functools.partial(
                       _infer, impl, stage, config, present))
  return fn


def _infer(impl, stage, config, present, mesh, arg_shapes, result_shape):
  """Result shardings for the GSPMD propagation (jax_use_shardy_partitioner=False)."""
  del impl, result_shape
  plan = placement.make_plan(config, present, mesh, arg_shapes)
  if plan is None:
    plan = placement.Plan((), (), (), "none", tuple(mesh.shape.items()))
  _, results = placement.specs(plan, config, present, arg_shapes, stage)
  return jax.tree.map(lambda s: NamedSharding(mesh, s), results,
                      is_leaf=lambda s: isinstance(s, PartitionSpec))


def _partition(impl, stage, config, present, mesh, arg_shapes, result_shape):
  del result_shape
  plan = placement.make_plan(config, present, mesh, arg_shapes)
  if plan is None:   # shardings that name no mesh axes: run replicated
    plan = placement.Plan((), (), (), "none", tuple(mesh.shape.items()))
  args, results = placement.specs(plan, config, present, arg_shapes, stage)
  named = lambda s: NamedSharding(mesh, s)
  arg_shardings = tuple(named(s) for s in args)
  if isinstance(results, tuple):
    result_shardings = tuple(named(s) for s in results)
  else:
    result_shardings = named(results)
  full_shapes = operands.expand(present, arg_shapes)

  def lower(*dense):
    ops = operands.expand(present, dense)
    return per_device.local(impl, stage, config, plan, full_shapes, ops)

  return mesh, lower, result_shardings, arg_shardings
