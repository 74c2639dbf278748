"""The fused Metal backward and the plan's choice between its two forms.

The fused form (flash_attn_train_bwd_dkdv_dq, then flash_attn_train_bwd_dq_reduce)
accumulates dQ in nsplit float32 accumulators, one per split of the key tiles;
the two-kernel form (dQ kernel, dK/dV kernel) is planned when one split does
not fit the scratch budget. Run through the emulator:

* the plan's split rule (fill the GPU: two threadgroups per core of the GPU
  the plan is told of, or of a 40-core GPU when it is told none; at most one
  split per key tile, every split the same number of tiles, the budget) and
  the fallback;
* for every split count the plan may pick on a problem (forced through the
  plan's test hook JAX_FATRAIN_METAL_BWD_NSPLIT, the same plan code and
  kernels), two runs of the backward are bitwise equal and match jax.nn,
  including rows that see no key (dQ = 0), lengths, windows and segment ids;
  and so for the split counts the plan picks for an 8-core and a 40-core GPU;
* the two-kernel form (JAX_FATRAIN_METAL_BWD_SCRATCH_BUDGET=0) on one case per
  dtype and head dim.
"""

from __future__ import annotations

import contextlib
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attention_cases import Case, make_inputs
from checks import assert_matches_reference, reference_results, results

_metal_emulated = pytest.importorskip("jax_fatrain._backends.metal_emulated")
if _metal_emulated.IMPORT_ERROR is not None:
  pytest.fail(f"metal_emulated extension not built: {_metal_emulated.IMPORT_ERROR}",
              pytrace=False)

from jax_fatrain.emulator import profile as metal_profile  # noqa: E402

IMPL = "metal_emulated"
B, N, T, S = "B", "N", "T", "S"


@contextlib.contextmanager
def backward_plan(nsplit: int | None = None, budget: int | None = None, gpu_cores: int = 0):
  """Runs the block with the backward plan's test hooks set (read per call)
  and the emulated GPU's core count (0: not known)."""
  names = {"JAX_FATRAIN_METAL_BWD_NSPLIT": nsplit, "JAX_FATRAIN_METAL_BWD_SCRATCH_BUDGET": budget}
  old = {k: os.environ.get(k) for k in names}
  ext = metal_profile._extension()  # pylint: disable=protected-access
  old_cores = ext.gpu_cores()
  try:
    ext.set_gpu_cores(gpu_cores)
    for k, v in names.items():
      if v is None:
        os.environ.pop(k, None)
      else:
        os.environ[k] = str(v)
    yield
  finally:
    ext.set_gpu_cores(old_cores)
    for k, v in old.items():
      if v is None:
        os.environ.pop(k, None)
      else:
        os.environ[k] = v


def backward_launches(batch, q_heads, kv_heads, q_len, kv_len, head_dim, dtype=jnp.bfloat16,
                      **plan):
  """The backward dispatches (kernel, grid) the plan makes for a problem."""
  rng = np.random.default_rng(0)

  def rand(h, t):
    return jnp.asarray(rng.standard_normal((batch, h, t, head_dim), np.float32), dtype)
  q, k, v, do = rand(q_heads, q_len), rand(kv_heads, kv_len), rand(kv_heads, kv_len), \
      rand(q_heads, q_len)
  import jax_fatrain
  o, lse = jax_fatrain.flash_attn_train_fwd(q, k, v, scale=0.1, causal=False,
                                            implementation="cpu")
  # One threadgroup per dispatch is enough to see the plan.
  with backward_plan(**plan), metal_profile.record(sample=1) as launches:
    jax.block_until_ready(jax_fatrain.flash_attn_train_bwd(q, k, v, o, lse, do, scale=0.1, causal=False,
                                                           implementation=IMPL))
  return [(l["kernel"], tuple(l["grid"])) for l in launches]


