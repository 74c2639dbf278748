"""The MSL emulator as a measuring instrument (jax_fatrain.emulator.profile).

* planted threadgroup-memory races (a missing threadgroup_barrier between a
  write and a read, a simdgroup exchange without simdgroup_barrier, a tile
  overwritten while others read it) and a threadgroup tile overrun are
  reported with kernel, variable, offset and the two threads; the exact
  counters of the self-test kernels, incl. a staged GEMM that runs race-free
  (emulator_selftest.cc);
* counters of our kernels through the metal_emulated FFI path: MMA counts that
  every FlashAttention-2 kernel must have on aligned problems (2 products per
  block forward, 5 in the fused backward, 3 + 4 in the two-kernel one), exact
  output bytes, plausible input bytes, no races;
* segment ids: a causal pack of documents aligned to every tile costs
  exactly the MMAs of its documents run alone, in the forward, the fused
  dK/dV/dQ kernel and the two-kernel backward's dQ and dK/dV kernels (the
  tiles between documents are skipped);
* masks: the forward and dQ kernels stage each key step's mask tile with
  vector loads, so a masked problem's device reads stay coalesced, and the
  tile fits their 30 KiB of threadgroup memory; the dK/dV kernels (both
  forms) stage each query tile's, reading the mask once per query head with
  coalesced lines;
* sampling scales to the full run within tolerance;
* recording is off unless requested, and its arguments are checked;
* the transcendental, bfloat-conversion, shuffle, reduction and working-set
  counters on small kernels with known values (counter_test_kernels.metal,
  built at run time by jax_fatrain.emulator.msl_standalone).
"""

import functools
from pathlib import Path

import numpy as np
import pytest

try:
  from jax_fatrain import _metal_emulated_ffi
except ImportError as e:
  pytest.fail(f"metal_emulated extension not built: {e}", pytrace=False)

from jax_fatrain.emulator import profile as metal_profile  # noqa: E402

RECORD_KEYS = {"kernel", "grid", "threadgroup", "threadgroup_memory_length", "race_reports",
               "sampled_fraction", "call", "target", *metal_profile.COUNTERS}


def test_planted_races_and_overruns_are_reported():
  failures, log = _metal_emulated_ffi.selftest()
  assert failures == 0, log
  assert ("kernel emu_race_missing_barrier, threadgroup (0, 0, 0), thread 32 (simdgroup 1, "
          "lane 0): race on threadgroup memory `partial` bytes [128, 132) of 256: read by "
          "thread 0 (simdgroup 0, lane 0) and write by thread 32 (simdgroup 1, lane 0) with no "
          "threadgroup_barrier(mem_flags::mem_threadgroup) between them") in log
  assert ("kernel emu_simd_exchange, threadgroup (0, 0, 0), thread 1 (simdgroup 0, lane 1): "
          "race on threadgroup memory `slots` bytes [4, 8) of 128: read by thread 0 (simdgroup "
          "0, lane 0) and write by thread 1 (simdgroup 0, lane 1) of the same simdgroup with no "
          "simdgroup_barrier(mem_flags::mem_threadgroup) or threadgroup_barrier between them"
          ) in log
  assert ("thread 96 (simdgroup 3, lane 0): out-of-bounds threadgroup memory write of 4 bytes: "
          "byte offset 512 of `tile` (512 bytes)") in log
  # A staged GEMM that overwrites a tile other simdgroups still read.
  assert ("kernel emu_staged_gemm, threadgroup (0, 0, 0), thread 0 (simdgroup 0, lane 0): race "
          "on threadgroup memory `As` bytes [0, 2) of 2048: read by thread 32 (simdgroup 1, "
          "lane 0) and write by thread 0 (simdgroup 0, lane 0) with no "
          "threadgroup_barrier(mem_flags::mem_threadgroup) between them") in log


def test_counter_names_match_the_extension():
  assert tuple(_metal_emulated_ffi.counter_names()) == metal_profile.COUNTERS


def _by_kernel(launches):
  out = {}
  for launch in launches:
    # run_problem tags the backward's launches with the core count they were
    # planned for (the forward's plan has none).
    keys = RECORD_KEYS | ({"gpu_cores"} if "gpu_cores" in launch else set())
    assert set(launch) == keys, sorted(set(launch) ^ keys)
    assert "gpu_cores" not in launch or launch["target"] == "backward", launch["kernel"]
    kind = next(k for k in ("fwd", "compute_d", "dkdv_dq", "dq_reduce", "dq", "dkdv")
                if f"_{k}_" in launch["kernel"])
    assert kind not in out, launch["kernel"]
    out[kind] = launch
  return out


