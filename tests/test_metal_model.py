"""The Apple-GPU cost model (jax_fatrain.metal_model) and the --metal-model report.

The model tests use hand-computed examples; the report tests use synthetic
dispatch records; the last tests run the command end to end on a small
problem through the emulator.
"""

import json

import pytest

from jax_fatrain import metal_benchmark, metal_model


def test_gpu_table_matches_published_fp32_rates():
  # Apple: M1 "2.6 teraflops"; [MB]'s overview: M1 Max 10.6, M2 3.58, M2 Max 13.6.
  tflops = {n: metal_model.GPUS[n].fp32_alu_tflops for n in ("M1", "M1 Max", "M2", "M2 Max")}
  assert tflops["M1"] == pytest.approx(2.617, abs=0.01)
  assert tflops["M1 Max"] == pytest.approx(10.617, abs=0.01)
  assert tflops["M2"] == pytest.approx(3.579, abs=0.01)
  assert tflops["M2 Max"] == pytest.approx(13.6, abs=0.01)
  for name in metal_model.DEFAULT_GPUS:
    g = metal_model.GPUS[name]
    assert g.name == name and g.cores > 0 and g.clock_ghz > 1 and g.dram_gb_s > 50
    # The matrix rate is below the ALU peak (a simdgroup_matrix kernel reaches ~80% of it).
    assert g.matrix_tflops() < g.fp32_alu_tflops
  assert {"M1", "M2 Max", "M3 Max", "M4 Max"} <= set(metal_model.GPUS)


def test_dispatch_time_hand_computed_m1():
  # M1: 8 cores x 1.278e9 Hz = 1.0224e10 core-cycles/s (64 threadgroups: all 8 cores busy).
  c = {"simdgroup_mma": 1_000_000, "tg_bytes_read": 3e8, "tg_bytes_written": 1e8,
       "device_lines128": 2e6, "threadgroups_total": 64}
  e = metal_model.dispatch_time(c, "M1")
  assert e.active_cores == 8
  # compute: 1e6 x 512 FMA / (101.7 FMA x 1.0224e10) = 5.12e8 / 1.0397808e12 s
  assert e.terms["compute"] == pytest.approx(4.924115e-4, rel=1e-6)
  # threadgroup: 4e8 B / (64 B x 1.0224e10) = 4e8 / 6.54336e11 s
  assert e.terms["threadgroup"] == pytest.approx(6.113067e-4, rel=1e-6)
  # device: 2e6 lines x 128 B / 6.54336e11 B/s
  assert e.terms["device"] == pytest.approx(3.912363e-4, rel=1e-6)
  assert e.terms["dram"] == 0.0  # no dram_bytes given
  assert e.bound == "threadgroup" and e.seconds == e.terms["threadgroup"]
  # 68.25 MB of compulsory traffic at 68.25 GB/s: exactly 1 ms, now the bound.
  e = metal_model.dispatch_time(dict(c, dram_bytes=68.25e6), "M1")
  assert e.terms["dram"] == pytest.approx(1e-3)
  assert e.bound == "dram" and e.seconds == pytest.approx(1e-3)


def test_dispatch_time_uses_only_cores_with_threadgroups():
  c = {"simdgroup_mma": 380_000, "threadgroups_total": 4}
  few = metal_model.dispatch_time(c, "M2 Max")
  many = metal_model.dispatch_time(dict(c, threadgroups_total=380), "M2 Max")
  assert few.active_cores == 4 and many.active_cores == 38
  assert few.seconds == pytest.approx(many.seconds * 38 / 4)
  # 380000 x 512 / (101.7 x 38 x 1.398e9)
  assert many.seconds == pytest.approx(380_000 * 512 / (101.7 * 38 * 1.398e9))
  # Without threadgroups_total, threadgroups_executed counts.
  alt = metal_model.dispatch_time({"simdgroup_mma": 380_000, "threadgroups_executed": 4},
                                  "M2 Max")
  assert alt.active_cores == 4


