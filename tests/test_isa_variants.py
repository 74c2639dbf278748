"""Every instruction-set variant of the CPU kernels gives the same results.

The kernels are compiled once per ISA (baseline, avx2, avx512, the bf16
pair path: avx512_bf16 on vdpbf16ps, avx2_bf16_emulated with that instruction
emulated, and avx512_amx with the bf16 forward on AMX tiles) and chosen at run time; CI's machine would otherwise only ever
exercise the best one. Each variant is forced through JAX_FATRAIN_CPU_ISA in a
fresh process (the choice is made once per process) and checked against
jax.nn on a few cases.
"""

import os
import pathlib
import platform
import subprocess
import sys

import numpy as np
import pytest

HERE = pathlib.Path(__file__).parent

SCRIPT = r"""
import sys
import jax, jax.numpy as jnp, numpy as np
import jax_fatrain
from attention_cases import Case, make_inputs
from checks import assert_matches_reference, reference_results, results

want_isa = sys.argv[1]
assert jax_fatrain.cpu_isa() == want_isa, (jax_fatrain.cpu_isa(), want_isa)
cases = [
    Case(q_len=70, kv_len=91, q_heads=4, kv_heads=1, head_dim=64, is_causal=True,
         bias_shape=(1, "N", "T", "S"), mask_shape=(1, 1, "T", "S"), fully_masked_row=True),
    Case(q_len=33, kv_len=40, head_dim=256, dtype=jnp.bfloat16, window=(6, 2)),
    Case(q_len=29, kv_len=17, head_dim=40, dtype=jnp.float16, kv_lengths=True),
    Case(q_len=150, kv_len=150, q_heads=2, kv_heads=1, is_causal=True, segments="sorted"),
    # bf16 on the pair path where the variant has one: the fused backward
    # (4 kv slices) and the two-pass one (1 slice), odd head dim and lengths.
    Case(q_len=131, kv_len=77, batch=2, q_heads=4, kv_heads=2, head_dim=128,
         dtype=jnp.bfloat16, is_causal=True, bias_shape=("B", 1, "T", "S")),
    Case(q_len=97, kv_len=97, batch=1, q_heads=3, kv_heads=1, head_dim=17,
         dtype=jnp.bfloat16, mask_shape=(1, 1, "T", "S"), fully_masked_row=True),
]
# With an output path: only one bf16 and one f32 problem's values and
# gradients, and bf16 backwards alone (head dims 64 and 40) from a forward that
# XLA computed, saved for comparing variants; else the cases against jax.nn.
if len(sys.argv) == 2:
    for case in cases:
        x = make_inputs(case, seed=0)
        assert_matches_reference(case, x, results(case, x, "cpu"), reference_results(case, x))
else:
    saved = {}
    for name, dtype in (("bf16", jnp.bfloat16), ("f32", jnp.float32)):
        case = Case(q_len=100, kv_len=90, q_heads=4, kv_heads=2, head_dim=64, dtype=dtype)
        x = make_inputs(case, seed=1)
        for i, r in enumerate(jax.tree.leaves(results(case, x, "cpu"))):
            saved[f"{name}_{i}"] = np.asarray(r, np.float32)
    rng = np.random.default_rng(2)
    for d in (64, 40):
        q, k, v, do = (jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)
                       for shape in ((1, 4, 100, d), (1, 2, 90, d), (1, 2, 90, d), (1, 4, 100, d)))
        o, lse = jax_fatrain.flash_attn_train_fwd(q, k, v, scale=0.125, causal=True,
                                                  implementation="xla")
        grads = jax_fatrain.flash_attn_train_bwd(q, k, v, o, lse, do, scale=0.125, causal=True,
                                                 implementation="cpu")
        for i, r in enumerate(grads):
            saved[f"bwd{d}_bf16_{i}"] = np.asarray(r, np.float32)
    np.savez(sys.argv[2], **saved)
print("ok", want_isa)
"""


def _cpu_flags() -> set[str]:
  try:
    text = pathlib.Path("/proc/cpuinfo").read_text()
  except OSError:
    return set()
  for line in text.splitlines():
    if line.startswith("flags"):
      return set(line.split(":", 1)[1].split())
  return set()


def _supported(isa: str) -> bool:
  if isa == "baseline":
    return True
  if platform.machine() not in ("x86_64", "AMD64"):
    return False
  flags = _cpu_flags()
  avx2 = {"avx2", "fma", "f16c"}
  avx512 = avx2 | {"avx512f", "avx512bw", "avx512vl", "avx512dq"}
  needs = {"avx2": avx2, "avx2_bf16_emulated": avx2, "avx512": avx512,
           "avx512_bf16": avx512 | {"avx512_bf16"},
           # Linux lists the AMX flags only where it supports the tile state.
           "avx512_amx": avx512 | {"amx_tile", "amx_bf16"}}
  return needs[isa] <= flags


