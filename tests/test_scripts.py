"""Smoke tests of the user-facing scripts: ``jax_fatrain.demo``, ``jax_fatrain.benchmark``
and its ``--cuda`` mode (its refusal to run without our kernels).

They run the scripts' ``main`` at tiny sizes; speed is never asserted.
"""

import importlib.util
import math
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

try:
  import jax_fatrain
  _IMPORT_ERROR = None if hasattr(jax_fatrain, "dot_product_attention") else (
      "jax_fatrain has no dot_product_attention")
except Exception as e:  # pylint: disable=broad-except
  _IMPORT_ERROR = f"{type(e).__name__}: {e}"

pytestmark = pytest.mark.skipif(
    _IMPORT_ERROR is not None, reason=f"jax_fatrain cannot be imported: {_IMPORT_ERROR}")

_HAVE_TORCH = importlib.util.find_spec("torch") is not None


def _ours_implementation() -> str:
  """"cpu" where its kernels are built, else the pure-JAX "xla" composite."""
  avail = getattr(jax_fatrain, "available_implementations", lambda: ("cpu",))()
  return "cpu" if "cpu" in avail else "xla"


# ---------------------------------------------------------------------------
# demo
# ---------------------------------------------------------------------------

_TINY = ["--steps", "3", "--seq-len", "32", "--batch-size", "2", "--d-model", "32",
         "--heads", "2", "--head-dim", "64", "--layers", "1", "--sample-chars", "8",
         "--timing-reps", "2", "--no-progress"]


def _is_png(path) -> tuple[int, int]:
  """(width, height) of the PNG at ``path``; fails if it is not one."""
  data = open(path, "rb").read()
  assert data[:8] == b"\x89PNG\r\n\x1a\n", data[:8]
  assert data[12:16] == b"IHDR" and data.rstrip(b"\0").endswith(b"IEND\xaeB`\x82")
  from matplotlib import image  # decodes the whole file
  pixels = image.imread(path)
  assert pixels.ndim == 3 and pixels.shape[0] > 100 and pixels.shape[1] > 100
  assert pixels.std() > 0  # not a blank canvas
  return pixels.shape[1], pixels.shape[0]


def test_demo_smoke(tmp_path, capsys):
  """The default (automatic) implementation, both runs, the timing and the plot."""
  from jax_fatrain import demo
  plot = tmp_path / "demo.png"
  result = demo.main(_TINY + ["--plot", str(plot)])
  assert result["config"]["implementation"] is None
  assert result["config"]["kv_heads"] == 1  # grouped-query attention by default
  want = jax_fatrain.explain_implementation(None, jnp.float32, 64)
  assert (result["implementation"], result["implementation_reason"]) == want
  out = capsys.readouterr().out
  assert f"jax_fatrain implementation {want[0]!r} (chosen automatically: {want[1]})" in out
  for key in ("ours", "reference"):
    losses = result[f"losses_{key}"]
    assert len(losses) == 3 and len(result[f"step_times_{key}"]) == 3
    assert all(math.isfinite(x) for x in losses)
    assert math.isfinite(result[f"valid_loss_{key}"])
    assert result[f"step_time_{key}"] > 0
    assert result[f"attention_time_{key}"] > 0
    assert result[f"attention_share_{key}"] == pytest.approx(
        result[f"attention_time_{key}"] / result[f"step_time_{key}"])
  # Same initial parameters and batches: the curves agree to float32 rounding.
  assert result["max_abs_loss_diff"] < 1e-3
  assert result["rel_loss_diff_end"] < 1e-3
  assert result["step_time_ratio"] > 0 and result["attention_time_ratio"] > 0
  assert "attention fwd+bwd alone (1 layer x [2, 32, 2 (kv 1), 64], causal): ours " in out
  assert "of the step)" in out
  assert isinstance(result["sample"], str) and len(result["sample"]) >= 8
  assert result["plot"] == str(plot) and f"plot: {plot}" in out
  width, height = _is_png(plot)
  assert width > height


def test_demo_no_reference_bfloat16(tmp_path, monkeypatch):
  from jax_fatrain import demo
  monkeypatch.chdir(tmp_path)
  result = demo.main(_TINY + ["--no-reference", "--dtype", "bfloat16",
                              "--implementation", _ours_implementation(),
                              "--sample-chars", "0", "--no-plot"])
  assert all(math.isfinite(x) for x in result["losses_ours"])
  assert "losses_reference" not in result and "sample" not in result
  assert "attention_time_reference" not in result and result["attention_time_ours"] > 0
  assert "plot" not in result and not list(tmp_path.iterdir())


