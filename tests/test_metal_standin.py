"""The macOS Metal host, unmodified, executed on Linux through the Metal stand-in.

``cpp/metal/host/executor.cc`` and ``cpp/ffi/metal_ffi.cc`` are built against
the real metal-cpp headers and linked with ``tests/metal_standin`` (an
Objective-C runtime and Metal objects whose GPU is the MSL emulator) into the
``_metal_ffi`` extension, which then serves ``implementation="metal"``:

* the shared suite, one case per kernel variant and the rows that see no key
  run through ``metal`` and agree bitwise with ``metal_emulated`` (same
  kernels, same plan, another executor), and with jax.nn;
* page-aligned operands are bound without a copy, others through staging;
* pipelines are cached per kernel and function-constant values;
* failures of library compilation, pipeline creation and command execution
  reach Python as errors with Metal's text, and the process goes on working;
* a pipeline that allows fewer threads per threadgroup than the plan's, or
  whose SIMD width is not 32, is refused with the kernel and both numbers;
* no Metal device, an Apple6 GPU or macOS 13 (no MSL 3.1) make ``metal``
  unavailable, with the reason;
* the host reads the GPU's core count from the IORegistry (an 8-core M1, a
  40-core M4 Max, an entry without the property: 0), once per process, with
  every IOKit and CoreFoundation object released, and the backward's split
  count is the plan's for that count, bitwise as ``metal_emulated`` planned
  for the same count;
* host bugs planted into a copy of the executor fail these checks.

After every test the stand-in must have no findings (what Metal's API
validation would abort on, messages to released objects, objects
autoreleased with no pool) and no command buffer or encoder left alive.
Skipped only where the stand-in cannot be built (not Linux x86-64, or no
clang and none installable, or metal-cpp not downloadable), saying why; with
JAX_FATRAIN_REQUIRE_METAL_STANDIN=1 (set by CI) that is a failure instead.
"""

from __future__ import annotations

import concurrent.futures
import functools
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_fatrain
from attention_cases import Case, make_inputs
from checks import assert_matches_reference, results
from metal_standin import standin

import test_attention
import test_metal_emulator

B, N, T, S = "B", "N", "T", "S"
TESTS = Path(__file__).resolve().parent


def _build_or_skip(plant=None) -> Path:
  try:
    return standin.build(plant)
  except standin.Unavailable as e:
    if os.environ.get("JAX_FATRAIN_REQUIRE_METAL_STANDIN") == "1":
      pytest.fail(f"JAX_FATRAIN_REQUIRE_METAL_STANDIN=1 but the Metal stand-in cannot be "
                  f"built: {e}")
    pytest.skip(f"the Metal stand-in cannot be built here: {e}")


@pytest.fixture(scope="module")
def metal():
  ext = _build_or_skip()
  # A GPU whose IORegistry entry has no core count: the host plans the
  # backward as metal_emulated does by default, so the shared suite is held to
  # test_metal_emulator.py's results; other counts are compared in
  # test_backward_splits_follow_the_gpu_core_count.
  module = standin.use(ext, device="apple8_no_core_count")
  assert module.IMPORT_ERROR is None, module.IMPORT_ERROR
  yield module
  standin.restore()


@pytest.fixture(autouse=True)
def clean_stand_in(metal):
  standin.reset()
  yield
  report = standin.report()
  assert report["findings"] == [], report["findings"]
  live = report["live_objects"]
  for kind in ("MTLCommandBuffer", "MTLComputeCommandEncoder", "MTLFunction",
               "MTLFunctionConstantValues", "MTLCompileOptions", "NSAutoreleasePool", "NSError"):
    assert live.get(kind, 0) == 0, (kind, live)
  # The staging pool keeps at most 32 buffers.
  assert live.get("MTLBuffer", 0) <= 32, live


@functools.lru_cache(maxsize=None)
def _emulated_for_cores(case: Case, cores: int):
  """metal_emulated's (out, lse, grads) with its backward planned for ``cores``."""
  from jax_fatrain import _metal_emulated_ffi as emulated  # pylint: disable=import-outside-toplevel
  previous = emulated.gpu_cores()
  emulated.set_gpu_cores(cores)
  try:
    x, _ = test_attention.inputs_and_reference(case)
    return results(case, x, "metal_emulated")
  finally:
    emulated.set_gpu_cores(previous)


