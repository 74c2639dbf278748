"""The Metal kernels (jax_fatrain/metal/*.metal), run by the MSL emulator.

* the emulator's self-test: simdgroup_matrix layout and arithmetic, simd
  reductions/shuffles, threadgroup memory and barriers, and planted bugs
  (out-of-bounds write, missing barrier, uninitialised threadgroup memory,
  divergent simd operation, absent optional buffer) that must be reported;
* every kernel variant the dispatch plan can name is compiled in, and every
  one of them (dtype x head_dim x mask kind; forward, compute-D, fused dK/dV/dQ
  and dQ reduce as the plan picks them; the dQ and dK/dV kernels of the
  two-kernel backward in tests/test_metal_fused_backward.py) matches jax.nn in
  values and gradients on small shapes;
* the shared suite of tests/test_attention.py with implementation
  "metal_emulated";
* the backward is deterministic (bitwise equal across runs).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_fatrain
from attention_cases import Case, make_inputs, relative_error
from checks import assert_matches_reference, results

_metal_emulated = pytest.importorskip("jax_fatrain._backends.metal_emulated")
if _metal_emulated.IMPORT_ERROR is not None:
  pytest.fail(f"metal_emulated extension not built: {_metal_emulated.IMPORT_ERROR}",
              pytrace=False)

import test_attention  # noqa: E402  (the shared cases)

IMPL = "metal_emulated"
B, N, T, S = "B", "N", "T", "S"


def test_emulator_selftest():
  failures, log = _metal_emulated.selftest()
  assert failures == 0, log
  # The planted bugs are reported with kernel, buffer index and offset.
  assert "emu_bug_oob_write" in log and "buffer(0) at byte offset 256" in log
  assert "threadgroup_barrier reached by 32 of 64 threads" in log
  assert "32 NaN outputs" in log


def test_every_planned_kernel_is_compiled():
  planned = set(_metal_emulated.planned_kernel_names())
  compiled = set(_metal_emulated.kernel_names())
  # Per dtype: compute-D and the dQ reduce, and per head dim and mask kind
  # the forward, dQ, dK/dV and fused dK/dV/dQ kernels.
  assert len(planned) == 3 * (2 + 3 * 4 * 2)
  assert planned <= compiled, sorted(planned - compiled)
  # The kernel names of mlx_native's flash_attn_train.rs are among them.
  for name in ("flash_attn_train_fwd_bf16_d64", "flash_attn_train_fwd_bf16_d64_boolmask",
               "flash_attn_train_fwd_bf16_d256", "flash_attn_train_fwd_bf16_d256_boolmask"):
    assert name in planned


@functools.lru_cache(maxsize=None)
def emulated_results(case: Case):
  """(out, lse, grads) of metal_emulated on the case's shared inputs, once per
  process: test_metal_standin.py holds ``metal`` bitwise to these."""
  x, _ = test_attention.inputs_and_reference(case)
  return results(case, x, IMPL)


def _check(case: Case):
  x, want = test_attention.inputs_and_reference(case)
  assert_matches_reference(case, x, emulated_results(case), want)


# One case per compiled variant: dtype x head_dim x {additive, boolean} mask,
# cycling GQA 1/2/8, causal on/off, lengths not multiples of the tiles, and
# broadcast mask shapes.
_VARIANT_SHAPES = [
    dict(q_len=37, kv_len=29, q_heads=2, kv_heads=2, is_causal=False),
    dict(q_len=33, kv_len=47, q_heads=4, kv_heads=2, is_causal=True),
    dict(q_len=19, kv_len=40, q_heads=8, kv_heads=1, is_causal=False),
]
_VARIANTS = []
for _i, (_dtype, _d, _kind) in enumerate(
    (dt, d, kind) for dt in (jnp.float32, jnp.bfloat16, jnp.float16)
    for d in (64, 128, 256) for kind in ("bias", "mask")):
  _shape = _VARIANT_SHAPES[_i % 3]
  _score = ((1, N, T, S), (B, 1, 1, S), (1, 1, T, S))[_i % 3]
  _VARIANTS.append(Case(batch=2, head_dim=_d, dtype=_dtype, **_shape,
                        **({"bias_shape": _score} if _kind == "bias" else
                           {"mask_shape": _score, "fully_masked_row": _i % 2 == 1})))


@pytest.mark.parametrize("case", _VARIANTS, ids=lambda c: c.id)
def test_kernel_variant(case):
  _check(case)


def test_aligned_lengths_use_unguarded_paths():
  # Lengths that are multiples of every kernel's tiles, so align_Q / align_K
  # are true (flash_attn_abi.h: at most 32 query rows, 32 keys for the
  # dK/dV kernel).
  _check(Case(q_len=64, kv_len=96, q_heads=4, kv_heads=1, is_causal=True))
  _check(Case(q_len=32, kv_len=64, dtype=jnp.bfloat16, bias_shape=(B, N, T, S)))
  # D = 128 (16-bit: 32-key forward tiles, 16-key dQ tiles) and f32 D = 256
  # (the head dim split over 4 simdgroups; dQ keeps Q in registers).
  _check(Case(q_len=64, kv_len=64, head_dim=128, dtype=jnp.bfloat16, is_causal=True))
  _check(Case(q_len=32, kv_len=64, head_dim=256, q_heads=2, kv_heads=1, window=(20, 3)))


def test_bhld_pair_bnth_layout():
  """The [B, H, L, D] pair (BNTH strides through the same kernels)."""
  rng = np.random.default_rng(11)
  shape_q, shape_kv = (2, 4, 21, 128), (2, 2, 35, 128)
  q, k, v, do = (jnp.asarray(rng.standard_normal(s), jnp.float32)
                 for s in (shape_q, shape_kv, shape_kv, shape_q))
  scale = 1 / np.sqrt(128)
  o, lse = jax_fatrain.flash_attn_train_fwd(q, k, v, scale=scale, causal=True,
                                            implementation=IMPL)
  ro, rlse = jax_fatrain.flash_attn_train_fwd(q, k, v, scale=scale, causal=True,
                                              implementation="cpu")
  assert relative_error(o, ro) < 1e-4 and relative_error(lse, rlse) < 1e-5
  got = jax_fatrain.flash_attn_train_bwd(q, k, v, o, lse, do, scale=scale, causal=True,
                                         implementation=IMPL)
  want = jax_fatrain.flash_attn_train_bwd(q, k, v, ro, rlse, do, scale=scale, causal=True,
                                          implementation="cpu")
  for g, w in zip(got, want):
    assert relative_error(g, w) < 1e-4


def test_backward_is_deterministic():
  case = Case(q_len=45, kv_len=50, q_heads=8, kv_heads=2, is_causal=True, dtype=jnp.bfloat16)
  x = make_inputs(case, seed=7)

  def loss(q, k, v):
    o = jax_fatrain.dot_product_attention(q, k, v, implementation=IMPL, is_causal=True)
    return jnp.sum(o.astype(jnp.float32) * x.cotangent.astype(jnp.float32))
  g = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
  first = [np.asarray(a) for a in g(x.q, x.k, x.v)]
  second = [np.asarray(a) for a in g(x.q, x.k, x.v)]
  for a, b in zip(first, second):
    assert a.tobytes() == b.tobytes()


@pytest.mark.parametrize("case", test_attention.CASES, ids=lambda c: c.id)
def test_shared_suite(case):
  _check(case)


# ---------------------------------------------------------------------------
# Source rules (cpp/metal/emulator/README.md, "Rules"): the pre-pass refuses a
# kernel that Apple's compiler refuses (or would spill to the stack); planted
# breaks in tests/metal_emulator/rules/.
# ---------------------------------------------------------------------------
import re  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

from jax_fatrain.emulator import msl_standalone  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
PREPASS = ROOT / "cpp" / "metal" / "emulator" / "msl_prepass.py"
RULES_DIR = ROOT / "tests" / "metal_emulator" / "rules"
PACKAGE_KERNELS = [ROOT / "jax_fatrain" / "metal" / f"{name}.metal"
                   for name in ("flash_attn_train_fwd", "flash_attn_train_bwd")]


def _prepass(path, *args):
  out = Path(path).with_suffix(".cc").name
  import tempfile  # pylint: disable=import-outside-toplevel
  with tempfile.TemporaryDirectory() as tmp:
    proc = subprocess.run([sys.executable, str(PREPASS), str(path), str(Path(tmp) / out),
                           "--cxx", "c++", *args], capture_output=True, text=True)
  return proc.returncode, proc.stderr


def _findings(stderr, rule):
  """(file name, line) of each finding of `rule`."""
  return [(Path(m.group(1)).name, int(m.group(2)))
          for m in re.finditer(rf"^(.*?):(\d+): error: \[{rule}\]", stderr, re.M)]


@functools.lru_cache(maxsize=None)
def _clang():
  """clang++ for the address-space rule (installed with apt-get when root,
  as for the Metal stand-in)."""
  from metal_standin import standin  # pylint: disable=import-outside-toplevel
  try:
    return standin.clang()
  except standin.Unavailable as e:
    pytest.skip(f"the address-space rule needs clang++: {e}")


def test_rule_unroll_refuses_arrays_indexed_by_loops_not_unrolled():
  rc, err = _prepass(RULES_DIR / "unroll_missing_pragma.metal")
  assert rc == 1, err
  # Only the third loop (line 20): the pragma and the macro-of-a-macro
  # _Pragma spelling both count; `partial[j]` with j = 3 - i counts as i.
  assert sorted(set(_findings(err, "unroll"))) == [("unroll_missing_pragma.metal", 20)], err
  assert "`acc`" in err and "`partial`" in err and "for (int i = 0; i < 4; ++i)" in err
  # A skipped rule (as for kernels kept only to be measured) does not refuse.
  rc, err = _prepass(RULES_DIR / "unroll_missing_pragma.metal", "--skip-rule", "unroll")
  assert rc == 0, err


def test_rule_unroll_sees_member_arrays_of_thread_structs():
  rc, err = _prepass(RULES_DIR / "unroll_member_array.metal")
  assert rc == 1, err
  # In a member function and through a thread reference; not through a
  # threadgroup pointer (line 34).
  assert _findings(err, "unroll") == [("unroll_member_array.metal", 14),
                                      ("unroll_member_array.metal", 28)], err
  assert "`r.v`" in err


def test_rule_language_refuses_what_metal_lacks():
  rc, err = _prepass(RULES_DIR / "language_constructs.metal")
  assert rc == 1, err
  found = {line: msg for line, msg in (
      (int(m.group(1)), m.group(2))
      for m in re.finditer(r"language_constructs\.metal:(\d+): error: \[language\] (.*)", err))}
  # One per planted line; `= delete` (line 9) is valid Metal.
  assert sorted(found) == [12, 18, 19, 20, 21, 22, 23], err
  assert "virtual" in found[12] and "function pointer" in found[18] and "new" in found[19]
  assert "delete" in found[20] and "throw" in found[21] and "std::" in found[23]
  rc, err = _prepass(RULES_DIR / "language_recursion.metal")
  assert rc == 1 and _findings(err, "language") == [("language_recursion.metal", 6)], err
  assert "recursion" in err and "planted_factorial" in err


def test_rules_pass_on_the_package_kernels():
  for path in PACKAGE_KERNELS:
    rc, err = _prepass(path)
    assert rc == 0, err


def test_rule_address_space_refuses_pointers_of_another_space():
  clang = _clang()
  for name, line, words in (("address_space_threadgroup_to_device.metal", 18,
                             ("device float *", "threadgroup float *")),
                            ("address_space_constant_to_device.metal", 13,
                             ("constant", "device"))):
    rc, err = _prepass(RULES_DIR / name, "--clang", clang)
    assert rc == 1, err
    assert _findings(err, "address-space") == [(name, line)], err
    assert all(w in err for w in words), err
    # Without --clang the rule is skipped and the pre-pass translates the file.
    rc, err = _prepass(RULES_DIR / name)
    assert rc == 0, err


def test_rule_address_space_passes_on_valid_kernels():
  # The package's kernels as they are, the emulator's test kernels and the
  # language-feature kernels (address-space overloads, threadgroup helper
  # parameters, vector pointer casts, simdgroup_load/store from both spaces).
  clang = _clang()
  others = [ROOT / "tests" / "metal_emulator" / f for f in
            ("emulator_test_kernels.metal", "msl_language_features.metal",
             "rules/address_space_valid.metal", "rules/unroll_member_array.metal")]
  for path in PACKAGE_KERNELS + others:
    rc, err = _prepass(path, "--clang", clang, "--skip-rule", "unroll")
    assert rc == 0, err


def test_run_time_builds_enforce_the_rules():
  with pytest.raises(msl_standalone.BuildError, match=r"\[unroll\]"):
    msl_standalone.build_library(RULES_DIR / "unroll_missing_pragma.metal")


def test_max_total_threads_per_threadgroup_is_enforced_at_dispatch():
  lib = msl_standalone.build_library(RULES_DIR / "max_threads.metal")
  out = np.zeros(1024, np.uint32)

  def run(kernel, threads):
    lib.dispatch(kernel, buffers={0: out}, constants={}, grid=(1, 1, 1),
                 threadgroup=(threads, 1, 1))

  # N = 32 * kSimdgroups, evaluated per instantiation; the separate
  # attribute spelling; no attribute: Metal's 1024.
  for kernel, limit in (("bounded_2", 64), ("bounded_4", 128), ("bounded_64", 64),
                        ("unbounded", 1024)):
    out[:] = 0
    run(kernel, limit)
    assert out[limit - 1] != 0, kernel
    with pytest.raises(msl_standalone.EmulatorError) as e:
      run(kernel, limit + 32)
    if kernel == "unbounded":
      assert "1..1024" in str(e.value)
    else:
      assert str(e.value) == (f"kernel {kernel}: {limit + 32} threads per threadgroup exceed "
                              f"the kernel's max_total_threads_per_threadgroup({limit})")