@pytest.fixture(scope="module")
def compilation_cache(tmp_path_factory):
  """A JAX compilation cache shared by this module's processes.

  The compiled programs do not depend on the ISA: the variant is chosen inside
  the CPU extension when a process first calls it, and the programs call the
  kernels by their FFI target's name. So every process after the first loads
  the same programs instead of compiling them again, and still runs its own
  variant (cpu_isa() is checked, and test_bf16_pair_path sees the variants'
  results differ).
  """
  return tmp_path_factory.mktemp("jax_compilation_cache")


def _run(isa: str, cache, *extra: str) -> None:
  if not _supported(isa):
    pytest.skip(f"this CPU cannot run the {isa} variant")
  env = dict(os.environ, JAX_FATRAIN_CPU_ISA=isa,
             PYTHONPATH=os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
             JAX_COMPILATION_CACHE_DIR=str(cache),
             JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
             JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
  result = subprocess.run([sys.executable, "-c", SCRIPT, isa, *extra], env=env, cwd=HERE,
                          capture_output=True, text=True, timeout=600)
  assert result.returncode == 0, result.stdout + result.stderr
  assert f"ok {isa}" in result.stdout


@pytest.mark.parametrize("isa", ["baseline", "avx2", "avx2_bf16_emulated", "avx512",
                                 "avx512_bf16", "avx512_amx"])
def test_forced_isa_matches_reference(isa, compilation_cache):
  _run(isa, compilation_cache)


@pytest.fixture(scope="module")
def saved(tmp_path_factory, compilation_cache):
  """saved(isa): the variant's saved results (see SCRIPT), computed once per module,
  so that the variants compared with avx512 share its run."""
  paths = {}

  def get(isa: str):
    if isa not in paths:
      path = tmp_path_factory.mktemp(isa) / "saved.npz"
      _run(isa, compilation_cache, str(path))
      paths[isa] = path
    return np.load(paths[isa])
  return get


# The pair path must really run: its bf16 results differ from the f32 path's
# (P and dS are rounded to bf16 before their products), its f32 ones do not.
@pytest.mark.parametrize("isa,f32_variant", [("avx2_bf16_emulated", "avx2"),
                                             ("avx512_bf16", "avx512")])
def test_bf16_pair_path(isa, f32_variant, saved):
  pairs, f32 = saved(isa), saved(f32_variant)
  for key in f32.files:
    if key.startswith("f32"):
      np.testing.assert_array_equal(pairs[key], f32[key], err_msg=key)
  assert any(not np.array_equal(pairs[k], f32[k]) for k in f32.files if k.startswith("bf16"))


# The AMX variant must really run bf16 on the tiles: its bf16 forward outputs
# and its bf16 backward at a head dim of whole AMX steps (64) differ from
# avx512's (P and dS are rounded to bf16 before their products), while its
# float32 problems and its bf16 backward at D = 40 are the avx512 kernels' own,
# bit for bit.
def test_amx_path(saved):
  amx, avx512 = saved("avx512_amx"), saved("avx512")
  for key in avx512.files:
    if key.startswith(("f32", "bwd40_")):
      np.testing.assert_array_equal(amx[key], avx512[key], err_msg=key)
  assert not np.array_equal(amx["bf16_0"], avx512["bf16_0"])
  for i in range(3):
    assert not np.array_equal(amx[f"bwd64_bf16_{i}"], avx512[f"bwd64_bf16_{i}"]), i


PERMISSION_SCRIPT = r"""
import ctypes
import jax.numpy as jnp
import jax_fatrain

def amx_permitted():
  # arch_prctl(ARCH_GET_XCOMP_PERM): the extended states this process may use;
  # bit 18 is AMX's tile data.
  bits = ctypes.c_ulong(0)
  assert ctypes.CDLL(None).syscall(158, 0x1022, ctypes.byref(bits)) == 0
  return bool(bits.value >> 18 & 1)

assert not amx_permitted()
x = jnp.ones((1, 16, 2, 64), jnp.bfloat16)
jax_fatrain.dot_product_attention(x, x, x, implementation="cpu").block_until_ready()
print(jax_fatrain.cpu_isa(), amx_permitted())
"""


# Asking for AMX changes the process (docs/cpu.md, "Limits"): the kernels ask
# only when they choose avx512_amx, never when JAX_FATRAIN_CPU_ISA names
# another variant.
@pytest.mark.parametrize("isa", [None, "avx512"])
def test_amx_permission_is_asked_only_for_avx512_amx(isa):
  if not (platform.system() == "Linux" and _supported("avx512_amx")):
    pytest.skip("the CPU has no AMX (or this is not Linux)")
  env = {k: v for k, v in os.environ.items() if k != "JAX_FATRAIN_CPU_ISA"}
  if isa:
    env["JAX_FATRAIN_CPU_ISA"] = isa
  result = subprocess.run([sys.executable, "-c", PERMISSION_SCRIPT], env=env, capture_output=True,
                          text=True, timeout=300)
  assert result.returncode == 0, result.stdout + result.stderr
  want = "avx512 False" if isa else "avx512_amx True"
  assert result.stdout.split("\n")[-2] == want, result.stdout