def check_against_emulated(case: Case) -> None:
  """``metal`` (the host through the stand-in) equals ``metal_emulated`` bitwise,
  with the backward planned for the same GPU core count, and matches jax.nn."""
  x, reference = test_attention.inputs_and_reference(case)
  got = results(case, x, "metal")
  cores = jax_fatrain._metal_ffi.gpu_core_count()  # pylint: disable=protected-access
  # test_metal_emulator.py's results are planned for an unknown count (0).
  want = (test_metal_emulator.emulated_results(case) if cores == 0
          else _emulated_for_cores(case, cores))
  for name, a, b in zip(("out", "lse"), got[:2], want[:2]):
    assert np.asarray(a).tobytes() == np.asarray(b).tobytes(), name
  for name, a, b in zip("qkvb", got[2], want[2]):
    assert np.asarray(a).tobytes() == np.asarray(b).tobytes(), f"d{name}"
  assert_matches_reference(case, x, got, reference)


def test_stand_in_reports_api_misuse():
  """Each misuse of the Metal API is reported, so that "no findings" means something."""
  failures, log = standin.selftest()
  assert failures == 0, log
  assert log.count("\nok ") + log.startswith("ok ") >= 17, log


@pytest.mark.parametrize("case", test_attention.CASES, ids=lambda c: c.id)
def test_shared_suite(case):
  check_against_emulated(case)


@pytest.mark.parametrize("case", test_metal_emulator._VARIANTS, ids=lambda c: c.id)  # pylint: disable=protected-access
def test_kernel_variant(case):
  check_against_emulated(case)


def _page_aligned(shape, dtype, offset=0):
  page = os.sysconf("SC_PAGESIZE")
  nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
  raw = np.empty(nbytes + 2 * page, np.uint8)
  start = (-raw.ctypes.data) % page + offset
  a = raw[start:start + nbytes].view(dtype).reshape(shape)
  a[...] = np.random.default_rng(int(np.prod(shape)) + offset).standard_normal(shape)
  return a


@pytest.mark.parametrize("offset", [0, 64], ids=["page_aligned", "unaligned"])
def test_operands_bound_without_copy_only_when_page_aligned(offset):
  # [1, 64, 4, 64] float32: 64 KiB, a whole number of pages.
  host = [_page_aligned((1, 64, 4, 64), np.float32, offset) for _ in range(3)]
  q, k, v = (jax.device_put(a) for a in host)
  pointers = {a.unsafe_buffer_pointer() for a in (q, k, v)}
  assert pointers == {a.ctypes.data for a in host}  # jax keeps the numpy memory
  standin.reset()
  out = jax_fatrain.dot_product_attention(q, k, v, implementation="metal")
  report = standin.report()
  wrapped = set(report["no_copy_addresses"])
  if offset == 0:
    assert pointers <= wrapped, (pointers, wrapped)
    assert report["counters"]["bindings_no_copy"] >= 3
  else:
    assert not pointers & wrapped
    assert report["counters"]["bindings_allocated"] >= 3  # staged copies
  want = jax_fatrain.dot_product_attention(q, k, v, implementation="metal_emulated")
  assert np.asarray(out).tobytes() == np.asarray(want).tobytes()


def _created_pipelines(fn) -> list[str]:
  standin.reset()
  fn()
  return standin.report()["pipelines"]


def test_pipeline_cache_keys_on_function_constants():
  # A variant no other test runs: float16, head dim 128, a window.
  base = Case(q_len=24, kv_len=24, head_dim=128, dtype=jnp.float16, window=(6, 2))
  x = make_inputs(base, seed=5)

  def forward(causal):
    return lambda: jax_fatrain.dot_product_attention(
        x.q, x.k, x.v, local_window_size=(6, 2), is_causal=causal, implementation="metal")
  first = _created_pipelines(forward(False))
  assert len(first) == 1 and first[0].startswith("flash_attn_train_fwd_f16_d128|")
  assert _created_pipelines(forward(False)) == []  # the same problem: cached
  causal = _created_pipelines(forward(True))  # differs only in do_causal (301)
  assert len(causal) == 1
  assert causal[0] == first[0].replace("|301=0", "|301=1")
  out = jax.block_until_ready(forward(False)())
  want = jax_fatrain.dot_product_attention(x.q, x.k, x.v, local_window_size=(6, 2),
                                           implementation="metal_emulated")
  assert np.asarray(out).tobytes() == np.asarray(want).tobytes()