def test_plan_fills_the_gpu_with_even_splits():
  # One kv head: ceil(80 / 1) splits wanted, bounded by the 7 key tiles of
  # 64 keys (the fused kernel's tiles at D = 64, 16-bit).
  launches = backward_launches(1, 2, 1, 100, 448, 64)
  assert [n for n, _ in launches] == [
      "flash_attn_train_bwd_compute_d_bf16", "flash_attn_train_bwd_dkdv_dq_bf16_d64",
      "flash_attn_train_bwd_dq_reduce_bf16"]
  assert launches[1][1] == (7, 1, 1)
  assert launches[2][1] == (4, 2, 1)  # ceil(100 / 32) row blocks x query heads
  # 2 x 16 kv heads: ceil(80 / 32) = 3 splits wanted; 7 tiles -> 3 per
  # split at most -> 3 splits (3, 2, 2 tiles).
  launches = backward_launches(2, 16, 16, 40, 448, 64)
  assert launches[1][1] == (3, 16, 2)
  # 10 key tiles, 8 splits wanted -> 2 tiles per split -> 5 splits.
  launches = backward_launches(1, 10, 10, 40, 640, 64)
  assert launches[1][1] == (5, 10, 1)
  # float32 D = 256: 8-key tiles.
  launches = backward_launches(1, 1, 1, 16, 40, 256, jnp.float32)
  assert launches[1] == ("flash_attn_train_bwd_dkdv_dq_f32_d256", (5, 1, 1))


def test_splits_fill_two_threadgroups_per_core_of_the_gpu():
  # bf16 D = 64: 64-key tiles; 10240 keys are 160 tiles, one kv head.
  shape = (1, 1, 1, 16, 10240, 64, jnp.bfloat16)
  splits = lambda **plan: backward_launches(*shape, **plan)[1][1][0]
  # Two threadgroups per core, evened: 8 cores -> 16 splits of 10 tiles;
  # 38 cores -> 76 wanted, 3 tiles per split -> 54 splits; 40 cores -> 80
  # splits of 2 tiles; unknown (0) -> as 40 cores; one core -> 2 splits.
  assert {c: splits(gpu_cores=c) for c in (8, 38, 40, 0, 1)} == {
      8: 16, 38: 54, 40: 80, 0: 80, 1: 2}
  # 2 x 4 kv heads on 8 cores: 16 threadgroups wanted -> 2 splits each.
  launches = backward_launches(2, 4, 4, 16, 10240, 64, jnp.bfloat16, gpu_cores=8)
  assert launches[1][1] == (2, 4, 2)
  # The budget and a forced count still bound a core-aware plan.
  split_bytes = 1 * 1 * 32 * 64 * 4  # B x H_q x rows (16 -> 32) x D floats
  assert splits(gpu_cores=8, budget=5 * split_bytes) == 5
  assert splits(gpu_cores=8, nsplit=40) == 40
  # The emulated GPU's core count is the extension's, set per process.
  ext = metal_profile._extension()  # pylint: disable=protected-access
  with pytest.raises(ValueError, match=">= 0"):
    ext.set_gpu_cores(-1)
  assert ext.gpu_cores() == 0


def test_short_key_tiles_keep_at_least_the_40_core_target():
  # float32 D = 256: 8-key tiles, a fused kernel bound by memory, where a
  # split's later tiles cost more than the reduce they save: GPUs with fewer
  # than 40 cores keep 80 threadgroups; larger ones still take two per core.
  shape = (1, 1, 1, 16, 1280, 256, jnp.float32)  # 160 tiles, one kv head
  splits = lambda **plan: backward_launches(*shape, **plan)[1][1][0]
  assert {c: splits(gpu_cores=c) for c in (8, 38, 0, 100)} == {8: 80, 38: 80, 0: 80, 100: 160}


def test_budget_bounds_the_splits_and_selects_the_two_kernel_form():
  shape = (1, 2, 1, 100, 448, 64)  # 7 fused key tiles
  split_bytes = 1 * 2 * 128 * 64 * 4  # B x H_q x rows (100 -> 128) x D floats
  assert backward_launches(*shape, budget=3 * split_bytes)[1][1] == (3, 1, 1)
  # 5 splits would walk 2, 2, 1, 1, 1 tiles: 4 walk 2, 2, 2, 1 in the same time.
  assert backward_launches(*shape, budget=5 * split_bytes)[1][1] == (4, 1, 1)
  assert backward_launches(*shape, budget=split_bytes)[1][1] == (1, 1, 1)
  launches = backward_launches(*shape, budget=split_bytes - 1)
  assert [n for n, _ in launches] == [
      "flash_attn_train_bwd_compute_d_bf16", "flash_attn_train_bwd_dq_bf16_d64",
      "flash_attn_train_bwd_dkdv_bf16_d64"]
  assert launches[2][1] == (14, 1, 1)  # the two-kernel dK/dV kernel's 32-key tiles
  # A forced split count goes through the same rule's bounds.
  assert backward_launches(*shape, nsplit=4)[1][1] == (4, 1, 1)
  assert backward_launches(*shape, nsplit=50)[1][1] == (7, 1, 1)
  assert backward_launches(*shape, nsplit=4, budget=2 * split_bytes)[1][1] == (2, 1, 1)