@pytest.mark.parametrize("name", jax_fatrain.available_implementations()
                         if _IMPORT_ERROR is None else ())
def test_demo_runs_every_available_implementation(name, tmp_path, monkeypatch):
  from jax_fatrain import demo
  monkeypatch.chdir(tmp_path)
  # Tiny enough for metal_emulated, which interprets the Metal kernels.
  result = demo.main(["--steps", "2", "--seq-len", "16", "--batch-size", "1",
                      "--d-model", "32", "--heads", "2", "--head-dim", "32", "--layers", "1",
                      "--sample-chars", "0", "--timing-reps", "1", "--no-reference",
                      "--no-progress", "--plot", "", "--implementation", name])
  assert result["implementation"] == name
  assert result["implementation_reason"] == "requested explicitly"
  assert all(math.isfinite(x) for x in result["losses_ours"])
  assert "plot" not in result and not list(tmp_path.iterdir())


def test_demo_implementation_argument():
  from jax_fatrain import demo
  assert demo.parse_args([]).implementation is None
  assert demo.parse_args(["--implementation", "auto"]).implementation is None
  for name in jax_fatrain.available_implementations():
    assert demo.parse_args(["--implementation", name]).implementation == name
  assert demo.parse_args(["--no-plot"]).plot == ""
  assert demo.parse_args([]).plot == "jax_fatrain_demo.png"


def test_demo_rejects_an_unknown_implementation(capsys):
  from jax_fatrain import demo
  with pytest.raises(SystemExit) as exc:
    demo.main(["--implementation", "bogus"])
  assert exc.value.code == 2
  err = capsys.readouterr().err
  assert "--implementation: unknown implementation 'bogus'" in err
  assert "Available here: " + ", ".join(jax_fatrain.available_implementations()) in err


def test_demo_rotary_positions_depend_on_distance_only():
  from jax_fatrain import demo
  q = jax.random.normal(jax.random.key(0), (1, 1, 1, 16))
  k = jax.random.normal(jax.random.key(1), (1, 1, 1, 16))
  length = 12
  rq = demo.rotate(jnp.broadcast_to(q, (1, length, 1, 16)))[0, :, 0]
  rk = demo.rotate(jnp.broadcast_to(k, (1, length, 1, 16)))[0, :, 0]
  scores = rq @ rk.T  # [query position, key position]
  np.testing.assert_allclose(jnp.linalg.norm(rq, axis=-1), jnp.linalg.norm(q), rtol=1e-5)
  np.testing.assert_allclose(scores[0, 0], jnp.vdot(q, k), rtol=1e-5)
  for d in (1, 3):
    diagonal = jnp.diagonal(scores, offset=d)
    np.testing.assert_allclose(diagonal, diagonal[0], rtol=1e-4, atol=1e-5)
  assert abs(float(scores[0, 1] - scores[0, 0])) > 1e-3  # the position matters


def test_demo_corpus_ships_with_package():
  from jax_fatrain import demo
  text = demo.load_corpus()
  assert len(text) > 50_000 and not text.startswith("#")
  data = demo.CharData.from_text(text)
  assert data.decode(data.encode("now mia has 3 pears.")) == "now mia has 3 pears."


def _mha_outputs(attention_fn, mask=None, is_causal=False):
  from flax import nnx
  x = jax.random.normal(jax.random.key(0), (2, 24, 32))
  outs = []
  for fn in (attention_fn, None):
    kwargs = {} if fn is None else {"attention_fn": fn}
    mha = nnx.MultiHeadAttention(num_heads=4, num_kv_heads=2, in_features=32,
                                 qkv_features=4 * 64, decode=False, keep_rngs=False,
                                 rngs=nnx.Rngs(1), **kwargs)
    outs.append(mha(x, mask=mask, is_causal=is_causal))
  return outs


@pytest.mark.parametrize("which", ["ours", "jax.nn"])
def test_demo_attention_adapter_matches_nnx_default(which):
  from jax_fatrain import demo
  attention = (demo.fatrain_attention(_ours_implementation()) if which == "ours"
               else demo.reference_attention())
  fn = demo.make_attention_fn(attention)
  # A boolean padding mask broadcast over heads and queries, plus causal.
  keep = jnp.arange(24)[None, :] < jnp.array([24, 17])[:, None]
  mask = keep[:, None, None, :]
  for kwargs in ({}, {"mask": mask}, {"is_causal": True}, {"mask": mask, "is_causal": True}):
    ours, ref = _mha_outputs(fn, **kwargs)
    np.testing.assert_allclose(ours, ref, atol=1e-4, rtol=1e-4, err_msg=str(kwargs.keys()))


