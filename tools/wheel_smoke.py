"""Smoke test of an installed jax_fatrain (a wheel), run outside the source tree.

Checks that the package imports from site-packages (not from a checkout), that
the wheel carries its compiled extensions (the CPU handlers and the MSL
emulator's everywhere, the Metal host on macOS), that every available
implementation runs a small causal GQA forward and gradient equal to
jax.nn.dot_product_attention's (float32), and that a bad argument raises the
documented ValueError. Used by tools/check_wheel.sh and by cibuildwheel's test
step (.github/workflows/wheels.yml). Exit status 0 on success.

  python tools/wheel_smoke.py     (from any directory but the repository root)
"""

from __future__ import annotations

import importlib.metadata
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np

import jax_fatrain

PACKAGE = pathlib.Path(jax_fatrain.__file__).resolve().parent


def check_installed():
  here = pathlib.Path.cwd().resolve()
  if (PACKAGE.parent / "pyproject.toml").is_file() or PACKAGE.parent == here:
    sys.exit(f"jax_fatrain was imported from a source tree ({PACKAGE}), not from the "
             "installed wheel: run this from another directory")
  expected = ["_cpu_ffi", "_metal_emulated_ffi"] + (["_metal_ffi"] if sys.platform == "darwin"
                                                    else [])
  missing = [name for name in expected if not any(PACKAGE.rglob(f"{name}.*"))]
  if missing:
    sys.exit(f"the installed package lacks its compiled extensions {missing} ({PACKAGE})")
  if not any(PACKAGE.rglob("*.metal")):
    sys.exit(f"the installed package lacks the Metal kernel sources ({PACKAGE})")


def relative_error(a, b) -> float:
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def check_implementation(impl: str) -> float:
  rng = np.random.default_rng(0)
  shape_q, shape_kv = (2, 40, 4, 32), (2, 40, 2, 32)   # [B, T, N, H], GQA 4:2
  q = jnp.asarray(rng.standard_normal(shape_q), jnp.float32)
  k = jnp.asarray(rng.standard_normal(shape_kv), jnp.float32)
  v = jnp.asarray(rng.standard_normal(shape_kv), jnp.float32)
  ct = jnp.asarray(rng.standard_normal(shape_q), jnp.float32)

  def loss(attention):
    return lambda q, k, v: jnp.sum(attention(q, k, v, is_causal=True) * ct)

  ours_fn = lambda q, k, v, **kw: jax_fatrain.dot_product_attention(
      q, k, v, implementation=impl, **kw)
  ref_fn = lambda q, k, v, **kw: jax.nn.dot_product_attention(
      q, k, v, implementation="xla", **kw)
  out = jax.jit(lambda q, k, v: ours_fn(q, k, v, is_causal=True))(q, k, v)
  ref = ref_fn(q, k, v, is_causal=True)
  grads = jax.jit(jax.grad(loss(ours_fn), argnums=(0, 1, 2)))(q, k, v)
  ref_grads = jax.grad(loss(ref_fn), argnums=(0, 1, 2))(q, k, v)
  errors = [relative_error(out, ref)] + [relative_error(g, r) for g, r in zip(grads, ref_grads)]
  worst = max(errors)
  if not worst < 1e-4:
    sys.exit(f"{impl}: forward/gradient differ from jax.nn: relative errors "
             f"(out, dq, dk, dv) = {errors}")
  return worst


def check_error_message():
  q = jnp.ones((1, 8, 2, 16), jnp.float32)
  try:
    jax_fatrain.dot_product_attention(q, q, q, bias=jnp.zeros((1, 2, 8, 9)))
  except ValueError as e:
    if "bias" not in str(e):
      sys.exit(f"the bias error does not name the argument: {e}")
    return
  sys.exit("a bias of the wrong shape was accepted")


def main():
  check_installed()
  impls = jax_fatrain.available_implementations()
  print(f"jax_fatrain {jax_fatrain.__version__} from {PACKAGE}")
  print(f"jax {jax.__version__}, jaxlib {importlib.metadata.version('jaxlib')}, backend {jax.default_backend()}, "
        f"python {sys.version.split()[0]}, {sys.platform}")
  print(f"available implementations: {impls}")
  if "cpu" not in impls or "xla" not in impls:
    sys.exit("implementations 'cpu' and 'xla' must be available")
  for impl in impls:
    print(f"  {impl}: forward + gradient vs jax.nn, worst relative error "
          f"{check_implementation(impl):.1e}")
  check_error_message()
  print("wheel smoke test: OK")


if __name__ == "__main__":
  main()