def test_pipeline_failure_is_an_error_and_the_process_goes_on():
  # A variant no other test runs, so its pipeline is not cached yet.
  case = Case(q_len=12, kv_len=20, head_dim=256, dtype=jnp.float16, kv_lengths=True, q_heads=2,
              kv_heads=1)
  x = make_inputs(case, seed=9)

  def run():
    return jax.block_until_ready(jax_fatrain.dot_product_attention(
        x.q, x.k, x.v, key_value_seq_lengths=x.kv_lengths, implementation="metal"))
  standin.fail("pipeline", "Compiler encountered an internal error (injected)")
  with pytest.raises(Exception, match=r"pipeline for flash_attn_train_fwd_f16_d256.*"
                                      r"Compiler encountered an internal error \(injected\)"):
    run()
  assert standin.report()["counters"]["pipeline_failures"] == 1
  out = run()  # nothing was cached by the failure
  want = jax_fatrain.dot_product_attention(x.q, x.k, x.v, key_value_seq_lengths=x.kv_lengths,
                                           implementation="metal_emulated")
  assert np.asarray(out).tobytes() == np.asarray(want).tobytes()


def test_execution_failure_is_an_error_and_the_process_goes_on():
  case = Case(q_len=16, kv_len=16)
  x = make_inputs(case, seed=2)

  def run():
    return jax.block_until_ready(
        jax_fatrain.dot_product_attention(x.q, x.k, x.v, implementation="metal"))
  message = ("Execution of the command buffer was aborted due to an error during execution. "
             "Caused GPU Timeout Error (00000002:kIOGPUCommandBufferCallbackErrorTimeout) "
             "(injected)")
  standin.fail("execution", message)
  with pytest.raises(Exception, match=r"the Metal command buffer failed: Execution of the "
                                      r"command buffer was aborted.*\(injected\)"):
    run()
  assert standin.report()["counters"]["failed_command_buffers"] == 1
  out = run()
  want = jax_fatrain.dot_product_attention(x.q, x.k, x.v, implementation="metal_emulated")
  assert np.asarray(out).tobytes() == np.asarray(want).tobytes()


def test_concurrent_calls():
  """XLA runs FFI calls on its own threads; each has its autorelease pool."""
  cases = [Case(q_len=20 + i, kv_len=30, is_causal=i % 2 == 0) for i in range(4)]
  inputs = [make_inputs(c, seed=i) for i, c in enumerate(cases)]

  def run(impl, c, x):
    return np.asarray(jax_fatrain.dot_product_attention(
        x.q, x.k, x.v, is_causal=c.is_causal, implementation=impl))
  with concurrent.futures.ThreadPoolExecutor(4) as pool:
    got = list(pool.map(lambda cx: run("metal", *cx), zip(cases, inputs)))
  for c, x, g in zip(cases, inputs, got):
    assert g.tobytes() == run("metal_emulated", c, x).tobytes()


# ---------------------------------------------------------------------------
# In fresh processes: what happens once per process (device, library).
# ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def compilation_cache(tmp_path_factory):
  """A JAX compilation cache shared by the fresh processes below: they compile
  the same programs (the stand-in's extension is called by its FFI targets'
  names, so each process still runs its own, planted bugs included)."""
  return tmp_path_factory.mktemp("jax_compilation_cache")


def _in_fresh_process(ext: Path, device: str, body: str, cache: Path) -> dict:
  script = textwrap.dedent(f"""
      import json, os, sys
      sys.path[:0] = [{str(TESTS)!r}]
      os.environ.setdefault("JAX_FATRAIN_POISON_OUTPUTS", "1")
      from metal_standin import standin
      metal = standin.use(__import__("pathlib").Path({str(ext)!r}), device={device!r})
      import jax, jax.numpy as jnp, numpy as np
      import jax_fatrain
      result = {{}}
  """) + body + "\nprint('RESULT ' + json.dumps(result))\n"
  env = dict(os.environ, JAX_COMPILATION_CACHE_DIR=str(cache),
             JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
             JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
  proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                        timeout=600, cwd=TESTS, env=env)
  lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
  assert proc.returncode == 0 and lines, proc.stdout + proc.stderr
  return json.loads(lines[-1][len("RESULT "):])


