"""Bad input: a clear Python error at trace time, naming the argument."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_fatrain

Q = jnp.ones((2, 8, 4, 16), jnp.float32)
KV = jnp.ones((2, 10, 2, 16), jnp.float32)


def call(**changes):
  args = dict(query=Q, key=KV, value=KV, implementation="cpu")
  args.update(changes)
  return jax_fatrain.dot_product_attention(**args)


@pytest.mark.parametrize("changes, error, message", [
    (dict(query=Q[0, 0]), ValueError, r"query must have rank 4"),
    (dict(key=KV[..., :8], value=KV[..., :8]), ValueError, r"key head_dim must equal query's \(16\), got 8"),
    (dict(key=KV[:1], value=KV[:1]), ValueError, r"key batch size must equal query's \(2\), got 1"),
    (dict(value=KV[:, :5]), ValueError, r"value shape must equal key's"),
    (dict(key=jnp.ones((2, 10, 3, 16))), ValueError, r"value shape must equal key's"),
    (dict(key=jnp.ones((2, 10, 3, 16)), value=jnp.ones((2, 10, 3, 16))), ValueError,
     r"query heads \(4\) must be a multiple of the number of key/value heads \(3\)"),
    (dict(query=Q.astype(jnp.bfloat16)), TypeError, r"key dtype must equal query's \(bfloat16\), got float32"),
    (dict(query=Q.astype(jnp.int32)), TypeError, r"query dtype must be one of"),
    (dict(query=jnp.ones((2, 8, 4, 300)), key=jnp.ones((2, 10, 2, 300)),
          value=jnp.ones((2, 10, 2, 300))), ValueError, r"head_dim must be <= 256 for implementation 'cpu', got 300"),
    (dict(query=jnp.ones((2, 0, 4, 16))), ValueError, r"query length must be > 0"),
    (dict(bias=jnp.ones((2, 4, 8, 9))), ValueError, r"bias of shape \(2, 4, 8, 9\) does not broadcast to \[B, N, T, S\] = \[2, 4, 8, 10\]: dimension 3 \(S\) is 9, expected 1 or 10"),
    (dict(bias=jnp.ones((3, 1, 1, 10))), ValueError, r"dimension 0 \(B\) is 3"),
    (dict(bias=jnp.ones((1, 2, 4, 8, 10))), ValueError, r"bias must have rank <= 4"),
    (dict(bias=jnp.ones((1, 1, 8, 10), jnp.int32)), TypeError, r"bias dtype must be one of"),
    (dict(mask=jnp.ones((1, 1, 8, 10), jnp.float32)), TypeError, r"mask must be a boolean array"),
    (dict(mask=jnp.ones((1, 3, 8, 10), bool)), ValueError, r"mask of shape \(1, 3, 8, 10\) does not broadcast"),
    (dict(query_seq_lengths=jnp.ones((2,), jnp.int64 if jax.config.x64_enabled else jnp.float32)), TypeError, r"query_seq_lengths must be int32"),
    (dict(key_value_seq_lengths=jnp.ones((3,), jnp.int32)), ValueError, r"key_value_seq_lengths must have shape \(2,\)"),
    (dict(local_window_size=(1, 2, 3)), TypeError, r"local_window_size must be None, an int or a \(left, right\) pair"),
    (dict(local_window_size=-1), ValueError, r"local_window_size must be non-negative"),
    (dict(scale=float("nan")), ValueError, r"scale must be finite"),
    (dict(is_causal="no"), TypeError, r"is_causal must be a bool known at trace time \(True or False\), got str 'no'"),
    (dict(deterministic="yes"), TypeError, r"deterministic must be a bool known at trace time \(True or False\), got str 'yes'"),
    (dict(is_causal=2), TypeError, r"is_causal must be a bool .* got int 2"),
    (dict(is_causal=None), TypeError, r"is_causal must be a bool .* got NoneType"),
    (dict(implementation="tpu-magic"), ValueError, r"unknown implementation 'tpu-magic'.*Available here: cpu, (cuda, )?(metal_emulated, )?xla"),
    pytest.param(dict(implementation="metal"), ValueError,
                 r"implementation 'metal' is not available: .*Available here: cpu, (cuda, )?(metal_emulated, )?xla",
                 marks=pytest.mark.skipif("metal" in jax_fatrain.available_implementations(),
                                          reason="the Metal backend is available here")),
    pytest.param(dict(implementation="cuda"), ValueError, r"implementation 'cuda' is not available",
                 marks=pytest.mark.skipif("cuda" in jax_fatrain.available_implementations(),
                                          reason="the CUDA backend is available here")),
])
def test_bad_arguments_raise_at_trace_time(changes, error, message):
  with pytest.raises(error, match=message):
    call(**changes)
  # Under jit the same error comes from tracing, before anything runs.
  with pytest.raises(error, match=message):
    jax.jit(lambda: call(**changes)).lower()


def test_traced_scale_is_rejected():
  with pytest.raises(TypeError, match="scale must be a Python or NumPy number"):
    jax.jit(lambda s: call(scale=s))(0.5)


@pytest.mark.parametrize("changes, message", [
    (dict(lse=jnp.zeros((2, 4, 8), jnp.bfloat16)), r"lse must be float32 \[2, 4, 8\]"),
    (dict(lse=jnp.zeros((2, 8, 4), jnp.float32)), r"lse must be float32 \[2, 4, 8\]"),
    (dict(o=jnp.zeros((2, 4, 8, 8))), r"o must have q's shape"),
    (dict(do=jnp.zeros((2, 4, 8, 16), jnp.bfloat16)), r"do must have q's shape"),
])
def test_bhld_backward_checks_its_residuals(changes, message):
  q = jnp.ones((2, 4, 8, 16))
  kv = jnp.ones((2, 2, 8, 16))
  args = dict(q=q, k=kv, v=kv, o=q, lse=jnp.zeros((2, 4, 8)), do=q)
  args.update(changes)
  with pytest.raises(ValueError, match=message):
    jax_fatrain.flash_attn_train_bwd(**args, scale=0.25, causal=False)


def test_available_implementations():
  assert set(jax_fatrain.available_implementations()) >= {"cpu", "xla"}
  assert jax_fatrain.cpu_isa() in ("avx512_amx", "avx512_bf16", "avx512", "avx2", "baseline",
                                   "avx2_bf16_emulated")


def test_deterministic_keyword_reaches_the_backward(monkeypatch):
  """``deterministic`` enters the config the public call builds, and so every
  cache key below the op: the same shapes traced in both modes run a
  backward traced with each mode (a probe wrapping the CPU backward records
  the config it is traced with)."""
  from jax_fatrain import _op, _registry
  cpu = _registry.resolve_implementation("cpu")
  seen = []

  def backward(*operands, config, **keywords):
    seen.append(config.deterministic)
    return cpu.backward(*operands, config=config, **keywords)

  probe = dataclasses.replace(cpu, name="cpu_probe", backward=backward)
  real = _op.attention
  monkeypatch.setattr(_op, "attention", lambda *args: real(*args[:8], probe, *args[9:]))
  q = jnp.ones((1, 8, 2, 16), jnp.float32)
  kv = jnp.ones((1, 8, 1, 16), jnp.float32)
  for mode in (False, True):
    loss = lambda q, k, v, mode=mode: jnp.sum(jax_fatrain.dot_product_attention(
        q, k, v, implementation="cpu", deterministic=mode) ** 2)
    seen.clear()
    jax.block_until_ready(jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, kv, kv))
    assert seen == [mode], (mode, seen)


def test_none_picks_the_best_implementation_for_the_default_backend():
  from jax_fatrain import _registry
  from jax_fatrain._backends import cuda as _cuda
  available = jax_fatrain.available_implementations()
  for dtype, head_dim in ((jnp.bfloat16, 128), (jnp.float16, 64), (jnp.float32, 128),
                          (jnp.bfloat16, 96)):
    chosen = _registry.resolve_implementation(None, dtype, head_dim).name
    if jax.default_backend() == "gpu" and "cuda" in available and _cuda.gpu_present():
      tensor_cores = jnp.dtype(dtype) != jnp.float32 and head_dim in (64, 128, 256)
      assert chosen == ("cuda" if tensor_cores else "xla"), (dtype, head_dim)
    elif jax.default_backend() == "cpu":
      assert chosen == ("metal" if "metal" in available else "cpu")
    else:
      assert chosen == "xla"


def test_ffi_handler_rechecks_its_inputs():
  """Bypassing the Python checks gives an FFI error, not a crash."""
  from jax_fatrain._backends import cpu as _cpu
  from jax_fatrain._config import AttentionConfig
  config = AttentionConfig(scale=0.25)
  bad_kv = jnp.ones((2, 10, 3, 16), jnp.float32)  # 4 query heads, 3 kv heads
  with pytest.raises(Exception, match="kv_heads|key/value heads|divis"):
    jax.block_until_ready(_cpu.forward(Q, bad_kv, bad_kv, None, None, None, None, config))
  bad_bias = jnp.ones((2, 4, 8, 9), jnp.float32)
  with pytest.raises(Exception, match="bias shape"):
    jax.block_until_ready(_cpu.forward(Q, KV, KV, bad_bias, None, None, None, config))
  # The process is still healthy afterwards.
  out, lse = _cpu.forward(Q, KV, KV, None, None, None, None, config)
  assert np.all(np.isfinite(np.asarray(out)))
