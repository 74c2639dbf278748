"""The Apple-GPU cost model (jax_fatrain.emulator.model) and the --metal-model report.

The model tests use hand-computed examples; the report tests use synthetic
dispatch records; the last tests run the command end to end on a small
problem through the emulator.
"""

import json

import numpy as np
import pytest

from jax_fatrain.bench import metal as metal_benchmark
from jax_fatrain.emulator import model as metal_model


def test_gpu_table_matches_published_fp32_rates():
  # Apple: M1 "2.6 teraflops"; [MB]'s overview: M1 Max 10.6, M2 3.58, M2 Max 13.6.
  tflops = {n: metal_model.GPUS[n].fp32_alu_tflops for n in ("M1", "M1 Max", "M2", "M2 Max")}
  assert tflops["M1"] == pytest.approx(2.617, abs=0.01)
  assert tflops["M1 Max"] == pytest.approx(10.617, abs=0.01)
  assert tflops["M2"] == pytest.approx(3.579, abs=0.01)
  assert tflops["M2 Max"] == pytest.approx(13.6, abs=0.01)
  for name, g in metal_model.GPUS.items():
    assert g.name == name and g.cores > 0 and g.clock_ghz > 1 and g.dram_gb_s > 50
    assert g.l2_kib > 0 and g.slc_mib > 0 and g.device_class in "gscd"
    # The matrix rate is below the ALU peak (a simdgroup_matrix kernel reaches ~80% of it).
    assert g.matrix_tflops() < g.fp32_alu_tflops
  assert {"M1", "M2 Max", "M3 Max", "M4 Max"} <= set(metal_model.GPUS)
  assert not metal_model.GPUS["M2 Max"].bfloat_native and metal_model.GPUS["M3"].bfloat_native


UNIT = metal_model.Fitted(eta_compute=1.0, eta_memory=1.0, barrier_cycles=0.0,
                          host_overhead_s=0.0)

# 64 threadgroups of 128 threads with 16 KiB of threadgroup memory each.
C = {"simdgroup_mma": 1_000_000, "transcendentals": 3.2e6, "bfloat_conversions": 6.4e6,
     "simd_shuffles": 1e5, "simd_reductions": 2e4, "tg_bytes_read": 3e8,
     "tg_bytes_written": 1e8, "device_lines128_merged": 2e4, "threadgroups_total": 64,
     "threads_per_threadgroup": 128, "peak_tg_bytes": 16384, "grid": [64, 1, 1]}


def test_dispatch_time_hand_computed_m1():
  e = metal_model.dispatch_time(C, "M1", fitted=UNIT)
  # M1: 8 cores x 1.278e9 Hz; 64 threadgroups: 8 per core, all cores busy.
  cyc = 8 * 1.278e9
  assert e.active_cores == 8
  # A core holds min(60 KiB / 16 KiB, 1024 / 128) = 3 threadgroups: 12 of the
  # 16 simdgroups that hide the ALUs' latency.
  assert e.resident == 3 and e.occupancy == pytest.approx(0.75)
  # MMAs: 1e6 x 512 / 101.7; exp: 3.2e6 x 4 lane-slots, bfloat: 6.4e6 x 2
  # (software on Apple 7), both over 128 lanes; shuffles: (1e5 + 5 x 2e4) x
  # 128 B / 256 B.
  cycles = 1e6 * 512 / 101.7 + (3.2e6 * 4 + 6.4e6 * 2) / 128 + 2e5 * 0.5
  assert e.terms["compute"] == pytest.approx(cycles / cyc, rel=1e-9)
  assert e.terms["threadgroup"] == pytest.approx(4e8 / (64 * cyc), rel=1e-9)
  assert e.terms["l1"] == pytest.approx(2e4 * 128 / (64 * cyc), rel=1e-9)
  assert e.terms["l2"] == pytest.approx(2e4 * 128 / (32 * cyc), rel=1e-9)
  assert e.terms["barriers"] == 0.0
  # Without working-set counters no line is assumed to repeat within a wave:
  # all 2.56 MB reach the SLC; a wave of 24 threadgroups touches 3/8 of them,
  # which fit in its 8 MiB: no DRAM traffic beyond the (absent) compulsory bytes.
  requested = 2e4 * 128
  assert e.working_set_bytes == pytest.approx(requested * 24 / 64)
  assert e.terms["slc"] == pytest.approx(requested / (2 * 68.25e9))
  assert e.terms["dram"] == 0.0
  e_big = metal_model.dispatch_time(dict(C, device_lines128_merged=2e6), "M1", fitted=UNIT)
  ws = 2e6 * 128 * 24 / 64  # 96 MB: 8 MiB of it stays in the SLC
  assert e_big.terms["dram"] == pytest.approx(2e6 * 128 * (1 - 8 * 2**20 / ws) / 68.25e9)
  assert e_big.bound == "dram"
  # Compute with the occupancy factor paces it.
  assert e.bound == "compute"
  assert e.seconds == pytest.approx(e.terms["compute"] / 0.75, rel=1e-9)
  # Apple 9 converts bfloat in hardware: the M3's compute term has no conversion cost.
  m3 = metal_model.dispatch_time(C, "M3", fitted=UNIT)
  cycles_m3 = 1e6 * 512 / 101.7 + 3.2e6 * 4 / 128 + 2e5 * 0.5
  # (10 cores: 7 rounds for 64 threadgroups, as if 64 / 7 cores were busy.)
  assert m3.active_cores == pytest.approx(64 / 7)
  assert m3.terms["compute"] == pytest.approx(cycles_m3 / (64 / 7 * 1.398e9), rel=1e-9)
  # Fitted efficiencies divide their terms; barriers add latency.
  f = metal_model.Fitted(eta_compute=0.5, eta_memory=1.0, barrier_cycles=100.0,
                         host_overhead_s=1.0)
  slow = metal_model.dispatch_time(dict(C, barriers=640), "M1", fitted=f)
  # 640 barriers x 100 cycles over 8 cores x 3 resident threadgroups.
  assert slow.terms["barriers"] == pytest.approx(640 * 100 / (8 * 3 * 1.278e9))
  assert slow.seconds == pytest.approx(e.seconds * 2 + slow.terms["barriers"])