_TRY_METAL = textwrap.dedent("""
    q = jnp.ones((1, 8, 1, 64), jnp.float32)
    def attempt():
      try:
        jax.block_until_ready(jax_fatrain.dot_product_attention(q, q, q, implementation="metal"))
        return "ok"
      except Exception as e:
        return str(e)
    result["first"] = attempt()
    result["second"] = attempt()
    result["cpu_after"] = float(jax_fatrain.dot_product_attention(
        q, q, q, implementation="cpu").sum())
    result["report"] = standin.report()
""")


def test_host_compiles_library_once_with_ieee_math(metal, compilation_cache):
  """One library per process, from the packaged source, MSL 3.1, fast math off
  (fully masked rows need IEEE infinities)."""
  r = _in_fresh_process(standin.build(), "apple8", _TRY_METAL, compilation_cache)
  assert r["first"] == r["second"] == "ok", r
  report = r["report"]
  assert report["counters"]["libraries_from_source"] == 1
  assert report["counters"]["libraries_from_file"] == 0  # no metallib on Linux
  assert report["fast_math"] == 0
  assert report["language_version"] == (3 << 16) + 1  # MTLLanguageVersion3_1


def test_library_compile_failure(metal, compilation_cache):
  ext = standin.build()
  r = _in_fresh_process(ext, "apple8", textwrap.dedent("""
      standin.fail("library", "program_source:12:5: error: use of undeclared identifier 'x' (injected)")
  """) + _TRY_METAL, compilation_cache)
  for attempt in ("first", "second"):  # the library is compiled once per process
    assert "jax_fatrain metal: compiling the Metal kernels failed: program_source:12:5: " \
           "error: use of undeclared identifier 'x' (injected)" in r[attempt], r
  assert r["cpu_after"] == 8 * 64
  assert r["report"]["counters"]["library_failures"] == 1
  assert r["report"]["findings"] == []


def test_library_source_must_be_the_packaged_one(metal, compilation_cache):
  ext = standin.build()
  r = _in_fresh_process(ext, "apple8", textwrap.dedent("""
      packaged = metal.kernel_source
      metal.kernel_source = lambda: packaged().replace("threadgroup_barrier", "threadgroup_barier", 1)
  """) + _TRY_METAL, compilation_cache)
  assert "compiling the Metal kernels failed: the source differs from the stand-in's " \
         "kernel library source at line" in r["first"], r
  assert "threadgroup_barier" in r["first"]


@pytest.mark.parametrize("device,reason", [
    ("apple6", "is not an Apple7+ (M1 or newer) GPU with Metal 3"),
    ("none", "no Metal device (MTLCreateSystemDefaultDevice returned nil)"),
    # Metal 3 GPU, but macOS 13 compiles no MSL 3.1 (bfloat).
    ("apple8_macos13", "macOS 14 or newer is needed for Metal Shading Language 3.1 (the kernels' "
                       "bfloat); found macOS 13.6.7"),
], ids=["apple6", "no_device", "macos13"])
def test_unsupported_device_makes_metal_unavailable(metal, device, reason, compilation_cache):
  ext = standin.build()
  r = _in_fresh_process(ext, device, textwrap.dedent("""
      result["available"] = jax_fatrain.available_implementations()
      result["import_error"] = metal.IMPORT_ERROR
      try:
        jax_fatrain.explain_implementation("metal")
        result["explained"] = "no error"
      except ValueError as e:
        result["explained"] = str(e)
  """) + _TRY_METAL, compilation_cache)
  assert "metal" not in r["available"] and reason in r["import_error"], r
  assert "implementation 'metal' is not available: " in r["explained"], r
  assert reason in r["explained"], r
  assert "implementation 'metal' is not available" in r["first"] and reason in r["first"], r
  assert r["cpu_after"] == 8 * 64
  assert r["report"]["counters"]["libraries_from_source"] == 0