def test_demo_attention_adapter_rejects_dropout():
  from jax_fatrain import demo
  fn = demo.make_attention_fn(demo.reference_attention())
  q = jnp.ones((1, 4, 2, 8))
  with pytest.raises(NotImplementedError, match="dropout"):
    fn(q, q, q, dropout_rate=0.1, deterministic=False, dropout_rng=jax.random.key(0))
  # Dropout configured but switched off is accepted.
  assert fn(q, q, q, dropout_rate=0.1, deterministic=True).shape == q.shape


# ---------------------------------------------------------------------------
# benchmark
# ---------------------------------------------------------------------------


def _bench_impls():
  from jax_fatrain import benchmark
  impls = ["ours", "xla"] + (["torch"] if _HAVE_TORCH else [])
  return benchmark, impls


def test_benchmark_smoke():
  benchmark, impls = _bench_impls()
  result = benchmark.main([
      "--seq-lens", "128", "--head-dims", "64", "--causal", "both", "--dtypes", "f32",
      "--impls", ",".join(impls), "--ours-implementation", _ours_implementation()])
  assert result["impls"] == impls
  assert len(result["rows"]) == 4  # causal on/off x fwd, fwd+bwd
  header = result["header"]
  for row in result["rows"]:
    cells = dict(zip(header, row))
    for impl in impls:
      assert float(cells[f"{impl} ms"]) > 0, cells
      assert float(cells[f"{impl} GFLOP/s"]) > 0, cells
    assert cells["xla/ours"].endswith("x")
    if cells["pass"] == "fwd":
      assert float(cells["err vs xla"]) < 1e-4


def test_benchmark_times_the_cpu_device(monkeypatch):
  """The CPU benchmark runs with JAX's CPU device as the default device, so that on a
  machine whose default backend is a GPU it still times the CPU kernels."""
  import jax
  from jax_fatrain.bench import cpu
  seen = []
  monkeypatch.setattr(cpu, "_run", lambda args: seen.append(jax.config.jax_default_device))
  cpu.main(["--quick"])
  assert seen == [jax.devices("cpu")[0]]


def test_benchmark_rows_use_their_own_peak():
  """bfloat16 rows are compared with the bf16 dot-product peak where our kernels run
  vdpbf16ps, every other row with the float32 FMA peak; the extension measures the
  bf16 peak exactly where cpu_isa() is avx512_bf16."""
  import jax_fatrain
  from jax_fatrain.bench import cpu as bench_cpu
  cases = [bench_cpu.Case(T=128, D=64, causal=False, dtype=dt, mode="fwd")
           for dt in ("float32", "bfloat16")]
  seconds = cases[0].flops / 100e9  # 100 GFLOP/s on both rows
  results = {(c, "ours"): bench_cpu.Measurement(seconds=seconds) for c in cases}
  header, rows = bench_cpu.build_rows(cases, ["ours"], results, False,
                                      {"f32 FMA": 200.0, "bf16 dot": 400.0})
  cells = [dict(zip(header, r)) for r in rows]
  assert [(c["ours % of peak"], c["peak"]) for c in cells] == [("50%", "f32 FMA"),
                                                                ("25%", "bf16 dot")]
  header, rows = bench_cpu.build_rows(cases, ["ours"], results, False,
                                      {"f32 FMA": 200.0, "bf16 dot": None})
  assert [dict(zip(header, r))["ours % of peak"] for r in rows] == ["50%", "50%"]
  assert "peak" not in header
  peaks = bench_cpu.measure_peaks()
  assert peaks["f32 FMA"] > 0
  assert (peaks["bf16 dot"] is not None) == (jax_fatrain.cpu_isa() == "avx512_bf16")