def test_grid_rounds_and_occupancy():
  # The same work in 64 threadgroups on 40 cores (two rounds on 24 of them)
  # or in 32 (one round on 32 cores) takes the same issue time: no grid-size
  # advantage for the smaller grid.
  one = metal_model.dispatch_time(dict(C, threadgroups_total=64), "M3 Max", fitted=UNIT)
  two = metal_model.dispatch_time(dict(C, threadgroups_total=32), "M3 Max", fitted=UNIT)
  assert one.active_cores == two.active_cores == 32
  assert one.terms["compute"] == pytest.approx(two.terms["compute"])
  # One threadgroup per core: 4 simdgroups of the 16 that hide latency.
  assert two.occupancy == pytest.approx(4 / 16)
  assert one.occupancy == pytest.approx(8 / 16)
  assert metal_model.resident_per_core({"peak_tg_bytes": 32768, "threads_per_threadgroup": 64}) == 1
  assert metal_model.resident_per_core({"peak_tg_bytes": 0, "threads_per_threadgroup": 256}) == 4


def test_cache_levels_follow_the_wave_working_set():
  # 10 threadgroups in a row, each requesting 500 lines: 100 distinct, all
  # shared along x (K/V-like), or all private (Q-like).
  base = {"device_lines128_merged": 5000, "threadgroups_total": 10, "grid": [10, 1, 1],
          "threads_per_threadgroup": 128, "tg_lines": 1000, "tg_lines_new_y": 1000,
          "tg_lines_new_xy": 0, "dram_bytes": 100 * 128}
  shared = metal_model.dispatch_time(dict(base, tg_lines_new_x=0), "M1", fitted=UNIT)
  private = metal_model.dispatch_time(dict(base, tg_lines_new_x=1000, tg_lines_new_xy=1000),
                                      "M1", fitted=UNIT)
  assert shared.working_set_bytes == 100 * 128
  assert private.working_set_bytes == 1000 * 128
  # Shared: every repeat hits the 768 KiB L2; the SLC sees the 100 distinct lines.
  assert shared.terms["slc"] == pytest.approx(100 * 128 / (2 * 68.25e9))
  assert shared.terms["dram"] == pytest.approx(100 * 128 / 68.25e9)
  # Private: 1000 distinct lines reach the SLC, which holds them (no DRAM beyond compulsory).
  assert private.terms["slc"] == pytest.approx(1000 * 128 / (2 * 68.25e9))
  assert private.terms["dram"] == shared.terms["dram"]
  # A working set beyond the SLC sends the repeats to DRAM in proportion.
  huge = dict(base, tg_lines=10 * 2**20 // 128 * 10, tg_lines_new_x=0,
              device_lines128_merged=4 * 10 * 2**20 // 128)
  e = metal_model.dispatch_time(huge, "M1", fitted=UNIT)
  assert e.working_set_bytes == pytest.approx(10 * 2**20, rel=1e-3)
  to_slc = 4 * 10 * 2**20 - 3 * 10 * 2**20 * (768 * 1024 / e.working_set_bytes)
  want = 100 * 128 + (to_slc - 100 * 128) * (1 - 8 / 10)
  assert e.terms["dram"] * 68.25e9 == pytest.approx(want, rel=1e-3)


def test_dtype_selects_the_matrix_rate():
  c = {"simdgroup_mma": 1000, "threadgroups_total": 1000}
  f16 = metal_model.dispatch_time(c, "M4 Max", "float16").terms["compute"]
  f32 = metal_model.dispatch_time(c, "M4 Max", "float32").terms["compute"]
  bf16 = metal_model.dispatch_time(c, "M4 Max", "bfloat16").terms["compute"]
  assert f32 / f16 == pytest.approx(102.5 / 101.7)
  assert bf16 == f32


def test_pass_time_is_the_sum_of_dispatches():
  a = {"simdgroup_mma": 1e6, "threadgroups_total": 100}
  b = {"device_lines128": 1e6, "threadgroups_total": 2, "dram_bytes": 1e6}
  for g in metal_model.DEFAULT_GPUS:
    want = metal_model.dispatch_time(a, g).seconds + metal_model.dispatch_time(b, g).seconds
    assert metal_model.pass_time([a, b], g) == pytest.approx(want)
  got = metal_model.modelled_seconds([a, b])
  assert list(got) == list(metal_model.DEFAULT_GPUS)
  assert metal_model.band(2.0, 0.25) == (1.5, 2.5)


def test_unknown_gpu_is_an_error():
  with pytest.raises(ValueError, match="unknown Apple GPU"):
    metal_model.dispatch_time({}, "M9 Ultra")


def test_describe_says_it_is_a_model():
  text = "\n".join(metal_model.describe())
  assert "MODEL, not a measurement" in text
  for g in metal_model.DEFAULT_GPUS:
    assert f"  {g}:" in text


# ---------------------------------------------------------------------------
# Records and report, from synthetic dispatches
# ---------------------------------------------------------------------------

P = metal_benchmark.Problem(seq_len=1024, head_dim=64, causal=False)


def _dispatch(kernel, mma, dev_bytes, lines, tg=0, executed=8, total=32, races=0):
  return {"kernel": kernel, "grid": [total, 1, 1], "threadgroup": [32, 4, 1],
          "simdgroup_mma": mma, "device_bytes_read": dev_bytes, "device_bytes_written": 0,
          "device_load_instrs": 0, "device_store_instrs": 0, "device_lines64": 2 * lines,
          "device_lines128": lines, "tg_bytes_read": tg, "tg_bytes_written": tg,
          "barriers": 10 * total, "simd_barriers": 0, "peak_tg_bytes": 4096,
          "threadgroups_executed": executed, "threadgroups_total": total,
          "threads_per_threadgroup": 128, "races": races,
          "race_reports": ["race in K_tile"] * races, "sampled_fraction": executed / total}


def _records():
  fwd = [_dispatch("flash_attn_train_fwd_bf16_d64", 2e6, 4e7, 8e6)]
  bwd = [_dispatch("flash_attn_train_bwd_compute_d_bf16", 0, 1e6, 1e4),
         _dispatch("flash_attn_train_bwd_dq_bf16_d64", 4e6, 8e7, 5e6),
         _dispatch("flash_attn_train_bwd_dkdv_bf16_d64", 6e6, 8e7, 5e6)]
  mlx = [_dispatch("steel_attention_bfloat16_bq32_bk32_bd64", 2e6, 2e7, 1.5625e5, tg=1e7)]
  gpus = metal_model.DEFAULT_GPUS
  return [metal_benchmark.summarize("ours", "fwd", P, fwd, gpus),
          metal_benchmark.summarize("ours", "fwd+bwd", P, fwd + bwd, gpus),
          metal_benchmark.summarize("mlx", "fwd", P, mlx, gpus)]


def test_fused_backward_dram_bytes_count_the_accumulators_the_reduce_reads():
  """The fused kernel's and the reduce's compulsory DRAM bytes count the dQ
  accumulator bytes the reduce reads (causal splits leave rows unwritten and
  unread), not nsplit x T x D floats."""
  p = metal_benchmark.Problem(seq_len=1024, head_dim=64, causal=True)
  tensor, rows, split = 1024 * 64 * 2, 1024 * 4, 1024 * 64 * 4
  accum_read = 8.5 * split  # what 16 causal splits of 64 keys write: rows 64 s .. T
  fused = _dispatch("flash_attn_train_bwd_dkdv_dq_bf16_d64", 5e6, 1e8, 1e6, total=16)
  reduce = _dispatch("flash_attn_train_bwd_dq_reduce_bf16", 0, accum_read, 1e5, total=32)
  r = metal_benchmark.summarize("ours", "fwd+bwd", p, [fused, reduce], ["M1"])
  assert [d["dram_bytes"] for d in r["dispatches"]] == [
      6 * tensor + 2 * rows + accum_read, tensor + accum_read]
  # Without a reduce dispatch to read them from: every split's rows.
  assert metal_benchmark.compulsory_bytes(fused["kernel"], p, fused["grid"]) == (
      6 * tensor + 2 * rows + 16 * split)


def test_summarize_fields():
  ours, full, mlx = _records()
  assert ours["flops"] == 4 * 1024 * 1024 * 64
  assert full["flops"] == 3.5 * ours["flops"]
  assert ours["device_bytes"] == 4e7
  assert ours["device_bytes_per_flop"] == pytest.approx(4e7 / ours["flops"])
  assert ours["coalescing"] == pytest.approx(4e7 / (8e6 * 128))
  assert mlx["coalescing"] == pytest.approx(1.0)
  assert mlx["threadgroup_bytes"] == 2e7
  assert full["mma"] == 12e6 and full["barriers"] == 4 * 320
  assert ours["sampled_fraction"] == pytest.approx(0.25)
  assert full["races"] == 0 and full["peak_threadgroup_bytes"] == 4096
  # Compulsory DRAM bytes from the kernels' roles: Q, K, V, O of 1024 x 64 bf16 + float32 L.
  assert ours["dispatches"][0]["dram_bytes"] == 4 * 1024 * 64 * 2 + 1024 * 4
  assert mlx["dispatches"][0]["dram_bytes"] == 4 * 1024 * 64 * 2
  assert [d["dram_bytes"] for d in full["dispatches"][1:]] == [
      2 * 131072 + 4096, 5 * 131072 + 8192, 6 * 131072 + 8192]
  for r in (ours, full, mlx):
    assert set(r["modelled_seconds"]) == set(metal_model.DEFAULT_GPUS)
    for g, s in r["modelled_seconds"].items():
      assert s == pytest.approx(metal_model.pass_time(r["dispatches"], g, "bfloat16"))
      assert s > 0
      # The default calibration error is 0: the band is the value itself.
      assert r["modelled_band"][g] == [s, s]
    assert "not measurements" in r["model_note"]
  cal = metal_benchmark.Calibration(metal_model.FITTED_DEFAULT, 0.2)
  banded = metal_benchmark.summarize("ours", "fwd", P, ours["dispatches"][:1], ["M1"],
                                     calibration=cal)
  s = banded["modelled_seconds"]["M1"]
  assert banded["modelled_band"]["M1"] == pytest.approx([0.8 * s, 1.2 * s])
  # The forward's dispatches appear once in fwd+bwd, before the backward's.
  assert [d["kernel"] for d in full["dispatches"]][0] == "flash_attn_train_fwd_bf16_d64"
  assert ours["modelled_bound"]["M1"] == "dram" and mlx["modelled_bound"]["M1"] == "compute"
  # 8e6 lines x 128 B (1 GB; without working-set counters none assumed to
  # repeat) outweigh 2e6 MMAs: the synthetic uncoalesced forward is bound by
  # the M1's DRAM, MLX's staged one by compute.
  assert ours["dispatches"][0]["modelled_bound"]["M1"] == "dram"
  assert mlx["dispatches"][0]["modelled_bound"]["M1"] == "compute"


def test_summarize_needs_dispatches_and_reports_races():
  with pytest.raises(ValueError, match="no dispatch"):
    metal_benchmark.summarize("ours", "fwd", P, [], ["M1"])
  r = metal_benchmark.summarize(
      "ours", "fwd", P, [_dispatch("flash_attn_train_fwd_bf16_d64", 1, 1, 1, races=2)], ["M1"])
  assert r["races"] == 2 and r["race_reports"] == ["race in K_tile"] * 2


def test_tables_and_ratios():
  records = _records()
  gpus = metal_model.DEFAULT_GPUS
  header, rows = metal_benchmark.build_table(records, gpus)
  assert header[:6] == ["impl", "pass", "T", "D", "causal", "B/FLOP"]
  assert header[-len(gpus):] == [f"{g} us" for g in gpus]
  assert header[-len(gpus) - 1] == "M1 bound" and rows[0][-len(gpus) - 1] == "dram"
  assert [r[:2] for r in rows] == [["ours", "fwd"], ["ours", "fwd+bwd"], ["mlx", "fwd"]]
  assert rows[0][6] == f"{4e7 / (8e6 * 128):.2f}"
  header, rows = metal_benchmark.build_ratios(records, gpus)
  assert len(rows) == 1 and rows[0][:3] == ["1024", "64", "no"]
  assert rows[0][3] == "2.00x"  # device bytes per FLOP: 4e7 / 2e7
  ours, full, mlx = records
  for i, g in enumerate(gpus):
    want = ours["modelled_seconds"][g] / mlx["modelled_seconds"][g]
    assert rows[0][5 + i] == f"{want:.2f}x"
    want = full["modelled_seconds"][g] / ours["modelled_seconds"][g]
    assert rows[0][5 + len(gpus) + i] == f"{want:.2f}x"
  text = metal_benchmark.format_table(header, rows)
  assert "fwd M1 ours/mlx" in text.splitlines()[0]
  # Without MLX records the ratio cells say so instead of inventing numbers.
  _, rows = metal_benchmark.build_ratios(records[:2], gpus)
  assert rows[0][3] == "-" and rows[0][5] == "-"


def test_backward_records_per_core_count():
  """A forward+backward record per core count the backward was planned for,
  each modelling only its GPUs; tables and ratios take each GPU's own."""
  gpus = ["M1", "M4 Max"]
  fwd = [_dispatch("flash_attn_train_fwd_bf16_d64", 2e6, 4e7, 8e6)]
  small = [_dispatch("flash_attn_train_bwd_dkdv_dq_bf16_d64", 6e6, 8e7, 5e6, total=16)]
  large = [_dispatch("flash_attn_train_bwd_dkdv_dq_bf16_d64", 6e6, 8e7, 5e6, total=64)]
  records = [metal_benchmark.summarize("ours", "fwd", P, fwd, gpus),
             metal_benchmark.summarize("ours", "fwd+bwd", P, fwd + small, ["M1"], gpu_cores=8),
             metal_benchmark.summarize("ours", "fwd+bwd", P, fwd + large, ["M4 Max"],
                                       gpu_cores=40)]
  assert records[0]["gpu_cores"] is None and records[1]["gpu_cores"] == 8
  assert set(records[1]["modelled_seconds"]) == {"M1"}
  assert set(records[2]["modelled_seconds"]) == {"M4 Max"}
  header, rows = metal_benchmark.build_table(records, gpus)
  cores, m1, m4 = header.index("cores"), header.index("M1 us"), header.index("M4 Max us")
  assert [r[cores] for r in rows] == ["-", "8", "40"]
  assert rows[1][m4] == "-" and rows[2][m1] == "-" and rows[2][header.index("M1 bound")] == "-"
  header, rows = metal_benchmark.build_ratios(records, gpus)
  for g, full in (("M1", records[1]), ("M4 Max", records[2])):
    want = full["modelled_seconds"][g] / records[0]["modelled_seconds"][g]
    assert rows[0][header.index(f"fwd+bwd/fwd {g}")] == f"{want:.2f}x"


def test_packed_problem_counts_the_work_inside_documents():
  dense = metal_benchmark.Problem(seq_len=1024, head_dim=64, causal=True)
  packed = metal_benchmark.Problem(seq_len=1024, head_dim=64, causal=True, documents=8)
  assert dense.flops("fwd") == 8 * packed.flops("fwd") == 2 * 1024 * 1024 * 64
  assert packed.flops("fwd+bwd") == 3.5 * packed.flops("fwd")
  assert packed.label() == "T=1024 D=64 causal 8 documents"
  # No MLX kernel takes segment ids.
  assert not metal_benchmark.mlx_supports(None, packed)


def test_packed_ratios():
  gpus = metal_model.DEFAULT_GPUS
  dense_p = metal_benchmark.Problem(seq_len=1024, head_dim=64, causal=True)
  packed_p = metal_benchmark.Problem(seq_len=1024, head_dim=64, causal=True, documents=4)
  fwd = lambda mma: [_dispatch("flash_attn_train_fwd_bf16_d64", mma, 4e7, 1e5)]
  records = [metal_benchmark.summarize("ours", "fwd", dense_p, fwd(8e6), gpus),
             metal_benchmark.summarize("ours", "fwd", packed_p, fwd(2e6), gpus)]
  assert records[1]["documents"] == 4 and records[0]["documents"] is None
  header, rows = metal_benchmark.build_packed_ratios(records, gpus)
  assert header[:5] == ["T", "D", "docs", "pass", "MMA dense/packed"]
  assert rows == [["1024", "64", "4", "fwd", "4.00x"] + [
      f"{records[0]['modelled_seconds'][g] / records[1]['modelled_seconds'][g]:.2f}x"
      for g in gpus]]
  _, table = metal_benchmark.build_table(records, gpus)
  assert [r[4] for r in table] == ["yes", "yes, 4 docs"]
  # A pack without its dense counterpart has no ratio row.
  assert metal_benchmark.build_packed_ratios(records[1:], gpus)[1] == []


def test_json_and_plot(tmp_path):
  pytest.importorskip("matplotlib")
  records = _records()
  path = tmp_path / "r.json"
  metal_benchmark.save_json(records, str(path))
  loaded = json.loads(path.read_text())
  required = {"implementation", "pass", "dtype", "head_dim", "seq_len", "causal", "flops",
              "device_bytes", "coalescing", "threadgroup_bytes", "mma", "barriers", "races",
              "sampled_fraction", "modelled_seconds", "modelled_band"}
  assert len(loaded) == 3
  for r in loaded:
    assert required <= set(r)
  assert loaded[2]["modelled_seconds"] == records[2]["modelled_seconds"]
  calib = [{"implementation": "calibration", "chip": "M4 Max", "kernel": "mlx_steel_gemm",
            "dtype": "float32", "batch": 1, "M": 64, "N": 64, "K": 64, "head_dim": None,
            "seq_len": None, "measured_seconds": 1e-3, "modelled_seconds": 1.1e-3,
            "loo_error": 0.12, "source": "https://example.org"}]
  png = tmp_path / "r.png"
  metal_benchmark.plot(calib + records, metal_model.DEFAULT_GPUS, str(png))
  assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_parse_sample():
  assert metal_benchmark.parse_sample("all") is None
  assert metal_benchmark.parse_sample("8") == 8
  assert metal_benchmark.parse_sample("0.25") == 0.25
  for bad in ("0", "1.5", "-2"):
    with pytest.raises(ValueError):
      metal_benchmark.parse_sample(bad)


def test_missing_parts_are_clear_errors(monkeypatch):
  monkeypatch.setattr(metal_benchmark, "_MLX_MODULES", ("jax_fatrain._no_such_module",))
  monkeypatch.setattr(metal_benchmark, "_profile", lambda: None)
  with pytest.raises(metal_benchmark.Unavailable, match="--impls ours"):
    metal_benchmark.run([P], impls=("ours", "mlx"))
  assert metal_benchmark.check_available(("ours",)) is None

  def no_profile():
    raise metal_benchmark.Unavailable("no counters")
  monkeypatch.setattr(metal_benchmark, "_profile", no_profile)
  with pytest.raises(metal_benchmark.Unavailable, match="no counters"):
    metal_benchmark.run([P], impls=("ours",))


def test_mlx_outside_a_source_checkout_is_one_line_and_status_2(monkeypatch, capsys):
  """An installed package has no emulator sources or MLX instantiation files:
  --metal-model says so and exits with status 2 instead of a traceback."""
  from jax_fatrain import benchmark
  from jax_fatrain.emulator import mlx_reference as _mlx_reference
  monkeypatch.setattr(metal_benchmark, "_profile", lambda: None)
  monkeypatch.setattr(_mlx_reference, "source_checkout", lambda: False)
  with pytest.raises(SystemExit) as exit_info:
    benchmark.main(["--metal-model", "--seq-lens", "64", "--head-dims", "64"])
  assert exit_info.value.code == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and "source checkout" in err[0] and "--impls ours" in err[0]


def test_instruments_find_this_checkout_and_their_data():
  """From a source checkout, the instruments in jax_fatrain/emulator/ find the
  emulator sources and MLX's instantiation files two levels up, and the
  calibration data beside them (tools/check_wheel.sh covers an installed copy)."""
  import pathlib

  import jax_fatrain
  from jax_fatrain.emulator import calibration, msl_standalone
  from jax_fatrain.emulator import mlx_reference as _mlx_reference
  root = pathlib.Path(__file__).resolve().parents[1]
  if pathlib.Path(jax_fatrain.__file__).resolve().parents[1] != root:
    pytest.skip("jax_fatrain is not imported from this checkout")
  assert _mlx_reference.source_checkout()
  assert msl_standalone.emulator_dir() == root / "cpp" / "metal" / "emulator"
  assert calibration.DATA.parent == root / "jax_fatrain" / "emulator"
  assert len(calibration.load()) > 0


# ---------------------------------------------------------------------------
# End to end through the emulator (our kernels; a few seconds)
# ---------------------------------------------------------------------------


def test_metal_model_command_ours(tmp_path, capsys):
  pytest.importorskip("matplotlib")
  from jax_fatrain import benchmark
  from jax_fatrain._backends import metal_emulated as _metal_emulated
  if _metal_emulated.IMPORT_ERROR is not None:
    pytest.skip(f"metal_emulated not built: {_metal_emulated.IMPORT_ERROR}")
  T, D = 128, 64
  out = benchmark.main(["--metal-model", "--impls", "ours", "--seq-lens", str(T),
                        "--head-dims", str(D), "--sample", "2",
                        "--json", str(tmp_path / "r.json"), "--plot", str(tmp_path / "r.png")])
  text = capsys.readouterr().out
  assert "MODEL, not a measurement" in text and "fwd+bwd/fwd M1" in text
  records = json.loads((tmp_path / "r.json").read_text())
  assert records == json.loads(json.dumps(out["records"], default=float))
  # The calibration table comes first: every stored point, with its error.
  calib = [r for r in records if r["implementation"] == "calibration"]
  assert len(calib) >= 10 and "leave-one-out error median" in text
  for r in calib:
    assert {"chip", "kernel", "dtype", "head_dim", "seq_len", "measured_seconds",
            "modelled_seconds", "loo_error", "source"} <= set(r)
    assert r["source"].startswith("https://") and abs(r["loo_error"]) < 1
  records = [r for r in records if r["implementation"] != "calibration"]
  # The backward once per core count of the GPUs modelled (M1 8, M2 Max 38,
  # M3 Max and M4 Max 40), each record modelling the GPUs of its count.
  cores = {g: metal_model.gpu(g).cores for g in metal_model.DEFAULT_GPUS}
  counts = sorted(set(cores.values()))
  assert [(r["implementation"], r["pass"], r["causal"], r["gpu_cores"]) for r in records] == [
      x for causal in (False, True) for x in [("ours", "fwd", causal, None)] + [
          ("ours", "fwd+bwd", causal, c) for c in counts]]
  for r in records:
    assert set(r["modelled_seconds"]) == {g for g in cores if r["gpu_cores"] in (None, cores[g])}
  by = {(r["pass"], r["causal"]): r for r in records}
  full = {g: r for r in records if r["pass"] == "fwd+bwd" and not r["causal"]
          for g in r["modelled_seconds"]}
  for r in records:
    assert r["dtype"] == "bfloat16" and r["seq_len"] == T and r["head_dim"] == D
    assert r["races"] == 0
    # At most 2 threadgroups of each dispatch ran: a fraction of every grid
    # with more than 2 tiles (the forward's 4 query tiles among them).
    executed = sum(d["threadgroups_executed"] for d in r["dispatches"])
    total = sum(d["threadgroups_total"] for d in r["dispatches"])
    assert executed <= 2 * len(r["dispatches"]) < total
    assert r["sampled_fraction"] == pytest.approx(executed / total)
    assert 0 < r["coalescing"] <= 1
    # Q, K and V are each read at least once.
    assert r["device_bytes"] >= 3 * T * D * 2
    assert all(s > 0 for s in r["modelled_seconds"].values())
    for g, (lo, hi) in r["modelled_band"].items():
      assert lo < r["modelled_seconds"][g] < hi
  # Q K^T and P V: at least 2 T^2 D multiply-adds, 512 per MMA (scaled from the sample).
  assert by[("fwd", False)]["mma"] >= 2 * T * T * D / 512
  assert by[("fwd", True)]["mma"] < by[("fwd", False)]["mma"]
  # The backward adds at least four T^2 D products (S, dP, dQ, dK, dV: five).
  assert by[("fwd+bwd", False)]["mma"] >= by[("fwd", False)]["mma"] + 4 * T * T * D / 512
  for g in metal_model.DEFAULT_GPUS:
    assert full[g]["modelled_seconds"][g] > by[("fwd", False)]["modelled_seconds"][g]
  kernels = [d["kernel"] for d in by[("fwd+bwd", False)]["dispatches"]]
  assert kernels[0].startswith("flash_attn_train_fwd_bf16_d64")
  assert any(k.startswith("flash_attn_train_bwd_dkdv") for k in kernels)
  assert (tmp_path / "r.png").read_bytes()[:4] == b"\x89PNG"


def test_metal_model_command_with_mlx(capsys):
  from jax_fatrain import benchmark
  from jax_fatrain.emulator import mlx_reference as _mlx_reference
  from jax_fatrain._backends import metal_emulated as _metal_emulated
  if _metal_emulated.IMPORT_ERROR is not None:
    pytest.skip(f"metal_emulated not built: {_metal_emulated.IMPORT_ERROR}")
  try:
    _mlx_reference.fetch_mlx_kernels()
  except _mlx_reference.MlxUnavailable as e:
    pytest.skip(f"MLX's kernel headers are not available: {e}")
  T, D = 128, 64
  out = benchmark.main(["--metal-model", "--seq-lens", str(T), "--head-dims", str(D),
                        "--causal", "off", "--fwd-only", "--sample", "all"])
  records = {r["implementation"]: r for r in out["records"]}
  assert set(records) == {"ours", "mlx", "calibration"}
  mlx = records["mlx"]
  assert mlx["pass"] == "fwd" and mlx["races"] == 0 and mlx["sampled_fraction"] == 1.0
  assert mlx["dispatches"][0]["kernel"].startswith("steel_attention_bfloat16_bq32_bk32_bd64")
  assert mlx["mma"] >= 2 * T * T * D / 512
  # MLX stages Q, K and V in threadgroup memory; each is read from device memory at least once.
  assert mlx["threadgroup_bytes"] > 0 and mlx["device_bytes"] >= 3 * T * D * 2
  text = capsys.readouterr().out
  line = [l for l in text.splitlines() if l.split()[:3] == [str(T), str(D), "no"]]
  assert len(line) == 1 and line[0].count("x") >= 2 + len(metal_model.DEFAULT_GPUS)


def test_metal_model_packed_command(capsys):
  from jax_fatrain import benchmark
  from jax_fatrain._backends import metal_emulated as _metal_emulated
  if _metal_emulated.IMPORT_ERROR is not None:
    pytest.skip(f"metal_emulated not built: {_metal_emulated.IMPORT_ERROR}")
  out = benchmark.main(["--metal-model", "--packed", "--packed-docs", "4", "--seq-lens", "256",
                        "--head-dims", "64", "--sample", "all"])
  text = capsys.readouterr().out
  assert "MMA dense/packed" in text
  records = [r for r in out["records"] if r["implementation"] != "calibration"]
  # Per GPU: the forward+backward records are per core count.
  by = {(r["pass"], r["documents"], g): r for r in records for g in r["modelled_seconds"]}
  assert set(by) == {(p, d, g) for p in ("fwd", "fwd+bwd") for d in (None, 4)
                     for g in metal_model.DEFAULT_GPUS}
  for r in records:
    assert r["implementation"] == "ours" and r["causal"] and r["races"] == 0
  # Four causal documents of 64 tokens: the pack does a fraction of the dense
  # causal call's matrix work (1/4 plus the diagonal tiles of each document).
  for pass_ in ("fwd", "fwd+bwd"):
    for g in metal_model.DEFAULT_GPUS:
      assert 2.0 < by[(pass_, None, g)]["mma"] / by[(pass_, 4, g)]["mma"] <= 4.0
      assert (by[(pass_, 4, g)]["modelled_seconds"][g]
              < by[(pass_, None, g)]["modelled_seconds"][g])


# ---------------------------------------------------------------------------
# Calibration (jax_fatrain/emulator/calibration.json)
# ---------------------------------------------------------------------------

# The stated error of the calibrated model (docs/metal.md): leave-one-out
# relative error, median and worst.
MEDIAN_ERROR, WORST_ERROR = 0.25, 0.50


def test_calibration_data_are_sourced_and_complete():
  from jax_fatrain.emulator import calibration as metal_calibration, profile as metal_profile
  points = metal_calibration.load()
  assert len(points) >= 10 and len({p["chip"] for p in points}) >= 2
  for p in points:
    assert p["chip"] in metal_model.GPUS
    assert p["kernel"] in ("mlx_steel_gemm", "mlx_steel_attention_fwd")
    assert p["source"].startswith("https://") and p["quote"] and p["measured_seconds"] > 0
    (d,) = p["dispatches"]
    assert set(metal_profile.COUNTERS) <= set(d) and d["races"] == 0
    assert d["dram_bytes"] == metal_calibration.compulsory_bytes(p)


def test_model_recomputes_every_calibration_point_within_its_stated_error():
  from jax_fatrain.emulator import calibration as metal_calibration
  result = metal_calibration.calibrate()
  errors = [p["loo_error"] for p in result["points"]]
  assert result["error"]["median_abs"] == pytest.approx(np.median(np.abs(errors)))
  assert result["error"]["median_abs"] <= MEDIAN_ERROR
  for p in result["points"]:
    assert abs(p["loo_error"]) <= WORST_ERROR, (p["chip"], metal_calibration.label(p))
    # The model fitted on all points is at least as close on the average.
    assert abs(p["modelled_seconds"] / p["measured_seconds"] - 1) <= WORST_ERROR
  # A planted error in one point's counters moves its prediction out of the band.
  points = metal_calibration.load()
  points[0]["dispatches"][0]["simdgroup_mma"] *= 8
  bad = metal_calibration.calibrate(points)
  assert abs(bad["points"][0]["loo_error"]) > WORST_ERROR


def test_stored_calibration_counters_match_a_fresh_emulator_run():
  from jax_fatrain.emulator import calibration as metal_calibration, profile as metal_profile
  from jax_fatrain.emulator import mlx_reference as _mlx_reference
  if not _mlx_reference.source_checkout():
    pytest.skip("MLX's kernels run in the emulator only from a source checkout")
  try:
    _mlx_reference.fetch_mlx_kernels()
  except _mlx_reference.MlxUnavailable as e:
    pytest.skip(f"MLX's kernel headers are not available: {e}")
  points = metal_calibration.load()
  # The cheapest point of each kernel: a batched GEMM and an attention forward.
  for kernel in ("mlx_steel_gemm", "mlx_steel_attention_fwd"):
    p = min((p for p in points if p["kernel"] == kernel), key=lambda p: (
        p.get("K", 0) * p.get("M", 0) * p.get("N", 0) or p["seq_len"] ** 2 * p["head_dim"]))
    (fresh,) = metal_calibration.emulate(p, p["emulated"]["sample"])
    (stored,) = p["dispatches"]
    for name in metal_profile.COUNTERS + ("kernel", "dram_bytes"):
      assert fresh[name] == stored[name], (kernel, name)
    assert list(fresh["grid"]) == list(stored["grid"])


# ---------------------------------------------------------------------------
# The model tells the kernels before K/V staging from today's
# ---------------------------------------------------------------------------


def test_model_ranks_unstaged_kernels_slower_than_todays(tmp_path):
  """The forward, dQ and dK/dV kernels of metal_history.UNSTAGED (nothing staged in
  threadgroup memory: every simdgroup reads K and V, resp. Q and dO, from
  device memory) against today's, on the calibrated model: slower by more
  than the error band on every default GPU."""
  import metal_history
  from jax_fatrain.emulator import calibration as metal_calibration, profile as metal_profile
  from jax_fatrain._backends import metal_emulated as _metal_emulated
  if _metal_emulated.IMPORT_ERROR is not None:
    pytest.skip(f"metal_emulated not built: {_metal_emulated.IMPORT_ERROR}")
  if not metal_history.available(metal_history.UNSTAGED):
    pytest.skip(f"commit {metal_history.UNSTAGED} is not in this checkout's history "
                "(shallow clone)")
  T, D, H = 1024, 64, 4
  problem = metal_benchmark.Problem(seq_len=T, head_dim=D, causal=True, heads=H)
  old = metal_history.run_unstaged(tmp_path, seq_len=T, head_dim=D, heads=H, causal=True,
                                   sample=8)
  # Today's passes, whatever dispatches the plan makes: the forward's against
  # the old forward, the backward's (compute-D included) against old dQ + dK/dV.
  new = {"forward": [], "backward": []}
  for d in metal_profile.run_problem(seq_len=T, head_dim=D, q_heads=H, kv_heads=H,
                                     causal=True, backward=True, sample=8):
    new[d["target"]].append(d)
  old = {"forward": [old["fwd"]], "backward": [old["dq"], old["dkdv"]]}
  result = metal_calibration.calibrate()
  fitted, error = result["fitted"], result["error"]["median_abs"]
  for pass_ in ("forward", "backward"):
    assert new[pass_] and all(d["races"] == 0 for d in old[pass_])
    for d in old[pass_] + new[pass_]:
      d["dram_bytes"] = metal_benchmark.compulsory_bytes(d["kernel"], problem)
    for g in metal_model.DEFAULT_GPUS:
      t_old = metal_model.pass_time(old[pass_], g, "bfloat16", fitted)
      t_new = metal_model.pass_time(new[pass_], g, "bfloat16", fitted)
      old_low = metal_model.band(t_old, error)[0]
      new_high = metal_model.band(t_new, error)[1]
      assert old_low > new_high, (pass_, g, t_old, t_new, error)