def test_macos13_model_cannot_compile_msl_3_1(metal, compilation_cache):
  """What the macOS check spares the user: on the macOS 13 model the Metal 3
  device is there, but compiling the kernels with MSL 3.1 fails."""
  ext = standin.build()
  r = _in_fresh_process(ext, "apple8_macos13", textwrap.dedent("""
      result["init"] = metal._metal_ffi.initialize(metal.kernel_source(), "")
      result["report"] = standin.report()
  """), compilation_cache)
  assert r["init"] == ("compiling the Metal kernels failed: MTLLanguageVersion 3.1 is not "
                       "supported on macOS 13.6 (the stand-in's apple8_macos13 model)"), r
  assert r["report"]["counters"]["library_failures"] == 1


# A pipeline that cannot run its dispatch as planned is refused before anything
# is encoded, naming the kernel and both numbers; other kernels still run.
_LIMITED_PIPELINES = textwrap.dedent("""
    def attempt(dtype, grad):
      q = jnp.linspace(-1, 1, 8 * 64, dtype=jnp.float32).reshape(1, 8, 1, 64).astype(dtype)
      f = lambda q: jax_fatrain.dot_product_attention(q, q, q, implementation="metal")
      try:
        jax.block_until_ready(jax.grad(lambda q: f(q).astype(jnp.float32).sum())(q) if grad
                              else f(q))
        return "ok"
      except Exception as e:
        return str(e)
    result["f32_forward"] = attempt(jnp.float32, False)
    result["f32_grad"] = attempt(jnp.float32, True)
    result["f32_grad_again"] = attempt(jnp.float32, True)
    result["f16_forward"] = attempt(jnp.float16, False)
    result["f16_grad"] = attempt(jnp.float16, True)
    result["cpu_after"] = float(jax_fatrain.dot_product_attention(
        jnp.ones((1, 8, 1, 64)), jnp.ones((1, 8, 1, 64)), jnp.ones((1, 8, 1, 64)),
        implementation="cpu").sum())
    result["report"] = standin.report()
""")


@pytest.mark.parametrize("limit,failing,message,command_buffers", [
    # As Apple's compiler lowers the limit of a kernel with many registers:
    # the float32 fused dK/dV/dQ kernel (8 simdgroups) gets 128 threads.
    (("flash_attn_train_bwd_dkdv_dq_f32", 128, 0), ["f32_grad", "f32_grad_again"],
     "kernel flash_attn_train_bwd_dkdv_dq_f32_d64 allows 128 threads per threadgroup on this device "
     "(maxTotalThreadsPerThreadgroup), the plan asks for 256", 1 + 1 + 1 + 1 + 2),
    # A SIMD width other than the kernels' 32 (the forward also runs in the
    # gradient).
    (("flash_attn_train_fwd_f16", 0, 64), ["f16_forward", "f16_grad"],
     "kernel flash_attn_train_fwd_f16_d64 runs 64 threads per SIMD group on this device "
     "(threadExecutionWidth), the kernels are written for 32", 1 + 2 + 2 + 0 + 0),
], ids=["max_threads", "execution_width"])
def test_pipeline_limits_are_errors(metal, limit, failing, message, command_buffers,
                                    compilation_cache):
  ext = standin.build()
  r = _in_fresh_process(ext, "apple8", f"standin.limit_pipelines(*{limit!r})\n" +
                        _LIMITED_PIPELINES, compilation_cache)
  for attempt in ("f32_forward", "f32_grad", "f32_grad_again", "f16_forward", "f16_grad"):
    if attempt in failing:
      assert f"jax_fatrain metal: {message}" in r[attempt], (attempt, r)
    else:
      assert r[attempt] == "ok", (attempt, r)
  assert r["cpu_after"] == 8 * 64
  report = r["report"]
  assert report["findings"] == [], report  # refused by the host, not by Metal's validation
  # Nothing was encoded for a refused call (a gradient runs a forward and a
  # backward call).
  assert report["counters"]["command_buffers"] == command_buffers, report["counters"]
  assert report["counters"]["failed_command_buffers"] == 0, report["counters"]


