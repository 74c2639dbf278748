"""``jax_fatrain.explain_implementation``: which implementation runs, and why.

Its name must be the one ``dot_product_attention`` resolves; the branches of the
automatic choice for machines this test does not run on (an NVIDIA GPU, a build
without the CPU extension) are reached by swapping in the backend and registry.
"""

import dataclasses

import jax
import jax.numpy as jnp
import pytest

import jax_fatrain
from jax_fatrain import _registry
from jax_fatrain._backends import cuda as _cuda


def test_default_is_what_dot_product_attention_resolves():
  for dtype, head_dim in ((None, None), (jnp.float32, 64), (jnp.bfloat16, 128)):
    name, reason = jax_fatrain.explain_implementation(None, dtype, head_dim)
    assert name == _registry.resolve_implementation(None, dtype, head_dim).name
    assert name in jax_fatrain.available_implementations()
    assert reason.startswith("jax's default backend is ") and reason != "requested explicitly"


@pytest.mark.skipif(jax.default_backend() != "cpu"
                    or "cpu" not in jax_fatrain.available_implementations()
                    or "metal" in jax_fatrain.available_implementations(),
                    reason="needs the CPU kernels as the automatic choice")
def test_default_on_cpu_names_the_cpu_extension():
  assert jax_fatrain.explain_implementation() == (
      "cpu", "jax's default backend is cpu and the CPU extension is built")


@pytest.mark.parametrize("name", jax_fatrain.available_implementations())
def test_explicit_names(name):
  assert jax_fatrain.explain_implementation(name) == (name, "requested explicitly")
  assert jax_fatrain.explain_implementation(name, jnp.bfloat16, 64)[0] == name


def test_unknown_and_unavailable_names_raise():
  with pytest.raises(ValueError, match="unknown implementation 'bogus'.*Available here"):
    jax_fatrain.explain_implementation("bogus")
  if "cuda" not in jax_fatrain.available_implementations():
    with pytest.raises(ValueError, match="'cuda' is not available"):
      jax_fatrain.explain_implementation("cuda")


def test_fallback_without_cpu_extension(monkeypatch):
  monkeypatch.setattr(jax, "default_backend", lambda: "cpu")
  for name in ("cpu", "metal"):
    if name in _registry._table()[0]:
      monkeypatch.delitem(_registry._table()[0], name)
  monkeypatch.setitem(_registry._table()[1], "cpu", "no such module")
  name, reason = jax_fatrain.explain_implementation()
  assert name == "xla" == _registry.resolve_implementation(None).name
  assert "no extension of ours runs there" in reason
  assert "no such module" in reason


def test_nvidia_gpu_choice(monkeypatch):
  """cuda for the tensor-core problems, xla for the rest, and each says so."""
  xla = _registry._table()[0]["xla"]
  fake_cuda = dataclasses.replace(xla, name="cuda", platforms=("cuda",))
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  monkeypatch.setitem(_registry._table()[0], "cuda", fake_cuda)
  monkeypatch.setattr(_cuda, "gpu_present", lambda: True)
  monkeypatch.setattr(_cuda, "has_tensor_core_kernels",
                      lambda dtype, head_dim: jnp.dtype(dtype) != jnp.float32)

  name, reason = jax_fatrain.explain_implementation(None, jnp.bfloat16, 128)
  assert name == "cuda" == _registry.resolve_implementation(None, jnp.bfloat16, 128).name
  assert "NVIDIA GPU" in reason and "bfloat16 head dim 128" in reason

  name, reason = jax_fatrain.explain_implementation(None, jnp.float32, 128)
  assert name == "xla" == _registry.resolve_implementation(None, jnp.float32, 128).name
  assert "no tensor-core kernels for float32 head dim 128" in reason

  assert jax_fatrain.explain_implementation()[0] == "cuda"  # no dtype given

  monkeypatch.setattr(_cuda, "gpu_present", lambda: False)  # e.g. a ROCm GPU
  name, reason = jax_fatrain.explain_implementation(None, jnp.bfloat16, 128)
  assert name == "xla" and "backend is gpu" in reason