def _check_launch(launch):
  gx, gy, gz = launch["grid"]
  tx, ty, tz = launch["threadgroup"]
  assert launch["threadgroups_total"] == gx * gy * gz
  assert launch["threads_per_threadgroup"] == tx * ty * tz
  assert launch["races"] == 0 and launch["race_reports"] == []
  assert launch["peak_tg_bytes"] <= 32 * 1024
  if launch["peak_tg_bytes"] == 0:
    assert launch["tg_bytes_read"] == launch["tg_bytes_written"] == 0
  # Lines cover the bytes; a 128-byte line holds two 64-byte ones.
  assert 128 * launch["device_lines128"] >= launch["device_bytes_read"] + launch[
      "device_bytes_written"]
  assert launch["device_lines128"] <= launch["device_lines64"] <= 2 * launch["device_lines128"]
  assert 0.0 < metal_profile.coalescing(launch) <= 1.0
  # Merging a simdgroup's accesses over an interval can only share lines.
  assert launch["device_lines128_merged"] <= launch["device_lines128"]
  assert metal_profile.coalescing(launch) <= metal_profile.coalescing(launch, merged=True)


@pytest.mark.parametrize("dtype,head_dim", [("bfloat16", 64), ("float32", 128)])
def test_counters_of_an_aligned_problem(dtype, head_dim):
  n, d = 64, head_dim
  launches = metal_profile.run_problem(seq_len=n, head_dim=d, dtype=dtype, backward=True)
  k = _by_kernel(launches)
  assert set(k) == {"fwd", "compute_d", "dkdv_dq", "dq_reduce"}
  for launch in launches:
    _check_launch(launch)
    assert launch["sampled_fraction"] == 1.0
    assert launch["threadgroups_executed"] == launch["threadgroups_total"]
  assert k["fwd"]["target"] == "forward" and k["dkdv_dq"]["target"] == "backward"
  assert "gpu_cores" not in k["fwd"] and k["dkdv_dq"]["gpu_cores"] == 0  # planned for "unknown"
  # Lengths multiples of every tile, no mask: S = Q K^T and O = P V are
  # (n/8)(n/8)(d/8) 8x8x8 MMAs each; the backward recomputes S and forms
  # dP = dO V^T, dV = P^T dO, dK = dS^T Q and dQ = dS K, all in the fused
  # kernel (one split per key tile here: n / 64 or n / 16 tiles).
  blocks = (n // 8) * (n // 8) * (d // 8)
  assert k["fwd"]["simdgroup_mma"] == 2 * blocks
  assert k["compute_d"]["simdgroup_mma"] == 0
  assert k["dkdv_dq"]["simdgroup_mma"] == 5 * blocks
  assert k["dq_reduce"]["simdgroup_mma"] == 0
  # Each output element is written once: O and L; D; dK and dV; dQ. The
  # fused kernel also writes every key tile's dS K into its accumulator
  # split: stored by the split's first tile, added to (read and written) by
  # the others, n x d floats per key tile.
  esize = 2 if dtype == "bfloat16" else 4
  x_bytes = n * d * esize
  acc_bytes = n * d * 4
  nsplit = k["dkdv_dq"]["grid"][0]
  tiles = n // (64 if (dtype, head_dim) == ("bfloat16", 64) else 16)
  assert nsplit == tiles
  assert k["fwd"]["device_bytes_written"] == x_bytes + 4 * n
  assert k["compute_d"]["device_bytes_written"] == 4 * n
  assert k["dkdv_dq"]["device_bytes_written"] == 2 * x_bytes + tiles * acc_bytes
  assert k["dq_reduce"]["device_bytes_written"] == x_bytes
  assert k["dq_reduce"]["device_bytes_read"] == nsplit * acc_bytes
  # Q, K and V are each read at least once, K and V at most once per 8 query rows.
  fwd_read = k["fwd"]["device_bytes_read"]
  assert 3 * x_bytes <= fwd_read <= x_bytes + 2 * x_bytes * (n // 8)
  assert k["compute_d"]["device_bytes_read"] >= 2 * x_bytes  # O and dO


def test_causal_fused_backward_moves_only_the_accumulator_rows_its_splits_see():
  """Causal, 4 key tiles of 64 keys (bf16, D = 64), one split per tile: split
  s's keys are invisible to the rows above 64 s, so the fused kernel stores
  only rows 64 s .. n of its accumulator and the reduce reads only those
  (n - 64 s rows per split), not n rows of every split."""
  n, d = 256, 64
  k = _by_kernel(metal_profile.run_problem(seq_len=n, head_dim=d, causal=True, backward=True))
  for launch in k.values():
    _check_launch(launch)
  nsplit = k["dkdv_dq"]["grid"][0]
  assert nsplit == n // 64
  written = sum(n - 64 * s for s in range(nsplit)) * d * 4
  assert k["dq_reduce"]["device_bytes_read"] == written
  x_bytes = n * d * 2
  assert k["dkdv_dq"]["device_bytes_written"] == 2 * x_bytes + written  # dK, dV, accumulators
  assert k["dq_reduce"]["device_bytes_written"] == x_bytes


def test_causal_forward_skips_invisible_blocks():
  n, d = 64, 64
  (fwd,) = metal_profile.run_problem(seq_len=n, head_dim=d, causal=True)
  _check_launch(fwd)
  # At least the 8x8 score blocks on and below the diagonal; fewer than all.
  diagonal_and_below = (n // 8) * (n // 8 + 1) // 2
  assert 2 * diagonal_and_below * (d // 8) <= fwd["simdgroup_mma"] < 2 * (n // 8) ** 2 * (d // 8)


@pytest.mark.parametrize("dtype,head_dim", [("bfloat16", 64), ("float32", 128)])
def test_packed_documents_skip_the_tiles_between_them(dtype, head_dim, monkeypatch):
  """4 documents of 64 tokens (a multiple of every kernel's tiles), causal:
  each kernel's MMAs are 4 times those of one 64-token causal problem, a
  fraction of those of dense causal attention over all 256 tokens (the
  two-kernel backward's dQ and dK/dV kernels through the plan's budget hook)."""
  common = dict(head_dim=head_dim, dtype=dtype, q_heads=2, kv_heads=1, causal=True,
                backward=True)
  for kinds, budget in ((("fwd", "dkdv_dq"), None), (("dq", "dkdv"), "0")):
    if budget is not None:
      monkeypatch.setenv("JAX_FATRAIN_METAL_BWD_SCRATCH_BUDGET", budget)
    packed = _by_kernel(metal_profile.run_problem(seq_len=256, documents=4, **common))
    alone = _by_kernel(metal_profile.run_problem(seq_len=64, **common))
    dense = _by_kernel(metal_profile.run_problem(seq_len=256, **common))
    for kind in kinds:
      _check_launch(packed[kind])
      assert packed[kind]["simdgroup_mma"] == 4 * alone[kind]["simdgroup_mma"], kind
      assert packed[kind]["simdgroup_mma"] < 0.5 * dense[kind]["simdgroup_mma"], kind


@pytest.mark.parametrize("kind", ["additive", "bool"])
def test_masks_are_staged_with_coalesced_loads(kind, monkeypatch):
  """A full [1, 1, T, S] mask, bf16, D = 64 (32 x 32 tiles): the forward and
  dQ kernels read each key step's mask rows as 4-element vectors along the
  keys into threadgroup memory (a 64-byte bf16 or 32-byte bool row segment
  per 8 or 4 lanes), which keeps the kernel's coalescing above 0.7; read
  per score element from the fragments' lanes (8 rows of 16 or 8 bytes per
  load) it would be about 0.25. Same MMAs as without the mask, no races.
  The backward runs in its two-kernel form (the plan's budget hook), whose
  dQ kernel is the one that stages masks."""
  monkeypatch.setenv("JAX_FATRAIN_METAL_BWD_SCRATCH_BUDGET", "0")
  import jax
  import jax.numpy as jnp
  import numpy as np

  import jax_fatrain
  n, d = 128, 64
  rng = np.random.default_rng(5)
  q, k, v, do = (jnp.asarray(rng.standard_normal((1, 2, n, d)), jnp.bfloat16)
                 for _ in range(4))
  mask = (jnp.asarray(rng.standard_normal((1, 1, n, n)), jnp.bfloat16) if kind == "additive"
          else jnp.asarray(rng.random((1, 1, n, n)) < 0.8))
  args = dict(scale=0.125, causal=False, implementation="metal_emulated")
  with metal_profile.record() as launches:
    o, lse = jax.block_until_ready(jax_fatrain.flash_attn_train_fwd(q, k, v, mask, **args))
    jax.block_until_ready(jax_fatrain.flash_attn_train_bwd(q, k, v, o, lse, do, mask, **args))
  plain = _by_kernel(metal_profile.run_problem(seq_len=n, head_dim=d, q_heads=2, kv_heads=2,
                                               backward=True))
  recorded = _by_kernel(launches)
  assert {"fwd", "dq"} <= set(recorded), sorted(recorded)
  for kind_, launch in recorded.items():
    _check_launch(launch)
    assert launch["simdgroup_mma"] == plain[kind_]["simdgroup_mma"], kind_
    if kind_ in ("fwd", "dq"):
      assert launch["peak_tg_bytes"] <= 30 * 1024, kind_
      assert metal_profile.coalescing(launch) > 0.7, (kind_, metal_profile.coalescing(launch))


# The dK/dV kernels' mask reads, coalescing of the mask's own bytes (see
# test_dkdv_masks_are_staged_with_coalesced_loads) at bf16, D = 64: one
# 4-element vector per thread along a row of the key tile (64 keys fused, 32
# two-kernel), so a simdgroup-wide load covers whole rows: 128 (fused additive)
# or 64 bytes of each 128-byte line. Read per score element (8 query rows of 16
# or 8 bytes per fragment load) it is 0.125 (additive) / 0.0625 (bool).
DKDV_MASK_COALESCING = {("fused", "additive"): 1.0, ("fused", "bool"): 0.5,
                        ("two-kernel", "additive"): 0.5, ("two-kernel", "bool"): 0.25}


@pytest.mark.parametrize("form", ["fused", "two-kernel"])
@pytest.mark.parametrize("kind", ["additive", "bool"])
def test_dkdv_masks_are_staged_with_coalesced_loads(form, kind, monkeypatch):
  """bf16, D = 64, T = 128, two query heads of one kv head, a [1, 1, T, S]
  mask: the dK/dV kernel (fused, or the two-kernel form through the plan's
  budget hook) stages each (query head, query tile)'s mask tile with vector
  loads. Against the same problem without a mask, its dispatch reads exactly
  the mask once per query head (no element twice, not even by the
  simdgroups that share a key block at D >= 128), and those bytes' lines
  are as coalesced as DKDV_MASK_COALESCING says; MMAs are unchanged, the
  threadgroup memory stays within 30 KiB, no races."""
  if form == "two-kernel":
    monkeypatch.setenv("JAX_FATRAIN_METAL_BWD_SCRATCH_BUDGET", "0")
  n = 128
  dkdv = "dkdv_dq" if form == "fused" else "dkdv"
  launch = {}
  for name, mask in (("plain", None), ("masked", kind)):
    launch[name] = _by_kernel(metal_profile.run_problem(
        seq_len=n, head_dim=64, q_heads=2, kv_heads=1, backward=True, mask=mask))[dkdv]
    _check_launch(launch[name])
  plain, masked = launch["plain"], launch["masked"]
  assert masked["simdgroup_mma"] == plain["simdgroup_mma"]
  assert masked["peak_tg_bytes"] <= 30 * 1024
  mask_bytes = masked["device_bytes_read"] - plain["device_bytes_read"]
  assert mask_bytes == 2 * n * n * (2 if kind == "additive" else 1), mask_bytes
  lines = masked["device_lines128"] - plain["device_lines128"]
  coalescing = mask_bytes / (128 * lines)
  assert coalescing >= DKDV_MASK_COALESCING[form, kind], coalescing


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_every_dispatch_keeps_two_threadgroups_per_core(dtype, monkeypatch):
  """Threadgroups a core holds at once (jax_fatrain.emulator.model.
  resident_per_core: threadgroup memory and threads against a core's) are at
  least two for every dispatch the plan makes, at every head dim, in both
  forms of the backward (the two-kernel one through the plan's budget hook)."""
  from jax_fatrain.emulator import model as metal_model
  for budget in (None, "0"):
    if budget is not None:
      monkeypatch.setenv("JAX_FATRAIN_METAL_BWD_SCRATCH_BUDGET", budget)
    for head_dim in (64, 128, 256):
      for launch in metal_profile.run_problem(seq_len=64, head_dim=head_dim, dtype=dtype,
                                              q_heads=2, kv_heads=1, backward=True):
        assert metal_model.resident_per_core(launch) >= 2, (
            launch["kernel"], launch["peak_tg_bytes"], launch["threads_per_threadgroup"])


def test_sampling_scales_to_the_full_run():
  problem = dict(seq_len=256, head_dim=128, q_heads=2, kv_heads=1, causal=True, backward=True)
  full = _by_kernel(metal_profile.run_problem(**problem))
  for sample in (0.25, 4):
    part = _by_kernel(metal_profile.run_problem(sample=sample, **problem))
    for kind in ("fwd", "dkdv_dq", "dq_reduce"):
      f, p = full[kind], part[kind]
      # 8 query tiles x 2 heads; dK/dV/dQ: 8 key tiles, one per split; the
      # reduce: 8 blocks of 32 rows x 2 heads.
      total = f["threadgroups_total"]
      assert p["threadgroups_total"] == total == (8 if kind == "dkdv_dq" else 16)
      executed = round(sample * total) if isinstance(sample, float) else min(sample, total)
      assert p["threadgroups_executed"] == executed
      assert p["sampled_fraction"] == executed / total
      for name in ("simdgroup_mma", "device_bytes_read", "device_bytes_written",
                   "device_load_instrs", "device_lines128", "tg_bytes_read", "barriers"):
        assert abs(p[name] - f[name]) <= 0.1 * f[name], (kind, name, p[name], f[name])


def test_recording_is_off_unless_requested():
  assert not metal_profile.recording()
  metal_profile.run_problem(seq_len=16, head_dim=64)
  assert not metal_profile.recording()
  with metal_profile.record() as launches:
    assert metal_profile.recording()
  assert launches == [] and not metal_profile.recording()


def test_record_arguments():
  for bad in (0, -1, 0.0, 1.5):
    with pytest.raises(ValueError):
      with metal_profile.record(sample=bad):
        pass
  with pytest.raises(TypeError):
    with metal_profile.record(sample=True):
      pass
  with metal_profile.record():
    with pytest.raises(RuntimeError, match="already recording"):
      with metal_profile.record():
        pass
  assert not metal_profile.recording()


# ---------------------------------------------------------------------------
# Counters with known values (tests/metal_emulator/counter_test_kernels.metal)
# ---------------------------------------------------------------------------

_COUNTER_KERNELS = Path(__file__).resolve().parent / "metal_emulator" / "counter_test_kernels.metal"


@functools.lru_cache(maxsize=None)
def _counter_library():
  from jax_fatrain.emulator import msl_standalone  # pylint: disable=import-outside-toplevel
  return msl_standalone.build_library(_COUNTER_KERNELS)


def test_alu_counters_of_a_small_kernel():
  import ml_dtypes  # pylint: disable=import-outside-toplevel
  rng = np.random.default_rng(0)
  x = rng.random(128, dtype=np.float32)
  out, outb = np.zeros(128, np.float32), np.zeros(128, ml_dtypes.bfloat16)
  r = _counter_library().dispatch(
      "emu_count_alu", buffers={0: x, 1: x.astype(ml_dtypes.bfloat16), 2: out, 3: outb},
      constants={}, grid=(2, 1, 1), threadgroup=(64, 1, 1), count=True)
  lanes, simdgroups = 128, 4
  assert r["transcendentals"] == 7 * lanes
  assert r["bfloat_conversions"] == 4 * lanes
  assert r["simd_shuffles"] == 3 * simdgroups
  assert r["simd_reductions"] == 3 * simdgroups
  assert r["simdgroup_mma"] == simdgroups
  assert np.all(np.isfinite(out))


@pytest.mark.parametrize("sample", [None, 3])
def test_working_set_counters_of_a_small_kernel(sample):
  gx, gy = 4, 3
  rng = np.random.default_rng(1)
  shared = rng.random(gy * 256, dtype=np.float32)
  own = rng.random(gx * gy * 64, dtype=np.float32)
  out = np.zeros_like(own)
  r = _counter_library().dispatch(
      "emu_count_lines", buffers={0: shared, 1: own, 2: out}, constants={}, grid=(gx, gy, 1),
      threadgroup=(64, 1, 1), count=True, sample=sample)
  tgs = gx * gy
  # Per threadgroup: 8 lines of its row of `shared`, 2 of `own`, 2 of `out`.
  assert r["tg_lines"] == 12 * tgs
  assert r["tg_lines_new_x"] == 4 * tgs   # own and out differ along x, shared does not
  assert r["tg_lines_new_y"] == 12 * tgs  # everything differs along y
  assert r["tg_lines_new_xy"] == 4 * tgs
  # A wave of one row: 8 shared + 4 x (2 + 2); the whole grid: 3 x 8 + 12 x 4.
  assert metal_profile.wave_lines(r, gx) == 8 + gx * 4
  assert metal_profile.wave_lines(r, tgs) == gy * 8 + tgs * 4
  assert metal_profile.wave_lines(r, 1) == 12
  if sample is None:
    # The neighbour probes ran on saved buffers: out was added to once.
    expected = own + np.repeat(shared.reshape(gy, 1, 64, 4).sum(-1), gx, axis=1).reshape(-1)
    np.testing.assert_allclose(out, expected, rtol=1e-6)