def test_benchmark_amx_rows_use_the_amx_peak():
  """On AMX (avx512_amx) bfloat16 forwards, and backwards at head dims that are
  multiples of 32, are compared with the AMX bf16 peak, the other rows with the FMA
  peak; the extension measures the AMX peak exactly where cpu_isa() is avx512_amx."""
  import jax_fatrain
  from jax_fatrain.bench import cpu as bench_cpu
  cases = [bench_cpu.Case(T=128, D=d, causal=False, dtype=dt, mode=mode)
           for dt, d, mode in (("float32", 64, "fwd"), ("bfloat16", 64, "fwd+bwd"),
                               ("bfloat16", 40, "fwd"), ("bfloat16", 40, "fwd+bwd"))]
  results = {(c, "ours"): bench_cpu.Measurement(seconds=c.flops / 100e9) for c in cases}
  header, rows = bench_cpu.build_rows(cases, ["ours"], results, False,
                                      {"f32 FMA": 200.0, "bf16 dot": None, "bf16 AMX": 1000.0})
  cells = [dict(zip(header, r)) for r in rows]
  assert [(c["ours % of peak"], c["peak"]) for c in cells] == [
      ("50%", "f32 FMA"), ("10%", "bf16 AMX"), ("10%", "bf16 AMX"), ("50%", "f32 FMA")]
  peaks = bench_cpu.measure_peaks()
  assert (peaks["bf16 AMX"] is not None) == (jax_fatrain.cpu_isa() == "avx512_amx")
  if peaks["bf16 AMX"] is not None:
    assert peaks["bf16 AMX"] > peaks["f32 FMA"]


def test_benchmark_memory_and_markdown(capsys):
  benchmark, _ = _bench_impls()
  result = benchmark.main([
      "--seq-lens", "128", "--head-dims", "64", "--causal", "on", "--dtypes", "bf16",
      "--fwd-only", "--impls", "ours,xla", "--memory", "--markdown",
      "--ours-implementation", _ours_implementation()])
  cells = dict(zip(result["header"], result["rows"][0]))
  assert float(cells["ours MB"]) >= 0 and float(cells["xla MB"]) >= 0
  out = capsys.readouterr().out
  assert "| T | D | causal |" in out


def test_benchmark_packed_rows():
  """--packed: ours with segment ids against ours dense causal, one row per pass."""
  benchmark, _ = _bench_impls()
  result = benchmark.main(["--packed", "--seq-lens", "512", "--packed-docs", "4",
                           "--head-dims", "64", "--heads", "4", "--repeats", "3"])
  assert [row[5] for row in result["rows"]] == ["fwd", "fwd+bwd"]
  for row in result["rows"]:
    cells = dict(zip(result["header"], row))
    assert (cells["heads"], cells["docs"]) == ("4:1", "4")
    assert float(cells["dense causal ms"]) > 0 and float(cells["packed ms"]) > 0
    assert cells["dense/packed"].endswith("x")


def test_benchmark_cuda_refuses_without_our_kernels():
  """``python -m jax_fatrain.benchmark --cuda`` reaches the CUDA benchmark, which
  says in one line why it cannot run and exits with status 2."""
  from jax_fatrain.bench import cuda as benchmark_cuda
  if benchmark_cuda.cuda_unavailable_reason() is None:
    pytest.skip("our cuda kernels and a GPU are here, so the benchmark would run in full")
  proc = subprocess.run([sys.executable, "-m", "jax_fatrain.benchmark", "--cuda", "--quick"],
                        capture_output=True, text=True, check=False, timeout=300)
  assert proc.returncode == 2, proc.stderr
  assert "benchmark --cuda: cannot run" in proc.stderr and proc.stdout == "", proc


def test_benchmark_cuda_repeat_rotates_and_takes_medians():
  """--repeat's aggregation, with a stand-in for the GPU timing."""
  from jax_fatrain.bench import cuda as benchmark_cuda
  cfg = dict(B=2, N=4, K=4, T=1024, D=64, causal=True)
  calls = []
  times = {"cuda": iter([(2.0, 6.0), (1.0, 3.0), (9.0, 30.0)]),  # ms: fwd, f+b
           "cudnn": iter([(1.0, 4.0), (1.0, 5.0), (1.0, 6.0)])}

  def fake_run(cfg, impl):
    calls.append(impl)
    if impl == "xla":
      return dict(error="xla went wrong")
    fwd_ms, fb_ms = next(times[impl])
    return benchmark_cuda._result(cfg, fwd_ms / 1e3, fb_ms / 1e3)

  row = benchmark_cuda.measure_row(cfg, ("cuda", "cudnn", "xla"), repeat=3, run=fake_run)
  # Round r starts at implementation r mod 3.
  assert calls == ["cuda", "cudnn", "xla", "cudnn", "xla", "cuda", "xla", "cuda", "cudnn"]
  assert row["cuda"]["fwd_ms"] == pytest.approx(2.0)
  assert row["cuda"]["fwdbwd_ms"] == pytest.approx(6.0)
  assert row["cudnn"]["fwdbwd_ms"] == pytest.approx(5.0)
  flops = 4.0 * 2 * 4 * 1024 * 1024 * 64 * 0.5
  assert row["cuda"]["fwd_tflops"] == pytest.approx(flops / 2e-3 / 1e12)
  assert row["cuda"]["fwdbwd_tflops"] == pytest.approx(3.5 * flops / 6e-3 / 1e12)
  assert row["xla"] == {"error": "xla went wrong"}


