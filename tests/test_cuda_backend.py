"""CUDA-only checks: the deterministic backward, the tensor-core path on
multi-tile problems (head dims 64/128/256, GQA, causal, window, BNTH), and the
float32 SIMT path. Skipped where the CUDA extension or a GPU is missing."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_fatrain
from attention_cases import (IMPLEMENTATIONS, TOLERANCE, Case, make_inputs,
                             relative_error)
from checks import assert_matches_reference, reference_results
from jax_fatrain._backends import cuda as _cuda

pytestmark = pytest.mark.skipif("cuda" not in IMPLEMENTATIONS,
                                reason="needs the CUDA extension and a GPU")

B, N, T, S = "B", "N", "T", "S"


def _grads(case, x, deterministic, runs=3):
  """`runs` evaluations of our gradients (one compiled function)."""
  argnums = (0, 1, 2, 3) if x.bias is not None else (0, 1, 2)

  def loss(q, k, v, bias):
    out = jax_fatrain.dot_product_attention(q, k, v, implementation="cuda",
                                            deterministic=deterministic,
                                            **{**x.kwargs(case), "bias": bias})
    return jnp.sum(out.astype(jnp.float32) * x.cotangent.astype(jnp.float32))
  fn = jax.jit(jax.grad(loss, argnums=argnums))
  return [fn(x.q, x.k, x.v, x.bias) for _ in range(runs)]


@functools.lru_cache(maxsize=None)
def _reference_results(case):
  """jax.nn's output, logsumexp and gradients for `case` on its seed-7 inputs,
  computed once per case and shared by all of its kernel rows (it does not
  depend on which of our kernels run)."""
  return reference_results(case, make_inputs(case, seed=7))


def test_deterministic_backward_is_bitwise_reproducible():
  case = Case(batch=2, q_len=300, kv_len=280, q_heads=8, kv_heads=2, is_causal=True,
              dtype=jnp.bfloat16, head_dim=128, bias_shape=(1, N, T, S))
  x = make_inputs(case, seed=11)
  runs = _grads(case, x, deterministic=True)
  for again in runs[1:]:
    for a, b in zip(runs[0], again):
      assert np.array_equal(np.asarray(a), np.asarray(b))
  atomic = _grads(case, x, deterministic=False)[0]
  for a, b in zip(runs[0], atomic):
    assert relative_error(a, b) < 1e-2


LARGE = [
    Case(batch=2, q_len=700, kv_len=650, q_heads=4, kv_heads=2, head_dim=64,
         dtype=jnp.bfloat16, is_causal=True),
    Case(batch=1, q_len=520, kv_len=520, q_heads=4, kv_heads=1, head_dim=128,
         dtype=jnp.bfloat16),
    Case(batch=1, q_len=333, kv_len=400, q_heads=2, kv_heads=2, head_dim=256,
         dtype=jnp.float16, window=(70, 20), kv_lengths=True, q_lengths=True),
    Case(batch=2, q_len=260, kv_len=300, q_heads=8, kv_heads=2, head_dim=128,
         dtype=jnp.bfloat16, mask_shape=(B, 1, T, S), bias_shape=(1, N, T, S)),
    Case(batch=1, q_len=300, kv_len=300, q_heads=16, kv_heads=2, head_dim=256,
         dtype=jnp.bfloat16, is_causal=True),
    # D = 256 without causality, a window, a mask or a bias: the forward's
    # 80-key tiles, the last of them partly past the keys.
    Case(batch=2, q_len=190, kv_len=250, q_heads=4, kv_heads=2, head_dim=256,
         dtype=jnp.float16),
    # Causal D = 256 with four key blocks, two of them past every query: the
    # folded cluster-pair backward's clusters do key blocks 0 and 3, 1 and 2.
    Case(batch=2, q_len=200, kv_len=500, q_heads=4, kv_heads=2, head_dim=256,
         dtype=jnp.float16, is_causal=True),
    # Causal D = 128 with five key blocks, the last not whole, three of them
    # past every query (with causality key j is seen by queries j on): the
    # folded warp-specialised backward's blocks do key blocks 4 and 0, 3 and
    # 1, and 2 alone, so two blocks start with a key block without steps and
    # one has none at all, yet each must write zero dK, dV for those.
    Case(batch=1, q_len=200, kv_len=600, q_heads=4, kv_heads=1, head_dim=128,
         dtype=jnp.float16, is_causal=True),
    # A mask read one score at a time (kv_len 300 is not a whole number of
    # 16-byte chunks, so no kernel stages it): the kernel instances built for
    # problems with a mask or bias.
    Case(batch=1, q_len=333, kv_len=300, q_heads=4, kv_heads=2, head_dim=256,
         dtype=jnp.bfloat16, is_causal=True, mask_shape=(B, 1, T, S)),
    # Shapes whose mask or bias the Hopper kernels stage through shared memory
    # (one score tensor, contiguous keys, S a multiple of 16 bytes' worth).
    Case(batch=2, q_len=320, kv_len=384, q_heads=4, kv_heads=2, head_dim=128,
         dtype=jnp.bfloat16, bias_shape=(1, N, T, S)),
    Case(batch=2, q_len=300, kv_len=256, q_heads=4, kv_heads=4, head_dim=64,
         dtype=jnp.float16, is_causal=True, mask_shape=(B, 1, T, S)),
    Case(batch=2, q_len=200, kv_len=512, q_heads=2, kv_heads=1, head_dim=128,
         dtype=jnp.bfloat16, mask_shape=(B, 1, 1, S), window=(100, 50)),
    # The warp-specialised forward's other staged tiles: a bias at D = 64, a
    # mask at D = 256.
    Case(batch=1, q_len=400, kv_len=272, q_heads=4, kv_heads=2, head_dim=64,
         dtype=jnp.bfloat16, bias_shape=(B, 1, T, S)),
    Case(batch=1, q_len=270, kv_len=320, q_heads=4, kv_heads=1, head_dim=256,
         dtype=jnp.bfloat16, is_causal=True, mask_shape=(1, N, T, S)),
    # The warp-specialised backward: many steps per key block (GQA 8:1, so
    # the steps cross heads and both dSᵀ buffers and Q/dO slots are reused
    # many times), a last query tile of 6 rows, float16.
    Case(batch=2, q_len=390, kv_len=300, q_heads=8, kv_heads=1, head_dim=64,
         dtype=jnp.float16),
    Case(batch=1, q_len=454, kv_len=454, q_heads=8, kv_heads=2, head_dim=128,
         dtype=jnp.bfloat16, is_causal=True, kv_lengths=True),
    # More work items (query blocks, or causal pairs of them) than a Hopper
    # GPU has SMs, so that each block of the persistent forward walks several
    # items of different heads and batches, their K/V tiles and Q loads
    # running on from one item into the next: causal with sequence lengths
    # (items without any key tile among them), a staged mask, and D = 256's
    # 80-key tiles; and three consumers at D = 64 (T >= 2048 without
    # causality), one block per item (kernel_choice.h, hopper_fwd_consumers,
    # hopper_fwd_grid).
    Case(batch=4, q_len=1100, kv_len=1000, q_heads=16, kv_heads=4, head_dim=128,
         dtype=jnp.bfloat16, is_causal=True, q_lengths=True, kv_lengths=True),
    Case(batch=2, q_len=2100, kv_len=900, q_heads=16, kv_heads=8, head_dim=64,
         dtype=jnp.float16, kv_lengths=True),
    Case(batch=2, q_len=1024, kv_len=512, q_heads=16, kv_heads=2, head_dim=128,
         dtype=jnp.bfloat16, mask_shape=(B, 1, T, S)),
    Case(batch=2, q_len=640, kv_len=600, q_heads=16, kv_heads=2, head_dim=256,
         dtype=jnp.bfloat16),
    # Two consumers at D = 64 walking several items per block: causal pairs
    # with sequence lengths; and items of a single key tile each, so that
    # every item's only O += P V follows its only S = Q Kᵀ.
    Case(batch=3, q_len=1000, kv_len=1100, q_heads=16, kv_heads=4, head_dim=64,
         dtype=jnp.bfloat16, is_causal=True, q_lengths=True),
    Case(batch=4, q_len=1000, kv_len=100, q_heads=16, kv_heads=16, head_dim=64,
         dtype=jnp.bfloat16),
    # Three consumers with causality (D = 64, T >= 4096): 23 blocks of 192
    # query rows per head, the last partly past T, folded into 12 items (the
    # middle block alone), more queries than keys.
    Case(batch=1, q_len=4300, kv_len=4200, q_heads=2, kv_heads=1, head_dim=64,
         dtype=jnp.bfloat16, is_causal=True),
    # Packed sequences (segment ids): documents crossing the tiles of every
    # kernel, with the tile ranges narrowed to them; unsorted ids; padding
    # rows that see no key; and ids with a staged bias.
    Case(batch=2, q_len=700, kv_len=700, q_heads=4, kv_heads=1, head_dim=128,
         dtype=jnp.bfloat16, is_causal=True, segments="sorted"),
    Case(batch=1, q_len=520, kv_len=450, q_heads=4, kv_heads=2, head_dim=64,
         dtype=jnp.float16, segments="unsorted"),
    Case(batch=1, q_len=600, kv_len=600, q_heads=16, kv_heads=2, head_dim=256,
         dtype=jnp.bfloat16, is_causal=True, segments="padding"),
    Case(batch=2, q_len=320, kv_len=384, q_heads=4, kv_heads=2, head_dim=128,
         dtype=jnp.bfloat16, bias_shape=(1, N, T, S), segments="sorted"),
]


# Each case runs in both dQ modes on the kernels a Hopper GPU picks by
# default, and on the sm_80 mma.sync kernels (kernel_family("mma_sync")), so
# both tensor-core families are checked on one GPU; the D = 256 cases with a
# window or ids also on the SIMT kernels, the fallback where a GPU lacks the
# shared memory of a tensor-core kernel.
def _kernel_rows(case):
  rows = [(False, "hopper"), (True, "hopper"), (False, "mma_sync")]
  if case.head_dim == 256 and (case.window is not None or case.segments is not None):
    rows.append((False, "simt"))
  return [pytest.param(case, d, k, id=f"{case.id}-{'det' if d else 'atomic'}-{k}")
          for d, k in rows]


def _on_hopper():
  return getattr(jax.devices("cuda")[0], "compute_capability", None) == "9.0"


def _expected_kernels(case, deterministic, family):
  """(must, never): patterns that some launched kernel's name must match, and
  patterns that none may, for what `family` picks on an sm_90 GPU
  (cpp/cuda/kernel_choice.h has the rules). Names are demangled
  (`_cuda.recording_launches`): "bwd_ws_kernel<__nv_bfloat16, 64, true, 0,
  128>(...)". Whether a mask or bias is staged depends on its layout, so
  rows with one check only what does not."""
  if family == "simt":
    return [r"\bfwd_kernel<", r"\bdkdv_kernel<"], [r"_tc_kernel<|_ws_"]
  # dQ: the deterministic mode's own kernel, or the float32 scratch converted.
  must = [r"\bdq_tc_kernel<" if deterministic else r"\bdq_convert_kernel<"]
  if family == "mma_sync":
    return must + [r"\bfwd_tc_kernel<", r"\bbwd_tc_kernel<"], [r"_ws_"]
  plain = case.mask_shape is None and case.bias_shape is None
  d = case.head_dim
  must.append(r"\bfwd_ws_kernel<")
  three = r"WsTile<64, 128, 0, 3>"
  never = [r"\bfwd_tc_kernel<"]
  if (d == 64 and plain and case.q_len >= (4096 if case.is_causal else 2048)
      and case.window is None):
    must.append(three)
  else:
    never.append(three)
  # Longer key tiles where none is masked by a window (or at D = 128 by causality).
  if plain and case.window is None and (d == 256 or (d == 128 and not case.is_causal)):
    must.append(r"WsTile<128, 176, 0, 2>" if d == 128 else r"WsTile<256, 80, 0, 2>")
  if plain and d in (64, 128):
    # Query steps of 128 rows at D = 64 and 80 at D = 128 without a mask or bias.
    must.append(rf"\bbwd_ws_kernel<[^>]*, {d}, (true|false), 0, {128 if d == 64 else 80}>")
  elif plain:
    must.append(r"\bbwd_ws_split_head_kernel<" if deterministic else
                r"\bbwd_ws_cluster_pair_kernel<")
  elif d == 256:
    must.append(r"\bbwd_tc_kernel<")
  return must, never


@pytest.mark.parametrize("case,deterministic,family",
                         [row for case in LARGE for row in _kernel_rows(case)])
def test_multi_tile_against_reference(case, deterministic, family):
  x = make_inputs(case, seed=7)
  ref_out, ref_lse, ref_grads = _reference_results(case)
  with _cuda.kernel_family(family), _cuda.recording_launches() as launched:
    out, lse = jax.block_until_ready(jax.jit(lambda q, k, v: jax_fatrain.dot_product_attention(
        q, k, v, implementation="cuda", return_residual=True, **x.kwargs(case)))(
            x.q, x.k, x.v))
    grads = jax.block_until_ready(_grads(case, x, deterministic, runs=1)[0])
  # The row ran the kernels it asked for (a cap that no longer selects
  # anything would otherwise test the default twice).
  if _on_hopper():
    must, never = _expected_kernels(case, deterministic, family)
    for pattern in must:
      assert any(re.search(pattern, name) for name in launched), (pattern, launched)
    for pattern in never:
      assert not any(re.search(pattern, name) for name in launched), (pattern, launched)
  assert_matches_reference(case, x, (out, lse, grads), (ref_out, ref_lse, ref_grads))


def test_bnth_layout_tensor_core_path():
  case = Case(batch=2, q_len=200, kv_len=330, q_heads=4, kv_heads=2, head_dim=128,
              dtype=jnp.bfloat16)
  x = make_inputs(case, seed=5)
  t = lambda a: jnp.swapaxes(a, 1, 2)
  o, lse = jax_fatrain.flash_attn_train_fwd(t(x.q), t(x.k), t(x.v), scale=0.1,
                                            causal=True, implementation="cuda")
  ref = jax.nn.dot_product_attention(x.q.astype(jnp.float32), x.k.astype(jnp.float32),
                                     x.v.astype(jnp.float32), scale=0.1, is_causal=True)
  assert relative_error(t(o), ref) < TOLERANCE[jnp.bfloat16].out


@pytest.mark.parametrize("family", ["hopper", "mma_sync"])
def test_segment_ids_skip_tiles(family):
  """The tile-visit counters of the tensor-core kernels: a causal pack of 8
  documents visits at most a quarter of the tiles dense causal attention
  visits (1/8 of them plus the tiles on each document's diagonal), in the
  forward and the backward; unsorted ids, which every tile holds all of, skip
  nothing."""
  t, documents = 2048, 8
  case = Case(batch=1, q_len=t, kv_len=t, q_heads=4, kv_heads=1, head_dim=128,
              dtype=jnp.bfloat16, is_causal=True)
  x = make_inputs(case, seed=1)
  packed = jnp.asarray(np.repeat(np.arange(documents, dtype=np.int32), t // documents)[None])
  mixed = jnp.asarray(np.random.default_rng(0).integers(0, 3, (1, t)).astype(np.int32))

  def visits(ids):
    kw = {} if ids is None else dict(q_segment_ids=ids, kv_segment_ids=ids)

    def loss(q, k, v):
      out = jax_fatrain.dot_product_attention(q, k, v, is_causal=True, implementation="cuda",
                                              **kw)
      return jnp.sum(out.astype(jnp.float32) * x.cotangent.astype(jnp.float32))
    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    jax.block_until_ready(grad(x.q, x.k, x.v))   # compile first
    with _cuda.kernel_family(family), _cuda.counting_tile_visits() as counted:
      jax.block_until_ready(grad(x.q, x.k, x.v))
    return counted

  dense, pack, unsorted = visits(None), visits(packed), visits(mixed)
  for stage in ("forward", "backward"):
    assert dense[stage] > 0, (stage, dense)
    assert 0 < pack[stage] <= dense[stage] / 4, (stage, pack, dense)
    assert unsorted[stage] == dense[stage], (stage, unsorted, dense)