def test_dtype_selects_the_matrix_rate():
  c = {"simdgroup_mma": 1000, "threadgroups_total": 1000}
  f16 = metal_model.dispatch_time(c, "M4 Max", "float16").seconds
  f32 = metal_model.dispatch_time(c, "M4 Max", "float32").seconds
  bf16 = metal_model.dispatch_time(c, "M4 Max", "bfloat16").seconds
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
  # More cores and clock: the M4 Max's bound is below the M1's.
  assert got["M4 Max"] < got["M1"]


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
      assert s == pytest.approx(metal_model.pass_time(r["dispatches"], g))
      assert s > 0
    assert "not measurements" in r["model_note"]
  # The forward's dispatches appear once in fwd+bwd, before the backward's.
  assert [d["kernel"] for d in full["dispatches"]][0] == "flash_attn_train_fwd_bf16_d64"
  assert ours["modelled_bound"]["M1"] == "device" and mlx["modelled_bound"]["M1"] == "compute"
  # 8e6 lines x 128 B at 64 B/core-cycle outweigh 2e6 MMAs at 101.7 FMA/core-cycle:
  # the synthetic uncoalesced forward is device-bound, MLX's staged one is not.
  assert ours["dispatches"][0]["modelled_bound"]["M1"] == "device"
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
  assert header[-len(gpus) - 1] == "M1 bound" and rows[0][-len(gpus) - 1] == "device"
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
              "sampled_fraction", "modelled_seconds"}
  assert len(loaded) == 3
  for r in loaded:
    assert required <= set(r)
  assert loaded[2]["modelled_seconds"] == records[2]["modelled_seconds"]
  png = tmp_path / "r.png"
  metal_benchmark.plot(records, metal_model.DEFAULT_GPUS, str(png))
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
  assert [(r["implementation"], r["pass"], r["causal"]) for r in records] == [
      ("ours", "fwd", False), ("ours", "fwd+bwd", False),
      ("ours", "fwd", True), ("ours", "fwd+bwd", True)]
  by = {(r["pass"], r["causal"]): r for r in records}
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
  # Q K^T and P V: at least 2 T^2 D multiply-adds, 512 per MMA (scaled from the sample).
  assert by[("fwd", False)]["mma"] >= 2 * T * T * D / 512
  assert by[("fwd", True)]["mma"] < by[("fwd", False)]["mma"]
  # The backward adds at least four T^2 D products (S, dP, dQ, dK, dV: five).
  assert by[("fwd+bwd", False)]["mma"] >= by[("fwd", False)]["mma"] + 4 * T * T * D / 512
  for g in metal_model.DEFAULT_GPUS:
    assert by[("fwd+bwd", False)]["modelled_seconds"][g] > by[("fwd", False)]["modelled_seconds"][g]
  kernels = [d["kernel"] for d in by[("fwd+bwd", False)]["dispatches"]]
  assert kernels[0].startswith("flash_attn_train_fwd_bf16_d64")
  assert any(k.startswith("flash_attn_train_bwd_dkdv") for k in kernels)
  assert (tmp_path / "r.png").read_bytes()[:4] == b"\x89PNG"


def test_metal_model_command_with_mlx(capsys):
  from jax_fatrain import _mlx_reference, benchmark
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
  assert set(records) == {"ours", "mlx"}
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
  by = {(r["pass"], r["documents"]): r for r in out["records"]}
  assert set(by) == {("fwd", None), ("fwd+bwd", None), ("fwd", 4), ("fwd+bwd", 4)}
  for r in out["records"]:
    assert r["implementation"] == "ours" and r["causal"] and r["races"] == 0
  # Four causal documents of 64 tokens: the pack does a fraction of the dense
  # causal call's matrix work (1/4 plus the diagonal tiles of each document).
  for pass_ in ("fwd", "fwd+bwd"):
    assert 2.0 < by[(pass_, None)]["mma"] / by[(pass_, 4)]["mma"] <= 4.0
    for g in metal_model.DEFAULT_GPUS:
      assert by[(pass_, 4)]["modelled_seconds"][g] < by[(pass_, None)]["modelled_seconds"][g]