def test_benchmark_cuda_packed_rows_rotate_and_print(capsys):
  """--packed's aggregation and table, with a stand-in for the GPU timing."""
  from jax_fatrain.bench import cuda as benchmark_cuda
  order = []
  times = {"cuda packed": iter([(1.0, 3.0), (2.0, 5.0)]),
           "cuda dense": iter([(6.0, 20.0), (8.0, 30.0)]),
           "cudnn mask": iter([(4.0, 12.0), (5.0, 14.0)])}

  def fake_run(cfg, variant):
    assert cfg == benchmark_cuda.PACKED
    order.append(variant)
    fwd_ms, fb_ms = next(times[variant])
    # Back to back: the per-call times less a fixed 0.5 ms of host overhead.
    return dict(fwd_ms=fwd_ms, fwdbwd_ms=fb_ms, fwd_b2b_ms=fwd_ms - 0.5,
                fwdbwd_b2b_ms=fb_ms - 0.5)
  rows = benchmark_cuda.packed_rows(repeat=2, run=fake_run)
  assert order == ["cuda packed", "cuda dense", "cudnn mask",
                   "cuda dense", "cudnn mask", "cuda packed"]
  assert rows["cuda packed"] == dict(fwd_ms=1.5, fwdbwd_ms=4.0, fwd_b2b_ms=1.0,
                                     fwdbwd_b2b_ms=3.5)
  assert rows["cuda dense"]["fwdbwd_ms"] == 25.0
  benchmark_cuda.print_packed(rows)
  out = capsys.readouterr().out
  assert "| fwd+bwd, one call at a time | 4.000 | 25.000 | 13.000 | 6.25 | 3.25 |" in out
  assert "| fwd+bwd, back to back | 3.500 | 24.500 | 12.500 | 7.00 | 3.57 |" in out


def test_benchmark_cuda_rejects_a_repeat_below_one(capsys):
  from jax_fatrain.bench import cuda as benchmark_cuda
  with pytest.raises(SystemExit):
    benchmark_cuda.main(["--repeat", "0"])
  assert "--repeat must be at least 1" in capsys.readouterr().err


def test_benchmark_cuda_back_to_back_queues_calls_and_waits_once():
  """_time_back_to_back: warm-up calls, then `rounds` batches of `calls`, timed
  per call (a call of 20 ms reads as 20 ms, not as a batch of 60)."""
  import time
  from jax_fatrain.bench import cuda as benchmark_cuda
  calls = []

  def fn(x):
    calls.append(x)
    time.sleep(0.02)
    return jnp.asarray(x) + 1
  seconds = benchmark_cuda._time_back_to_back(fn, 1.0, calls=3, rounds=2, warm=1)
  assert len(calls) == 1 + 3 * 2
  assert 0.02 <= seconds < 0.04


def test_benchmark_cuda_back_to_back_fills_its_rounds():
  """Without `calls`, a round queues as many calls as fill about `round_s`
  (from the last warm-up call's time), at least one and at most 50."""
  import time
  from jax_fatrain.bench import cuda as benchmark_cuda
  for sleep_s, round_s, want in ((0.02, 0.1, 5), (0.02, 0.001, 1), (0.0, 1.0, 50)):
    calls = []

    def fn(x):
      calls.append(x)
      time.sleep(sleep_s)
      return jnp.asarray(x) + 1
    benchmark_cuda._time_back_to_back(fn, 1.0, rounds=2, warm=2, round_s=round_s)
    got = (len(calls) - 2) / 2
    # A sleep can overrun, so one call fewer than `want` is allowed where
    # the count comes from a measured time.
    assert want - (1 if 1 < want < 50 else 0) <= got <= want, (sleep_s, round_s, got)