def _grads(case, x, **plan):
  with backward_plan(**plan):
    return [np.asarray(g) for g in results(case, x, IMPL)[2]]


# Problems with several key tiles (so that every split count from 1 to the
# number of tiles is possible), GQA, causal or windowed, lengths that are not
# multiples of any tile, rows that see no key.
_SPLIT_CASES = [
    Case(batch=1, q_len=70, kv_len=100, q_heads=4, kv_heads=2, dtype=jnp.bfloat16,
         is_causal=True),
    Case(batch=2, q_len=41, kv_len=53, q_heads=2, kv_heads=1, head_dim=128, dtype=jnp.float16,
         mask_shape=(B, 1, T, S), fully_masked_row=True, kv_lengths=True),
    Case(batch=2, q_len=37, kv_len=45, q_heads=2, kv_heads=2, head_dim=256, dtype=jnp.float32,
         window=(9, 4)),
    Case(batch=2, q_len=100, kv_len=100, q_heads=2, kv_heads=1, head_dim=64,
         dtype=jnp.bfloat16, segments="padding", is_causal=True),
]


@pytest.mark.parametrize("case", _SPLIT_CASES, ids=lambda c: c.id)
def test_every_split_count_is_deterministic_and_correct(case):
  x = make_inputs(case, seed=3)
  want = reference_results(case, x)
  es = jnp.dtype(case.dtype).itemsize
  block_kv = {(64, 2): 64, (128, 2): 32, (256, 2): 16, (64, 4): 32, (128, 4): 16,
              (256, 4): 8}[(case.head_dim, es)]
  tiles = -(-case.kv_len // block_kv)
  assert tiles >= 2
  by_split = {}
  # Half the tiles: with a window (6 tiles, 3 splits) a split's two tiles see
  # rows that do not meet, and the rows between them must be zeroed.
  for nsplit in sorted({1, tiles // 2, tiles}):
    with backward_plan(nsplit=nsplit):
      got = results(case, x, IMPL)
    assert_matches_reference(case, x, got, want)
    first = [np.asarray(g) for g in got[2]]
    second = _grads(case, x, nsplit=nsplit)
    for a, b in zip(first, second):
      assert a.tobytes() == b.tobytes(), nsplit
    by_split[nsplit] = first
  # dK and dV do not depend on the split (each key tile is one threadgroup's
  # work in the same order whatever the split).
  for g in by_split.values():
    for a, b in zip(g[1:], by_split[1][1:]):
      assert a.tobytes() == b.tobytes()


@pytest.mark.parametrize("case", _SPLIT_CASES[:2], ids=lambda c: c.id)
def test_core_aware_split_counts_are_deterministic_and_correct(case):
  """The plan's own split counts for a 1-core, an 8-core and a 40-core GPU:
  two runs bitwise equal, jax.nn matched, dK and dV as with one split."""
  x = make_inputs(case, seed=7)
  want = reference_results(case, x)
  one = _grads(case, x, nsplit=1)
  for cores in (1, 8, 40):
    with backward_plan(gpu_cores=cores):
      got = results(case, x, IMPL)
      again = [np.asarray(g) for g in results(case, x, IMPL)[2]]
    assert_matches_reference(case, x, got, want)
    first = [np.asarray(g) for g in got[2]]
    for a, b in zip(first, again):
      assert a.tobytes() == b.tobytes(), cores
    for a, b in zip(first[1:], one[1:]):
      assert a.tobytes() == b.tobytes(), cores


# The two-kernel form: one case per dtype and head dim, causal or masked.
_TWO_KERNEL_CASES = [
    Case(batch=2, q_len=33, kv_len=47, q_heads=4, kv_heads=2, head_dim=d, dtype=dt,
         is_causal=i % 2 == 0, **({} if i % 2 == 0 else {"mask_shape": (1, N, T, S),
                                                          "fully_masked_row": True}))
    for i, (dt, d) in enumerate((dt, d) for dt in (jnp.float32, jnp.bfloat16, jnp.float16)
                                for d in (64, 128, 256))
]


@pytest.mark.parametrize("case", _TWO_KERNEL_CASES, ids=lambda c: c.id)
def test_two_kernel_form(case):
  x = make_inputs(case, seed=5)
  with backward_plan(budget=0):
    got = results(case, x, IMPL)
  assert_matches_reference(case, x, got, reference_results(case, x))
