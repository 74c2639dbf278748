"""Training steps of small Flax models through their attention_fn hook."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen, nnx

import jax_fatrain
from attention_cases import IMPLEMENTATIONS, relative_error

VOCAB, LENGTH, BATCH, FEATURES, HEADS = 37, 24, 3, 32, 4


def _reference_fn():
  return jax_fatrain.flax_attention_fn(
      attention=functools.partial(jax.nn.dot_product_attention, implementation="xla"))


class NnxLM(nnx.Module):
  def __init__(self, attention_fn, rngs):
    self.embed = nnx.Embed(VOCAB, FEATURES, rngs=rngs)
    self.attn = nnx.MultiHeadAttention(
        num_heads=HEADS, in_features=FEATURES, qkv_features=FEATURES,
        attention_fn=attention_fn, decode=False, rngs=rngs)
    self.norm = nnx.LayerNorm(FEATURES, rngs=rngs)
    self.head = nnx.Linear(FEATURES, VOCAB, rngs=rngs)

  def __call__(self, ids):
    x = self.embed(ids)
    causal = nnx.make_causal_mask(ids)
    x = x + self.attn(self.norm(x), mask=causal)
    return self.head(x)


def _flat(tree):
  """All leaves as one vector: some leaves (the key projection's bias) have an
  exactly-zero true gradient, so only a global relative error is meaningful."""
  return np.concatenate([np.ravel(leaf) for leaf in jax.tree.leaves(tree)])


def _tokens(seed):
  rng = np.random.default_rng(seed)
  return jnp.asarray(rng.integers(0, VOCAB, size=(BATCH, LENGTH + 1)), jnp.int32)


def _nnx_training(attention_fn):
  """Losses of 5 Adam steps of NnxLM and the gradients of its first step."""
  model = NnxLM(attention_fn, nnx.Rngs(0))
  optimizer = nnx.Optimizer(model, optax.adam(3e-3), wrt=nnx.Param)

  @nnx.jit
  def step(model, optimizer, tokens):
    def loss_fn(model):
      logits = model(tokens[:, :-1])
      return optax.softmax_cross_entropy_with_integer_labels(
          logits, tokens[:, 1:]).mean()
    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss, grads
  losses = []
  for i in range(5):
    loss, grads = step(model, optimizer, _tokens(i))
    losses.append(float(loss))
    if i == 0:
      first_grads = jax.tree.leaves(nnx.state(grads, nnx.Param))
  return losses, first_grads


@functools.lru_cache(maxsize=None)
def _nnx_reference():
  """The reference run, the same for every implementation."""
  return _nnx_training(_reference_fn())


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_nnx_training_steps_match_reference(implementation):
  losses, grads = _nnx_training(jax_fatrain.flax_attention_fn(implementation=implementation))
  want_losses, want_grads = _nnx_reference()
  np.testing.assert_allclose(losses, want_losses, rtol=2e-5)
  assert losses[-1] < losses[0]
  assert relative_error(_flat(grads), _flat(want_grads)) < 1e-4


class LinenLM(linen.Module):
  attention_fn: object

  @linen.compact
  def __call__(self, ids):
    x = linen.Embed(VOCAB, FEATURES)(ids)
    mask = linen.make_causal_mask(ids)
    x = x + linen.MultiHeadDotProductAttention(
        num_heads=HEADS, attention_fn=self.attention_fn)(x, x, mask=mask)
    return linen.Dense(VOCAB)(linen.LayerNorm()(x))


@functools.lru_cache(maxsize=None)
def _linen_params():
  """LinenLM's initial parameters (its attention_fn has none of its own)."""
  return jax.jit(LinenLM(_reference_fn()).init)(jax.random.key(0), _tokens(7)[:, :-1])


def _linen_loss_and_grads(attention_fn):
  """Loss and parameter gradients of LinenLM on one batch, one jitted call."""
  tokens = _tokens(7)
  model = LinenLM(attention_fn)
  params = _linen_params()

  def loss(params):
    logits = model.apply(params, tokens[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()
  return jax.jit(jax.value_and_grad(loss))(params)


@functools.lru_cache(maxsize=None)
def _linen_reference():
  return _linen_loss_and_grads(_reference_fn())


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_linen_gradients_match_reference(implementation):
  got_loss, got = _linen_loss_and_grads(
      jax_fatrain.flax_attention_fn(implementation=implementation))
  want_loss, want = _linen_reference()
  np.testing.assert_allclose(got_loss, want_loss, rtol=1e-5)
  assert relative_error(_flat(got), _flat(want)) < 1e-4


def test_dropout_is_refused_not_ignored():
  fn = jax_fatrain.flax_attention_fn(implementation="cpu")
  x = jnp.ones((1, 4, 2, 8))
  with pytest.raises(NotImplementedError, match="dropout"):
    fn(x, x, x, dropout_rate=0.1, deterministic=False, dropout_rng=jax.random.key(0))
