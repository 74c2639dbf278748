"""Every instruction-set variant of the CPU kernels gives the same results.

The kernels are compiled once per ISA (baseline, avx2, avx512) and chosen at
run time; CI's machine would otherwise only ever exercise the best one. Each
variant is forced through JAX_FATRAIN_CPU_ISA in a fresh process (the choice
is made once per process) and checked against jax.nn on a few cases.
"""

import os
import pathlib
import platform
import subprocess
import sys

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
]
for case in cases:
    x = make_inputs(case, seed=0)
    assert_matches_reference(case, x, results(case, x, "cpu"), reference_results(case, x))
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
  needs = {"avx2": {"avx2", "fma", "f16c"},
           "avx512": {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq"}}
  return needs[isa] <= flags


@pytest.mark.parametrize("isa", ["baseline", "avx2", "avx512"])
def test_forced_isa_matches_reference(isa):
  if not _supported(isa):
    pytest.skip(f"this CPU cannot run the {isa} variant")
  env = dict(os.environ, JAX_FATRAIN_CPU_ISA=isa,
             PYTHONPATH=os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]))
  result = subprocess.run([sys.executable, "-c", SCRIPT, isa], env=env, cwd=HERE,
                          capture_output=True, text=True, timeout=600)
  assert result.returncode == 0, result.stdout + result.stderr
  assert f"ok {isa}" in result.stdout
