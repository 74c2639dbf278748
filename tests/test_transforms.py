"""vmap, checkpoint, dead-code elimination of dbias, determinism, the [B, H, L, D] pair."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_fatrain
from attention_cases import IMPLEMENTATIONS, Case, make_inputs, relative_error

B, N, T, S = "B", "N", "T", "S"


def _custom_calls(hlo_text: str, stage: str) -> int:
  return hlo_text.count(f'custom_call_target="jax_fatrain_cpu_{stage}"')


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_vmap_matches_a_loop(implementation):
  case = Case(q_len=19, kv_len=23, bias_shape=(1, N, T, S))
  xs = [make_inputs(case, seed=s) for s in range(3)]
  q = jnp.stack([x.q for x in xs])
  bias = jnp.stack([x.bias for x in xs])
  k, v = xs[0].k, xs[0].v   # not mapped: broadcast over the mapped axis
  ct = jnp.stack([x.cotangent for x in xs])
  attn = functools.partial(jax_fatrain.dot_product_attention, is_causal=True,
                           implementation=implementation)

  def loss(q, k, v, bias, ct):
    return jnp.sum(attn(q, k, v, bias) * ct)
  grad = jax.grad(loss, argnums=(0, 1, 2, 3))
  batched = jax.jit(jax.vmap(grad, in_axes=(0, None, None, 0, 0)))(q, k, v, bias, ct)
  single_grad = jax.jit(grad)
  for i in range(3):
    single = single_grad(q[i], k, v, bias[i], ct[i])
    for got, want in zip(batched, single):
      assert relative_error(got[i], want) < 1e-5


def test_vmap_is_one_kernel_call_not_a_loop():
  case = Case(q_len=16, kv_len=16)
  x = make_inputs(case, seed=0)
  q = jnp.stack([x.q] * 4)
  fn = jax.vmap(lambda q, k, v: jax_fatrain.dot_product_attention(q, k, v,
                                                                   implementation="cpu"),
                in_axes=(0, None, None))
  hlo = jax.jit(fn).lower(q, x.k, x.v).compile().as_text()
  assert _custom_calls(hlo, "forward") == 1
  assert "while" not in hlo
  out = jax.jit(fn)(q, x.k, x.v)
  assert out.shape == q.shape


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_vmap_of_bias_grad_with_unmapped_broadcast_bias(implementation):
  """Per-example dbias of a bias that is shared (unmapped, batch dim 1)."""
  case = Case(q_len=12, kv_len=14, bias_shape=(1, 1, T, S))
  xs = [make_inputs(case, seed=s) for s in range(2)]
  q = jnp.stack([x.q for x in xs])

  def dbias(q, k, v, bias):
    return jax.grad(lambda b: jnp.sum(jax_fatrain.dot_product_attention(
        q, k, v, b, implementation=implementation) ** 2))(bias)
  got = jax.jit(jax.vmap(dbias, in_axes=(0, None, None, None)))(q, xs[0].k, xs[0].v,
                                                                 xs[0].bias)
  single = jax.jit(dbias)
  for i in range(2):
    want = single(q[i], xs[0].k, xs[0].v, xs[0].bias)
    assert got[i].shape == want.shape == xs[0].bias.shape
    assert relative_error(got[i], want) < 1e-5


_CHECKPOINT_CASE = Case(q_len=21, kv_len=21, is_causal=True)


@functools.lru_cache(maxsize=None)
def _checkpoint_reference():
  """Gradients of the two layers with jax.nn, the same for every implementation."""
  x = make_inputs(_CHECKPOINT_CASE, seed=5)

  def ref_layers(q, k, v):
    h = q
    for _ in range(2):
      h = jax.nn.dot_product_attention(h, k, v, is_causal=True) + h
    return jnp.sum(h ** 2)
  return jax.jit(jax.grad(ref_layers, argnums=(0, 1, 2)))(x.q, x.k, x.v)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_checkpoint_and_scan(implementation):
  x = make_inputs(_CHECKPOINT_CASE, seed=5)
  attn = functools.partial(jax_fatrain.dot_product_attention, is_causal=True,
                           implementation=implementation)

  def layers(q, k, v):
    def body(h, _):
      return jax.checkpoint(lambda h: attn(h, k, v))(h) + h, None
    return jnp.sum(jax.lax.scan(body, q, None, length=2)[0] ** 2)
  got = jax.jit(jax.grad(layers, argnums=(0, 1, 2)))(x.q, x.k, x.v)
  want = _checkpoint_reference()
  for g, w in zip(got, want):
    assert relative_error(g, w) < 1e-4


def test_unused_bias_gradient_costs_nothing():
  case = Case(q_len=16, kv_len=16, bias_shape=(B, N, T, S))
  x = make_inputs(case, seed=2)

  def loss(q, k, v, bias):
    return jnp.sum(jax_fatrain.dot_product_attention(q, k, v, bias,
                                                     implementation="cpu") ** 2)
  only_q = jax.jit(jax.grad(loss)).lower(x.q, x.k, x.v, x.bias).compile().as_text()
  with_bias = jax.jit(jax.grad(loss, argnums=(0, 3))).lower(
      x.q, x.k, x.v, x.bias).compile().as_text()
  assert _custom_calls(only_q, "backward") == 1
  assert _custom_calls(only_q, "bias_grad") == 0
  assert _custom_calls(with_bias, "bias_grad") == 1


def test_cpu_backward_is_bitwise_deterministic():
  case = Case(batch=2, q_len=300, kv_len=280, q_heads=8, kv_heads=2, is_causal=True,
              bias_shape=(1, N, T, S))
  x = make_inputs(case, seed=11)

  def grads(q, k, v, bias):
    return jax.grad(lambda *a: jnp.sum(jax_fatrain.dot_product_attention(
        *a, implementation="cpu") * x.cotangent), argnums=(0, 1, 2, 3))(q, k, v, bias)
  fn = jax.jit(grads)
  first = fn(x.q, x.k, x.v, x.bias)
  for _ in range(3):
    again = fn(x.q, x.k, x.v, x.bias)
    for a, b in zip(first, again):
      assert np.array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("mask_kind", [None, "additive", "bool"])
def test_bhld_pair_matches_the_op(implementation, mask_kind):
  """flash_attn_train_fwd/bwd in [B, H, L, D] give what the custom_vjp gives."""
  case = Case(q_len=40, kv_len=40, q_heads=4, kv_heads=2, dtype=jnp.bfloat16,
              bias_shape=(B, N, T, S) if mask_kind == "additive" else None,
              mask_shape=(B, N, T, S) if mask_kind == "bool" else None)
  x = make_inputs(case, seed=4)
  bhld_mask = x.bias if mask_kind == "additive" else x.mask
  to_bhld = lambda a: jnp.swapaxes(a, 1, 2)
  q, k, v, do = map(to_bhld, (x.q, x.k, x.v, x.cotangent))
  scale = 1 / 8
  o, lse = jax_fatrain.flash_attn_train_fwd(q, k, v, bhld_mask, scale=scale,
                                            causal=True, implementation=implementation)
  dq, dk, dv = jax_fatrain.flash_attn_train_bwd(q, k, v, o, lse, do, bhld_mask,
                                                scale=scale, causal=True,
                                                implementation=implementation)
  assert lse.shape == (2, 4, 40) and lse.dtype == jnp.float32

  def loss(q, k, v):
    out = jax_fatrain.dot_product_attention(q, k, v, x.bias, x.mask, scale=scale,
                                            is_causal=True, implementation=implementation)
    return jnp.sum(out.astype(jnp.float32) * x.cotangent.astype(jnp.float32)), out
  (_, ref_o), ref_grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(
      x.q, x.k, x.v)
  assert relative_error(o, to_bhld(ref_o)) < 1e-6
  for got, want in zip((dq, dk, dv), ref_grads):
    assert relative_error(got, to_bhld(want)) < 1e-6


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("kv_heads", [8, 4, 1])
def test_shapes_are_known_before_any_kernel_runs(implementation, kv_heads):
  q = jax.ShapeDtypeStruct((3, 17, 8, 64), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((3, 29, kv_heads, 64), jnp.bfloat16)
  bias = jax.ShapeDtypeStruct((1, 8, 17, 29), jnp.float32)
  out, lse = jax.eval_shape(functools.partial(
      jax_fatrain.dot_product_attention, return_residual=True, is_causal=True,
      implementation=implementation), q, kv, kv, bias)
  assert (out.shape, out.dtype) == ((3, 17, 8, 64), jnp.bfloat16)
  assert (lse.shape, lse.dtype) == ((3, 17, 8), jnp.float32)

  def loss(q, k, v, b):
    return jnp.sum(jax_fatrain.dot_product_attention(
        q, k, v, b, implementation=implementation).astype(jnp.float32))
  grads = jax.eval_shape(jax.grad(loss, argnums=(0, 1, 2, 3)), q, kv, kv, bias)
  assert [(g.shape, g.dtype) for g in grads] == [
      (x.shape, x.dtype) for x in (q, kv, kv, bias)]
