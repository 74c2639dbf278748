"""The MSL emulator as a measuring instrument (jax_fatrain.metal_profile).

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
  exactly the MMAs of its documents run alone, in the forward and the fused
  dK/dV/dQ kernel (the tiles between documents are skipped);
* sampling scales to the full run within tolerance;
* recording is off unless requested, and its arguments are checked.
"""

import pytest

try:
  from jax_fatrain import _metal_emulated_ffi
except ImportError as e:
  pytest.fail(f"metal_emulated extension not built: {e}", pytrace=False)

from jax_fatrain import metal_profile  # noqa: E402

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
    assert set(launch) == RECORD_KEYS, sorted(set(launch) ^ RECORD_KEYS)
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
  # Lengths multiples of every tile, no mask: S = Q K^T and O = P V are
  # (n/8)(n/8)(d/8) 8x8x8 MMAs each; the backward recomputes S and forms
  # dP = dO V^T, dV = P^T dO, dK = dS^T Q and dQ = dS K, all in the fused
  # kernel (one split per key tile here: n / 32 or n / 16 tiles).
  blocks = (n // 8) * (n // 8) * (d // 8)
  assert k["fwd"]["simdgroup_mma"] == 2 * blocks
  assert k["compute_d"]["simdgroup_mma"] == 0
  assert k["dkdv_dq"]["simdgroup_mma"] == 5 * blocks
  assert k["dq_reduce"]["simdgroup_mma"] == 0
  # Each output element is written once: O and L; D; dK and dV; dQ. The
  # fused kernel also zeroes its accumulator split and adds every key tile's
  # dS K into it (a read and a write of the n x d floats per key tile).
  esize = 2 if dtype == "bfloat16" else 4
  x_bytes = n * d * esize
  acc_bytes = n * d * 4
  nsplit = k["dkdv_dq"]["grid"][0]
  assert nsplit == n // (32 if (dtype, head_dim) == ("bfloat16", 64) else 16)
  assert k["fwd"]["device_bytes_written"] == x_bytes + 4 * n
  assert k["compute_d"]["device_bytes_written"] == 4 * n
  assert k["dkdv_dq"]["device_bytes_written"] == 2 * x_bytes + 2 * nsplit * acc_bytes
  assert k["dq_reduce"]["device_bytes_written"] == x_bytes
  assert k["dq_reduce"]["device_bytes_read"] == nsplit * acc_bytes
  # Q, K and V are each read at least once, K and V at most once per 8 query rows.
  fwd_read = k["fwd"]["device_bytes_read"]
  assert 3 * x_bytes <= fwd_read <= x_bytes + 2 * x_bytes * (n // 8)
  assert k["compute_d"]["device_bytes_read"] >= 2 * x_bytes  # O and dO


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


def test_sampling_scales_to_the_full_run():
  problem = dict(seq_len=256, head_dim=64, q_heads=2, kv_heads=1, causal=True, backward=True)
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
