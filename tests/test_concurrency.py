"""Attention calls running at the same time must not corrupt each other.

The CPU and Metal handlers keep process-wide state (the CPU kernels' scratch
cache, the emulator's per-thread fiber stacks and function constants), and
XLA runs independent operations of one jitted function concurrently while
Python threads may call jitted functions at once. Two different problems
(different shapes, dtypes, masks, so different scratch sizes and kernel
variants) run concurrently, in one jit and from two threads, and each result
must equal the same call run alone, bitwise (both backends are
deterministic).
"""

import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_fatrain
from attention_cases import Case, make_inputs

IMPLS = ("cpu",) + tuple(
    i for i in ("metal_emulated",) if i in jax_fatrain.available_implementations())

# Sizes per implementation: the emulator is slow, the CPU kernels need work
# long enough to overlap.
PROBLEMS = {
    "cpu": (Case(batch=2, q_len=300, kv_len=270, q_heads=8, kv_heads=2, head_dim=64,
                 is_causal=True, bias_shape=(1, "N", "T", "S")),
            Case(batch=1, q_len=513, kv_len=700, q_heads=4, kv_heads=4, head_dim=128,
                 dtype=jnp.bfloat16, mask_shape=("B", 1, "T", "S"), window=(100, 20))),
    "metal_emulated": (
        Case(batch=1, q_len=40, kv_len=33, q_heads=4, kv_heads=2, head_dim=64,
             is_causal=True, bias_shape=(1, "N", "T", "S")),
        Case(batch=1, q_len=29, kv_len=45, q_heads=2, kv_heads=1, head_dim=128,
             dtype=jnp.bfloat16, mask_shape=("B", 1, "T", "S"), window=(10, 3))),
}


def _step(case, implementation):
  """A jitted (out, grads) for one case; takes its inputs as arguments."""
  def loss(q, k, v, bias, mask, ct):
    out = jax_fatrain.dot_product_attention(
        q, k, v, bias, mask, is_causal=case.is_causal, local_window_size=case.window,
        implementation=implementation)
    return jnp.sum(out.astype(jnp.float32) * ct.astype(jnp.float32)), out
  return jax.grad(loss, argnums=(0, 1, 2), has_aux=True)


def _args(x):
  return (x.q, x.k, x.v, x.bias, x.mask, x.cotangent)


def _as_numpy(result):
  return [np.asarray(a) for a in jax.tree_util.tree_leaves(result)]


def _assert_bitwise(got, want):
  assert len(got) == len(want)
  for a, b in zip(got, want):
    assert a.dtype == b.dtype and a.shape == b.shape
    assert a.tobytes() == b.tobytes()


# XLA:CPU executes a program of few operations sequentially. Five calls of
# each problem (20 FFI calls) are enough for it to run independent calls at
# once: with a scratch buffer shared between calls planted in the CPU kernels,
# this test fails at 10 calls, not at 8 (jaxlib 0.10.2).
COPIES = 5


@pytest.mark.parametrize("implementation", IMPLS)
def test_calls_in_one_jit(implementation):
  cases = PROBLEMS[implementation]
  xs = [make_inputs(cases[i % 2], seed=i) for i in range(2 * COPIES)]
  steps = [_step(c, implementation) for c in cases]
  alone = [_as_numpy(jax.jit(steps[i % 2])(*_args(x))) for i, x in enumerate(xs)]

  many = jax.jit(lambda *args: [steps[i % 2](*a) for i, a in enumerate(args)])
  args = [_args(x) for x in xs]
  hlo = many.lower(*args).compile().as_text()
  assert hlo.count("custom-call(") >= 4 * COPIES   # a forward and a backward each
  for _ in range(3):
    for got, want in zip(many(*args), alone):
      _assert_bitwise(_as_numpy(got), want)


@pytest.mark.parametrize("implementation", IMPLS)
def test_two_python_threads(implementation):
  cases = PROBLEMS[implementation]
  xs = [make_inputs(c, seed=10 + i) for i, c in enumerate(cases)]
  steps = [jax.jit(_step(c, implementation)) for c in cases]
  alone = [_as_numpy(s(*_args(x))) for s, x in zip(steps, xs)]   # also compiles

  rounds = 4 if implementation == "cpu" else 2
  start = threading.Barrier(2)
  results = [[], []]
  errors = []

  def worker(i):
    try:
      start.wait()
      for _ in range(rounds):
        results[i].append(_as_numpy(steps[i](*_args(xs[i]))))
    except Exception as e:  # reported below, in the main thread
      errors.append(e)

  threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  assert not errors, errors
  for i in range(2):
    assert len(results[i]) == rounds
    for got in results[i]:
      _assert_bitwise(got, alone[i])