# The GPU's core count: from the IORegistry model to the backward's plan.
# bfloat16 D = 64 has 64-key tiles: 10240 keys are 160 tiles of one kv head,
# so the plan's split count (two threadgroups per core, evened over the
# tiles; 80 threadgroups when the count is not known) tells the counts apart.
_CORE_COUNT_PLAN = textwrap.dedent("""
    from jax_fatrain import _metal_emulated_ffi as emulated
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((1, 16, 1, 64)), jnp.bfloat16)
    k = jnp.asarray(rng.standard_normal((1, 10240, 1, 64)), jnp.bfloat16)
    v = jnp.asarray(rng.standard_normal((1, 10240, 1, 64)), jnp.bfloat16)
    def grads(impl):
      f = lambda q, k, v: jax_fatrain.dot_product_attention(q, k, v, implementation=impl).sum()
      return [np.asarray(g) for g in jax.grad(f, argnums=(0, 1, 2))(q, k, v)]
    standin.reset()
    first, second = grads("metal"), grads("metal")
    report = standin.report()
    result["cores"] = metal._metal_ffi.gpu_core_count()
    result["splits"] = [d["grid"][0] for d in report["dispatches"]
                        if d["kernel"] == "flash_attn_train_bwd_dkdv_dq_bf16_d64"]
    result["lookups"] = report["counters"]["registry_lookups"]
    result["registry_live"] = report["registry_live"]
    result["findings"] = report["findings"]
    result["rerun_equal"] = all(a.tobytes() == b.tobytes() for a, b in zip(first, second))
    emulated.set_gpu_cores(EXPECTED_CORES)
    want = grads("metal_emulated")
    result["as_emulated"] = all(a.tobytes() == b.tobytes() for a, b in zip(first, want))
""")


def _core_count_plan(ext, device, expected_cores, cache):
  return _in_fresh_process(ext, device, f"EXPECTED_CORES = {expected_cores}\n" +
                           _CORE_COUNT_PLAN, cache)


@pytest.mark.parametrize("device,cores,splits", [
    ("m1", 8, 16),                     # 16 threadgroups: 10 tiles each
    ("m4_max", 40, 80),                # 80 threadgroups: 2 tiles each
    ("apple8_no_core_count", 0, 80),   # not known: as for 40 cores
])
def test_backward_splits_follow_the_gpu_core_count(metal, device, cores, splits,
                                                   compilation_cache):
  r = _core_count_plan(standin.build(), device, cores, compilation_cache)
  assert r["cores"] == cores, r
  # One fused dispatch per backward, both planned for the count.
  assert r["splits"] == [splits, splits], r
  # Looked up once per process, every registry and CoreFoundation object released.
  assert r["lookups"] == 1, r
  assert all(n == 0 for n in r["registry_live"].values()), r
  assert r["findings"] == [], r
  assert r["rerun_equal"] and r["as_emulated"], r


# ---------------------------------------------------------------------------
# Planted host bugs must fail the checks above.
# ---------------------------------------------------------------------------
# The cases each planted bug runs: one of them must fail check_against_emulated.
_PLANTED_CASES = {
    "q_index": [Case(q_len=20, kv_len=20)],
    "causal_constant": [Case(q_len=20, kv_len=24, is_causal=True)],
    "no_copy_back": [Case(q_len=20, kv_len=20)],
    "no_barrier": [Case(q_len=20, kv_len=20)],
    # Two problems that differ only in a function constant (do_causal).
    "pipeline_key": [Case(q_len=20, kv_len=24), Case(q_len=20, kv_len=24, is_causal=True)],
}


# Planted bugs of the core-count lookup, caught on the 8-core model.
_PLANTED_CORE_COUNT = ("ignore_core_count",)


@pytest.mark.parametrize("plant", sorted(_PLANTED_CASES))
def test_planted_host_bug_is_caught(metal, plant, compilation_cache):
  assert set(_PLANTED_CASES) | set(_PLANTED_CORE_COUNT) == set(standin.PLANTED)
  ext = _build_or_skip(plant)
  r = _in_fresh_process(ext, "apple8", textwrap.dedent(f"""
      import test_metal_standin as t
      result["failures"] = []
      for case in t._PLANTED_CASES[{plant!r}]:
        try:
          t.check_against_emulated(case)
        except Exception as e:
          result["failures"].append(type(e).__name__ + ": " + str(e)[:400])
  """), compilation_cache)
  assert r["failures"], f"planted bug {plant!r} passed every check"


@pytest.mark.parametrize("plant", _PLANTED_CORE_COUNT)
def test_planted_core_count_bug_is_caught(metal, plant, compilation_cache):
  r = _core_count_plan(_build_or_skip(plant), "m1", 8, compilation_cache)
  assert r["splits"] != [16, 16] or not r["as_emulated"], f"planted bug {plant!r} passed"
