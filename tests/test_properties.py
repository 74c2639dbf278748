"""Property-based tests: random problems against jax.nn, random bad calls.

Hypothesis draws problems the case table does not list (docs/testing.md):
dtypes float32/bfloat16/float16; B, T, S from 1 to a few hundred, primes
among them; GQA ratios including MQA; head dims 16-256, many of them no
multiple of 8; causal; a bias and a boolean mask of every broadcast pattern
and rank; padding lengths; windows; scales of either sign. Each is held to
``jax.nn.dot_product_attention`` in float32 at matmul precision "highest",
values and gradients (dq, dk, dv, dbias), by ``checks.assert_matches_reference``
and the one tolerance table ``attention_cases.TOLERANCE``.

A second generator builds invalid calls (more than a dozen kinds) that must
raise ValueError or TypeError naming the argument, at trace time.

CI runs a fixed number of examples per implementation, derandomized (the same
examples every run, no example database) and without a deadline (compile
times vary). ``JAX_FATRAIN_HYPOTHESIS_PROFILE=long`` runs twenty times as many
random examples, from a fresh seed each run.
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, note, settings, strategies as st

import jax_fatrain
from attention_cases import IMPLEMENTATIONS, Case, make_inputs
from checks import assert_matches_reference, reference_results, results

_HEALTH = [HealthCheck.too_slow, HealthCheck.data_too_large,
           HealthCheck.function_scoped_fixture]
settings.register_profile("ci", derandomize=True, database=None, deadline=None,
                          print_blob=True, suppress_health_check=_HEALTH)
settings.register_profile("long", derandomize=False, database=None, deadline=None,
                          print_blob=True, suppress_health_check=_HEALTH)
PROFILE = os.environ.get("JAX_FATRAIN_HYPOTHESIS_PROFILE", "ci")
if PROFILE not in ("ci", "long"):
  raise ValueError(f"JAX_FATRAIN_HYPOTHESIS_PROFILE must be ci or long, got {PROFILE!r}")
_SCALE = 20 if PROFILE == "long" else 1

# The implementations the property tests run: the shared suite's, plus the
# Metal kernels on the MSL emulator where that extension is built.
PROPERTY_IMPLEMENTATIONS = IMPLEMENTATIONS + tuple(
    i for i in ("metal_emulated",) if i in jax_fatrain.available_implementations())

# Valid problems per implementation in CI (times _SCALE); the emulator runs
# every GPU thread as a CPU fiber, so it gets fewer and smaller problems.
VALID_EXAMPLES = {"cpu": 25, "xla": 16, "cuda": 40, "metal": 30, "metal_emulated": 10}
INVALID_EXAMPLES = 6   # per kind of bad call

B, N, T, S = "B", "N", "T", "S"

# Sequence lengths: 1, primes, powers of two and their neighbours (tile
# edges), and anything else up to a few hundred.
_LENGTHS = st.one_of(
    st.sampled_from([1, 2, 3, 5, 7, 13, 31, 32, 33, 61, 63, 64, 65, 97, 127, 128, 129,
                     131, 193, 257, 263]),
    st.integers(1, 300))
# Head dims 16-256; most are no multiple of 8 or of the Metal variants.
_HEAD_DIMS = st.one_of(st.sampled_from([16, 24, 32, 40, 64, 72, 80, 96, 100, 128, 136,
                                        160, 192, 200, 256]),
                       st.integers(16, 256))


def _score_shape(draw):
  """A bias/mask shape in symbols: each of B, N, T, S full or 1, rank 2-4."""
  full = [draw(st.booleans()) for _ in range(4)]
  shape = tuple(sym if f else 1 for sym, f in zip((B, N, T, S), full))
  rank = draw(st.sampled_from([4, 4, 3, 2]))
  return shape[4 - rank:]


@st.composite
def problems(draw, implementation: str):
  """(case, seed): a random valid problem within a work budget."""
  small = implementation == "metal_emulated"
  dtype = draw(st.sampled_from([jnp.float32, jnp.bfloat16, jnp.float16]))
  lengths = st.integers(1, 80) if small else _LENGTHS
  q_len, kv_len = draw(lengths), draw(lengths)
  head_dim = draw(_HEAD_DIMS)
  kv_heads = draw(st.integers(1, 3))
  group = draw(st.sampled_from([1, 1, 2, 3, 4, 8]))   # 1: MHA; kv_heads = 1: MQA
  # Work budget (B * N * T * S * H), so that no example costs seconds.
  budget = 2e6 if small else 4e7
  per_batch = kv_heads * group * q_len * kv_len * head_dim
  if per_batch > budget:
    group, kv_heads = 1, 1
  batch = draw(st.integers(1, max(1, min(3, int(budget // (group * kv_heads * q_len
                                                            * kv_len * head_dim))))))
  window = draw(st.one_of(
      st.none(), st.none(),
      st.tuples(st.integers(0, q_len + kv_len), st.integers(0, q_len + kv_len)),
      st.integers(0, q_len + kv_len)))
  scale = draw(st.one_of(st.none(), st.none(),
                         st.floats(-2.0, 2.0).map(lambda f: f / np.sqrt(head_dim))))
  case = Case(
      batch=batch, q_len=q_len, kv_len=kv_len, q_heads=kv_heads * group,
      kv_heads=kv_heads, head_dim=head_dim, dtype=dtype, is_causal=draw(st.booleans()),
      window=window,
      bias_shape=_score_shape(draw) if draw(st.booleans()) else None,
      mask_shape=_score_shape(draw) if draw(st.booleans()) else None,
      q_lengths=draw(st.booleans()), kv_lengths=draw(st.booleans()),
      fully_masked_row=draw(st.integers(0, 5)) == 0,
      scale=scale)
  return case, draw(st.integers(0, 2**31 - 1))


# The examples are derandomized per test function, and cpu and xla draw from
# the same strategy, so in CI xla's problems are the first of cpu's: their
# inputs and jax.nn's results are computed once (the reference's compilation
# is most of an example's time on cpu).
@functools.lru_cache(maxsize=32)
def _inputs_and_reference(case, seed):
  x = make_inputs(case, seed)
  with jax.default_matmul_precision("highest"):
    return x, reference_results(case, x)


@pytest.mark.parametrize("implementation", PROPERTY_IMPLEMENTATIONS)
def test_random_problems_match_jax_nn(implementation):
  @settings(settings.get_profile(PROFILE),
            max_examples=VALID_EXAMPLES[implementation] * _SCALE)
  @given(problems(implementation))
  def check(problem):
    case, seed = problem
    note(f"case {case} seed {seed}")
    x, want = _inputs_and_reference(case, seed)
    assert_matches_reference(case, x, results(case, x, implementation), want)

  check()


# ---------------------------------------------------------------------------
# Invalid calls.
# ---------------------------------------------------------------------------
#
# Each kind draws the changes that make a valid call invalid, the exception
# types it must raise and a pattern its message must match (the argument's
# name). The call is traced with jax.eval_shape: the error must come at trace
# time, so no kernel ever runs on a bad call.

_BAD_FLOAT_DTYPES = [np.int32, np.int8, np.uint8, np.bool_, np.complex64]
_NOT_ARRAYS = ["abc", None, object(), {"a": 1}, [[1.0, 2.0], [3.0]]]


@st.composite
def _base_call(draw):
  """A small valid call: (kwargs, (B, T, N, S, K, H, dtype))."""
  b, t, s = draw(st.integers(1, 3)), draw(st.integers(1, 12)), draw(st.integers(1, 12))
  kh, g, h = draw(st.integers(1, 3)), draw(st.integers(1, 3)), draw(st.sampled_from([16, 40, 64]))
  n = kh * g
  dtype = draw(st.sampled_from([np.float32, jnp.bfloat16, np.float16]))
  q = np.zeros((b, t, n, h), dtype)
  kv = np.zeros((b, s, kh, h), dtype)
  return dict(query=q, key=kv, value=kv), (b, t, n, s, kh, h, dtype)


def _other(draw, size):
  """A size other than `size` and 1."""
  return draw(st.integers(2, 9).filter(lambda x: x != size))


def _bad_query_rank(draw, dims):
  rank = draw(st.sampled_from([0, 1, 2, 5]))
  return dict(query=np.zeros((2,) * rank, np.float32)), ValueError, r"query must have rank 4"


def _bad_key_rank(draw, dims):
  rank = draw(st.sampled_from([1, 2, 3, 5]))
  kv = np.zeros((2,) * rank, np.float32)
  return dict(key=kv, value=kv), ValueError, r"key must have rank 4"


def _unbatched_mismatch(draw, dims):
  b, t, n, s, kh, h, dt = dims
  k_rank = draw(st.sampled_from([2, 4]))
  kv = np.zeros((2,) * k_rank, np.float32)
  return (dict(query=np.zeros((t, n, h), np.float32), key=kv, value=kv), ValueError,
          r"unbatched query .* needs unbatched key and value")


def _value_shape(draw, dims):
  b, t, n, s, kh, h, dt = dims
  shape = [b, s, kh, h]
  axis = draw(st.integers(0, 3))
  shape[axis] += draw(st.integers(1, 3))
  return dict(value=np.zeros(shape, dt)), ValueError, r"value shape must equal key's"


def _batch_mismatch(draw, dims):
  b, t, n, s, kh, h, dt = dims
  kv = np.zeros((_other(draw, b), s, kh, h), dt)
  return dict(key=kv, value=kv), ValueError, r"key batch size must equal query's"


def _head_dim_mismatch(draw, dims):
  b, t, n, s, kh, h, dt = dims
  kv = np.zeros((b, s, kh, h + draw(st.sampled_from([-8, 1, 8]))), dt)
  return dict(key=kv, value=kv), ValueError, r"key head_dim must equal query's"


def _heads_not_divisible(draw, dims):
  b, t, n, s, kh, h, dt = dims
  q = np.zeros((b, t, 6, h), np.float32)
  kv = np.zeros((b, s, draw(st.sampled_from([4, 5, 7])), h), np.float32)
  return (dict(query=q, key=kv, value=kv), ValueError,
          r"query heads \(6\) must be a multiple of the number of key/value heads")


def _query_dtype(draw, dims):
  b, t, n, s, kh, h, dt = dims
  dtype = draw(st.sampled_from(_BAD_FLOAT_DTYPES))
  return (dict(query=np.zeros((b, t, n, h), dtype), key=np.zeros((b, s, kh, h), dtype),
               value=np.zeros((b, s, kh, h), dtype)), TypeError, r"query dtype must be one of")


def _kv_dtype(draw, dims):
  b, t, n, s, kh, h, dt = dims
  name = draw(st.sampled_from(["key", "value"]))
  q = np.zeros((b, t, n, h), np.float32)
  kv = np.zeros((b, s, kh, h), np.float32)
  bad = np.zeros((b, s, kh, h), draw(st.sampled_from([np.float16, np.int32])))
  args = dict(query=q, key=kv, value=kv)
  args[name] = bad
  return args, TypeError, rf"{name} dtype must equal query's"


def _score_dims(draw, dims):
  b, t, n, s, kh, h, dt = dims
  return [draw(st.sampled_from([1, full])) for full in (b, n, t, s)]


def _bias_dtype(draw, dims):
  shape = _score_dims(draw, dims)
  dtype = draw(st.sampled_from(_BAD_FLOAT_DTYPES))
  return dict(bias=np.zeros(shape, dtype)), TypeError, r"bias dtype must be one of"


def _bad_broadcast(draw, dims, name):
  b, t, n, s, kh, h, dt = dims
  shape = _score_dims(draw, dims)
  axis = draw(st.integers(0, 3))
  shape[axis] = (b, n, t, s)[axis] + draw(st.integers(1, 3))
  dtype = np.bool_ if name == "mask" else np.float32
  return ({name: np.zeros(shape, dtype)}, ValueError,
          rf"{name} of shape .* does not broadcast to \[B, N, T, S\]")


def _bias_shape(draw, dims):
  return _bad_broadcast(draw, dims, "bias")


def _mask_shape(draw, dims):
  return _bad_broadcast(draw, dims, "mask")


def _score_rank(draw, dims):
  name = draw(st.sampled_from(["bias", "mask"]))
  rank = draw(st.integers(5, 6))
  dtype = np.bool_ if name == "mask" else np.float32
  return {name: np.zeros((1,) * rank, dtype)}, ValueError, rf"{name} must have rank <= 4"


def _mask_dtype(draw, dims):
  shape = _score_dims(draw, dims)
  dtype = draw(st.sampled_from([np.float32, np.int32, np.uint8]))
  return dict(mask=np.zeros(shape, dtype)), TypeError, r"mask must be a boolean array"


_LENGTH_NAMES = ["query_seq_lengths", "key_value_seq_lengths"]


def _lengths_dtype(draw, dims):
  b = dims[0]
  name = draw(st.sampled_from(_LENGTH_NAMES))
  dtype = draw(st.sampled_from([np.float32, np.int16, np.uint32, np.bool_, np.float16]))
  return {name: np.ones((b,), dtype)}, TypeError, rf"{name} must be int32"


def _lengths_shape(draw, dims):
  b = dims[0]
  name = draw(st.sampled_from(_LENGTH_NAMES))
  shape = draw(st.sampled_from([(), (b + 1,), (b, 1), (1, b), (b, 2)]))
  return {name: np.ones(shape, np.int32)}, ValueError, rf"{name} must have shape \({b},\)"


def _bad_window(draw, dims):
  window = draw(st.sampled_from([
      (1, 2, 3), (1,), (), (1.5, 2), 1.5, "3", True, (True, 1), (1, None), {1: 2},
      np.array([1, 2]), np.float32(2.0)]))
  return dict(local_window_size=window), TypeError, r"local_window_size must be None, an int"


def _negative_window(draw, dims):
  left = draw(st.integers(-5, 5))
  right = draw(st.integers(-5, 5).filter(lambda r: left < 0 or r < 0))
  window = draw(st.sampled_from([(left, right), min(left, right)]))
  return dict(local_window_size=window), ValueError, r"local_window_size must be non-negative"


def _zero_size(draw, dims):
  b, t, n, s, kh, h, dt = dims
  which = draw(st.sampled_from(["batch size", "query length", "query heads", "key length",
                                "key/value heads", "head_dim"]))
  b, t, n, s, kh, h = {"batch size": (0, t, n, s, kh, h), "query length": (b, 0, n, s, kh, h),
                       "query heads": (b, t, 0, s, kh, h), "key length": (b, t, n, 0, kh, h),
                       "key/value heads": (b, t, n, s, 0, h),
                       "head_dim": (b, t, n, s, kh, 0)}[which]
  return (dict(query=np.zeros((b, t, n, h), np.float32),
               key=np.zeros((b, s, kh, h), np.float32),
               value=np.zeros((b, s, kh, h), np.float32)),
          ValueError, rf"{which} must be > 0")


def _scale_type(draw, dims):
  scale = draw(st.sampled_from(["abc", "", [0.5], np.array([0.5, 1.0]), 1j, object(), {}]))
  return dict(scale=scale), TypeError, r"scale must be a Python or NumPy number"


def _scale_value(draw, dims):
  scale = draw(st.sampled_from([float("nan"), float("inf"), -float("inf"), 1e39, -3.5e38,
                                np.float64(1e300)]))
  return dict(scale=scale), ValueError, r"scale must be finite"


def _not_an_array(draw, dims):
  name = draw(st.sampled_from(["query", "key", "value", "bias", "mask"] + _LENGTH_NAMES))
  value = draw(st.sampled_from(_NOT_ARRAYS[1:] if name in ("query", "key", "value")
                               else [v for v in _NOT_ARRAYS if v is not None]))
  if name in ("key", "value") and value is None:
    value = "abc"
  return {name: value}, TypeError, rf"{name} must be an array"


def _flag_value(draw, dims):
  name = draw(st.sampled_from(["is_causal", "return_residual"]))
  return {name: np.array([True, False])}, TypeError, rf"{name} must be a bool"


def _implementation_name(draw, dims):
  name, error, pattern = draw(st.sampled_from([
      ("tpu-magic", ValueError, r"unknown implementation 'tpu-magic'"),
      ("", ValueError, r"unknown implementation ''"),
      (3, TypeError, r"implementation must be a string or None"),
      (["cpu"], TypeError, r"implementation must be a string or None")]))
  return dict(implementation=name), error, pattern


def _head_dim_too_large(draw, dims, implementation):
  b, t, n, s, kh, h, dt = dims
  limit = jax_fatrain._registry.resolve_implementation(implementation).max_head_dim
  d = limit + draw(st.integers(1, 64))
  return (dict(query=np.zeros((b, t, n, d), np.float32),
               key=np.zeros((b, s, kh, d), np.float32),
               value=np.zeros((b, s, kh, d), np.float32)),
          ValueError, rf"head_dim must be <= {limit} for implementation")


INVALID_KINDS = {
    f.__name__.lstrip("_"): f for f in (
        _bad_query_rank, _bad_key_rank, _unbatched_mismatch, _value_shape, _batch_mismatch,
        _head_dim_mismatch, _heads_not_divisible, _query_dtype, _kv_dtype, _bias_dtype,
        _bias_shape, _mask_shape, _score_rank, _mask_dtype, _lengths_dtype, _lengths_shape,
        _bad_window, _negative_window, _zero_size, _scale_type, _scale_value,
        _not_an_array, _flag_value, _implementation_name)}


def _kinds(implementation: str) -> list[str]:
  kinds = sorted(INVALID_KINDS)
  if jax_fatrain._registry.resolve_implementation(implementation).max_head_dim is not None:
    kinds.append("head_dim_too_large")
  return kinds


@st.composite
def invalid_calls(draw, implementation: str, kind: str):
  """(kwargs, exception type, message pattern) of one kind of bad call."""
  kwargs, dims = draw(_base_call())
  if kind == "head_dim_too_large":
    changes, error, pattern = _head_dim_too_large(draw, dims, implementation)
  else:
    changes, error, pattern = INVALID_KINDS[kind](draw, dims)
  kwargs.update(changes)
  kwargs.setdefault("implementation", implementation)
  return kwargs, error, pattern


def test_there_are_a_dozen_kinds_of_invalid_call():
  assert len(INVALID_KINDS) >= 12


@pytest.mark.parametrize("implementation, kind", [
    (i, k) for i in PROPERTY_IMPLEMENTATIONS for k in _kinds(i)])
def test_invalid_calls_raise_naming_the_argument(implementation, kind):
  @settings(settings.get_profile(PROFILE), max_examples=INVALID_EXAMPLES * _SCALE)
  @given(invalid_calls(implementation, kind))
  def check(call):
    kwargs, error, pattern = call
    note(f"{kind}: {kwargs!r}")
    with pytest.raises(error, match=pattern):
      jax.eval_shape(lambda: jax_fatrain.dot_product_attention(**kwargs))

  check()
