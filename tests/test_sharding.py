"""Sharded execution on 8 host devices (a 2x4 mesh), in a child process.

The pytest process has already initialised JAX with one CPU device, so the
checks run in a subprocess started with
``XLA_FLAGS=--xla_force_host_platform_device_count=8``: ``python
tests/test_sharding.py`` runs them all and prints one JSON line per check;
the tests below run that child once and assert on its lines.

Checked: sharded results and gradients equal unsharded ones (batch, heads,
GQA groups, split GQA groups, MQA, batch x heads, sequence ring, sequence x
batch / heads; causal on and off; every sharding on cpu, each way of
partitioning on xla: see CAUSAL); bias/mask/lengths with batch x head
sharding, bias gradient included; segment ids under batch x heads sharding
and through ring attention; the collectives in the compiled HLO per
sharding; a clear error for what ring attention does not support; a Flax
NNX training step over a 2x4 (data x model) mesh.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))

# name: (batch, q_len, kv_len, q_heads, kv_heads, q spec, kv spec). Specs are
# over the mesh ("x": 2, "y": 4); the layout is BTNH.
XY = ("x", "y")
SHARDINGS = {
    "batch": (8, 32, 32, 4, 2, (XY,), (XY,)),
    "heads": (2, 32, 32, 8, 8, (None, None, XY), (None, None, XY)),
    "gqa_groups": (2, 32, 32, 8, 4, (None, None, "y"), (None, None, "y")),
    "gqa_split_groups": (2, 32, 32, 8, 2, (None, None, "y"), (None, None, None)),
    "mqa": (2, 32, 32, 8, 1, (None, None, "y"), ()),
    "batch_x_heads": (2, 32, 32, 8, 4, ("x", None, "y"), ("x", None, "y")),
    "seq": (1, 64, 64, 4, 2, (None, XY), (None, XY)),
    "seq_t_ne_s": (1, 32, 48, 4, 2, (None, "y"), (None, "y")),
    "batch_x_seq": (2, 64, 64, 4, 2, ("x", "y"), ("x", "y")),
    "heads_x_seq": (1, 32, 32, 4, 4, (None, "x", "y"), (None, "x", "y")),
}
IMPLS = ("cpu", "xla")

# The partitioning (jax_fatrain/_sharding/) is the same for every implementation, which
# is only the per-device callee, and causal changes it only where the
# sequence is sharded (ring attention's zig-zag layout): batch and head
# shardings hand the flag to the unchanged kernel. So cpu runs every sharding,
# causal on and off where the sequence is sharded and one of the two
# (alternating) elsewhere; xla runs each way of partitioning once: no
# collective (batch x heads), split GQA groups (all-reduce of dK/dV), ring
# attention with and without causal, and ring x batch.
CAUSAL = {
    "cpu": {"batch": (True,), "heads": (False,), "gqa_groups": (True,),
            "gqa_split_groups": (False,), "mqa": (True,), "batch_x_heads": (False,),
            "seq": (False, True), "seq_t_ne_s": (False,), "batch_x_seq": (False, True),
            "heads_x_seq": (False, True)},
    "xla": {"batch_x_heads": (True,), "gqa_split_groups": (False,), "seq": (False, True),
            "batch_x_seq": (True,)},
}
CASE_NAMES = [f"{impl}-{name}-{'causal' if c else 'full'}"
              for impl in IMPLS for name, causals in CAUSAL[impl].items() for c in causals]

# Bias / mask / lengths under batch x heads sharding, on one problem: the bias
# shapes per implementation (xla: a broadcast one, whose gradient is summed).
BIAS_DIMS = {"B": 2, "N": 8, "T": 24, "S": 40, "1": 1}
BIAS_SHAPES = {"cpu": ("BNTS", "1N1S", "B11S"), "xla": ("1N1S",)}
# Segment ids: (sharding, causal) per implementation.
SEGMENT_CASES = {
    "cpu": [(name, causal) for name in ("batch_x_heads", "seq", "batch_x_seq")
            for causal in ("full", "causal")],
    "xla": [("batch_x_heads", "full"), ("seq", "causal")],
}

# Collectives that must not appear in the compiled forward+backward, per
# sharding (and the ones that must).
NO_COLLECTIVES = ("batch", "heads", "gqa_groups", "batch_x_heads")
COLLECTIVES = ("all-gather", "all-to-all", "collective-permute", "all-reduce",
               "reduce-scatter")


# ---------------------------------------------------------------------------
# The child process.
# ---------------------------------------------------------------------------


def _child():  # pragma: no cover - runs in the subprocess
  # pylint: disable=import-outside-toplevel
  import re
  import time

  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

  import jax_fatrain

  assert jax.device_count() == 8, jax.devices()
  mesh = jax.make_mesh((2, 4), XY, axis_types=(AxisType.Auto,) * 2)

  only = os.environ.get("JAX_FATRAIN_SHARDING_ONLY")   # debugging: a name filter

  def emit(name, ok, **detail):
    print(json.dumps({"name": name, "ok": bool(ok), **detail}), flush=True)

  def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if not np.array_equal(np.isneginf(a), np.isneginf(b)):   # lse of empty rows
      return float("inf")
    a, b = np.where(np.isneginf(b), 0.0, a), np.where(np.isneginf(b), 0.0, b)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))

  def collectives(text):
    return sorted(set(re.findall(r"\b(" + "|".join(COLLECTIVES) + r")(?:-start)?\(", text)))

  def inputs(b, t, s, n, kh, seed=0, h=64):
    rng = np.random.default_rng(seed)
    f = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)
    return f(b, t, n, h), f(b, s, kh, h), f(b, s, kh, h), f(b, t, n, h)

  def fwd_bwd(impl, causal, **kw):
    """(o, lse, dq, dk, dv[, dbias]) with a random cotangent: no scalar loss,
    so no reduction of our own shows up in the HLO."""
    def f(q, k, v, ct, *extra):
      bias = extra[0] if extra else None
      def attn(q, k, v, bias):
        return jax_fatrain.dot_product_attention(
            q, k, v, bias, is_causal=causal, implementation=impl,
            return_residual=True, **kw)
      (o, lse), vjp = jax.vjp(attn, q, k, v, bias)
      grads = vjp((ct, jnp.zeros_like(lse)))
      return (o, lse) + tuple(g for g in grads if g is not None)
    return f

  sh = lambda spec: NamedSharding(mesh, P(*spec))

  # 1. Sharded == unsharded, and the collectives of each sharding.
  for impl in IMPLS if not only else ():
    for name, causals in CAUSAL[impl].items():
      b, t, s, n, kh, qs, ks = SHARDINGS[name]
      for causal in causals:
        case = f"{impl}-{name}-{'causal' if causal else 'full'}"
        try:
          args = inputs(b, t, s, n, kh, seed=len(case))
          f = fwd_bwd(impl, causal)
          want = jax.jit(f)(*args)
          sharded = jax.jit(f, in_shardings=(sh(qs), sh(ks), sh(ks), sh(qs)))
          start = time.time()
          hlo = sharded.lower(*args).compile().as_text()
          got = sharded(*args)
          errors = [rel(g, w) for g, w in zip(got, want)]
          emit(case, max(errors) < 1e-5, errors=errors, collectives=collectives(hlo),
               out_sharding=str(got[0].sharding.spec), seconds=round(time.time() - start, 2))
        except Exception as e:  # pylint: disable=broad-except
          emit(case, False, error=f"{type(e).__name__}: {e}"[:2000])

  # 2. bias / mask / lengths under batch x heads sharding (bias gradient too).
  b, t, s, n, kh = 2, 24, 40, 8, 4
  q, k, v, ct = inputs(b, t, s, n, kh, seed=3)
  rng = np.random.default_rng(4)
  mask = jnp.asarray(rng.random((b, 1, t, s)) < 0.8)
  ql = jnp.asarray([17, 24], jnp.int32)
  kvl = jnp.asarray([40, 29], jnp.int32)
  assert (b, n, t, s) == tuple(BIAS_DIMS[d] for d in "BNTS")
  for impl in IMPLS:
    for symbols in BIAS_SHAPES[impl]:
      bias_shape = tuple(BIAS_DIMS[d] for d in symbols)
      case = f"{impl}-bias{''.join(map(str, bias_shape))}-mask-lengths-batch_x_heads"
      try:
        bias = jnp.asarray(rng.standard_normal(bias_shape), jnp.float32)
        f = fwd_bwd(impl, True, mask=mask, query_seq_lengths=ql,
                    key_value_seq_lengths=kvl)
        want = jax.jit(f)(q, k, v, ct, bias)
        bspec = tuple("x" if (i == 0 and d == b) else "y" if (i == 1 and d == n) else None
                      for i, d in enumerate(bias_shape))
        sharded = jax.jit(f, in_shardings=(sh(("x", None, "y")),) + (sh(("x", None, "y")),) * 2
                          + (sh(("x", None, "y")), sh(bspec)))
        hlo = sharded.lower(q, k, v, ct, bias).compile().as_text()
        got = sharded(q, k, v, ct, bias)
        errors = [rel(g, w) for g, w in zip(got, want)]
        emit(case, max(errors) < 1e-5, errors=errors, collectives=collectives(hlo))
      except Exception as e:  # pylint: disable=broad-except
        emit(case, False, error=f"{type(e).__name__}: {e}"[:2000])

  # 2b. Segment ids (packed sequences) under batch x heads sharding and under
  # ring attention (the key ids travel with their K/V blocks), causal and not.
  def packed_fwd_bwd(impl, causal):
    def f(q, k, v, ct, q_seg, kv_seg):
      def attn(q, k, v):
        return jax_fatrain.dot_product_attention(
            q, k, v, is_causal=causal, implementation=impl, return_residual=True,
            q_segment_ids=q_seg, kv_segment_ids=kv_seg)
      (o, lse), vjp = jax.vjp(attn, q, k, v)
      return (o, lse) + vjp((ct, jnp.zeros_like(lse)))
    return f

  def packed_ids(b, t, seed):
    rng = np.random.default_rng(seed)
    ids = np.zeros((b, t), np.int32)
    for i in range(b):   # documents crossing the shard boundaries
      cuts = np.sort(rng.choice(np.arange(1, t), 3, replace=False))
      ids[i, cuts] = 1
    return jnp.asarray(np.cumsum(ids, axis=1), jnp.int32)

  segment_shardings = {
      "batch_x_heads": (2, 32, 8, 4, ("x", None, "y"), ("x", None)),
      "seq": (1, 64, 4, 2, (None, XY), (None, XY)),
      "batch_x_seq": (2, 64, 4, 2, ("x", "y"), ("x", "y")),
  }
  for impl in IMPLS:
    for name, causal_name in SEGMENT_CASES[impl]:
      b, t, n, kh, qs, seg_spec = segment_shardings[name]
      causal = causal_name == "causal"
      case = f"{impl}-segments-{name}-{causal_name}"
      try:
        q, k, v, ct = inputs(b, t, t, n, kh, seed=len(case))
        ids = packed_ids(b, t, seed=len(case))
        f = packed_fwd_bwd(impl, causal)
        want = jax.jit(f)(q, k, v, ct, ids, ids)
        sharded = jax.jit(f, in_shardings=(sh(qs),) * 4 + (sh(seg_spec),) * 2)
        hlo = sharded.lower(q, k, v, ct, ids, ids).compile().as_text()
        got = sharded(q, k, v, ct, ids, ids)
        errors = [rel(g, w) for g, w in zip(got, want)]
        emit(case, max(errors) < 1e-5, errors=errors, collectives=collectives(hlo))
      except Exception as e:  # pylint: disable=broad-except
        emit(case, False, error=f"{type(e).__name__}: {e}"[:2000])

  # 3. What ring attention does not support fails clearly.
  q, k, v, ct = inputs(1, 32, 32, 4, 2)
  bias = jnp.zeros((1, 1, 32, 32))
  try:
    jax.jit(fwd_bwd("cpu", False), in_shardings=(sh((None, "y")),) * 4 + (sh(()),)).lower(
        q, k, v, ct, bias).compile()
    emit("ring-bias-refused", False, error="compiled")
  except Exception as e:  # pylint: disable=broad-except
    msg = str(e)
    emit("ring-bias-refused", "NotImplementedError" in msg and "bias" in msg,
         error=msg[-600:])

  # 4. Inside shard_map (manual sharding) the op and its gradient work too:
  # FFI results declare the manual axes they vary over.
  for impl in IMPLS:
    try:
      q, k, v, ct = inputs(8, 32, 32, 4, 2)

      def local_grads(q, k, v, ct):
        return jax.grad(lambda q, k, v: jnp.sum(jax_fatrain.dot_product_attention(
            q, k, v, is_causal=True, implementation=impl) * ct), argnums=(0, 1, 2))(q, k, v)
      got = jax.jit(jax.shard_map(local_grads, mesh=mesh, in_specs=P(XY), out_specs=P(XY)))(
          q, k, v, ct)
      want = local_grads(q, k, v, ct)
      errors = [rel(g, w) for g, w in zip(got, want)]
      emit(f"{impl}-shard_map-grad", max(errors) < 1e-5, errors=errors)
    except Exception as e:  # pylint: disable=broad-except
      emit(f"{impl}-shard_map-grad", False, error=f"{type(e).__name__}: {e}"[:2000])

  # 5. A Flax NNX training step over a 2x4 (data x model) mesh.
  if not only:
    _flax_step(jax, jnp, np, mesh, emit, rel)


def _flax_step(jax, jnp, np, mesh, emit, rel):  # pragma: no cover - subprocess
  # pylint: disable=import-outside-toplevel
  import optax
  from flax import nnx
  from jax.sharding import NamedSharding, PartitionSpec as P

  import jax_fatrain

  vocab, length, batch, features, heads = 29, 32, 4, 32, 4

  class LM(nnx.Module):
    def __init__(self, rngs):
      self.embed = nnx.Embed(vocab, features, rngs=rngs)
      self.attn = nnx.MultiHeadAttention(
          num_heads=heads, in_features=features, qkv_features=features,
          attention_fn=jax_fatrain.flax_attention_fn(implementation="cpu"),
          decode=False, rngs=rngs)
      self.head = nnx.Linear(features, vocab, rngs=rngs)

    def __call__(self, ids):
      x = self.embed(ids)
      return self.head(x + self.attn(x, mask=nnx.make_causal_mask(ids)))

  def param_spec(path, x):
    names = [str(getattr(p, "key", p)) for p in path]
    if any(n in ("query", "key", "value") for n in names):
      return P(None, "model", None) if x.ndim == 3 else P("model", None)
    if "out" in names and x.ndim == 3:
      return P("model", None, None)
    return P()

  graphdef, params, rest = nnx.split(LM(nnx.Rngs(0)), nnx.Param, ...)

  def step(params, rest, tokens):
    def loss_fn(params):
      model = nnx.merge(graphdef, params, rest)
      logits = model(tokens[:, :-1])
      return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()
    loss, grads = jax.value_and_grad(loss_fn)(params)
    return loss, jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)

  rng = np.random.default_rng(0)
  batches = [jnp.asarray(rng.integers(0, vocab, (batch, length + 1)), jnp.int32)
             for _ in range(3)]
  try:
    single = jax.jit(step)
    p, want = params, []
    for tokens in batches:
      loss, p = single(p, rest, tokens)
      want.append(float(loss))

    dm = jax.make_mesh((2, 4), ("data", "model"),
                       axis_types=(jax.sharding.AxisType.Auto,) * 2)
    shardings = jax.tree_util.tree_map_with_path(
        lambda path, x: NamedSharding(dm, param_spec(path, x)), params)
    p = jax.device_put(params, shardings)
    data = NamedSharding(dm, P("data"))
    sharded = jax.jit(step, in_shardings=(shardings, None, data),
                      out_shardings=(None, shardings))
    hlo = sharded.lower(p, rest, batches[0]).compile().as_text()
    # The attention kernels run on [batch/2, T, heads/4, head_dim] shards.
    local = f"f32[{batch // 2},{length},{heads // 4},{features // heads}]"
    calls = [l for l in hlo.splitlines() if 'custom_call_target="jax_fatrain_cpu_' in l]
    got = []
    for tokens in batches:
      loss, p = sharded(p, rest, jax.device_put(tokens, data))
      got.append(float(loss))
    ok = (np.allclose(got, want, rtol=1e-5) and got[-1] < got[0]
          and len(calls) >= 2 and all(local in l for l in calls))
    emit("flax-nnx-train-step-2x4", ok, losses=got, single_device=want,
         kernel_shapes_local=all(local in l for l in calls), n_kernel_calls=len(calls))
  except Exception as e:  # pylint: disable=broad-except
    emit("flax-nnx-train-step-2x4", False, error=f"{type(e).__name__}: {e}"[:2000])


# ---------------------------------------------------------------------------
# pytest side.
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def results():
  env = dict(os.environ)
  env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") +
                      " --xla_force_host_platform_device_count=8").strip()
  env["JAX_PLATFORMS"] = "cpu"
  proc = subprocess.run([sys.executable, os.path.abspath(__file__)], env=env,
                        capture_output=True, text=True, timeout=900, check=False)
  out = {}
  for line in proc.stdout.splitlines():
    if line.startswith("{"):
      record = json.loads(line)
      out[record["name"]] = record
  if not out:
    pytest.fail(f"the sharding child produced no results (rc {proc.returncode}):\n"
                f"{proc.stderr[-4000:]}")
  return out


def _get(results, name):
  assert name in results, f"no result for {name} (child crashed?)"
  return results[name]


@pytest.mark.parametrize("case", CASE_NAMES)
def test_sharded_equals_unsharded(results, case):
  r = _get(results, case)
  assert r["ok"], r
  sharding = case.split("-")[1]
  if sharding in NO_COLLECTIVES:
    # Each device runs the kernels on its own shard: nothing is gathered or moved.
    assert r["collectives"] == [], r
  elif sharding in ("gqa_split_groups", "mqa"):
    # Query heads of one kv head live on several devices: k/v are replicated
    # over the head axis and the backward sums their dK/dV (all-reduce), nothing else.
    assert r["collectives"] == ["all-reduce"], r
  else:  # ring attention: K/V move by collective-permute, never gathered
    assert "collective-permute" in r["collectives"], r
    assert "all-gather" not in r["collectives"], r
    assert "all-to-all" not in r["collectives"], r


@pytest.mark.parametrize("impl, bias", [(impl, symbols) for impl in IMPLS
                                        for symbols in BIAS_SHAPES[impl]])
def test_bias_mask_lengths_batch_x_heads(results, impl, bias):
  shape = "".join(str(BIAS_DIMS[d]) for d in bias)
  r = _get(results, f"{impl}-bias{shape}-mask-lengths-batch_x_heads")
  assert r["ok"], r
  # No gathers; a bias broadcast over a sharded dim has its gradient summed.
  assert "all-gather" not in r["collectives"] and "all-to-all" not in r["collectives"], r
  assert "collective-permute" not in r["collectives"], r
  if bias == "BNTS":   # nothing broadcast: nothing to sum either
    assert r["collectives"] == [], r
  else:
    assert r["collectives"] == ["all-reduce"], r


@pytest.mark.parametrize("impl, sharding, causal",
                         [(impl, name, causal) for impl in IMPLS
                          for name, causal in SEGMENT_CASES[impl]])
def test_segment_ids_sharded(results, impl, sharding, causal):
  r = _get(results, f"{impl}-segments-{sharding}-{causal}")
  assert r["ok"], r
  if sharding == "batch_x_heads":
    assert r["collectives"] == [], r
  else:   # ring attention: K/V (and key ids) move by collective-permute
    assert "collective-permute" in r["collectives"], r
    assert "all-gather" not in r["collectives"], r


def test_ring_refuses_bias_clearly(results):
  r = _get(results, "ring-bias-refused")
  assert r["ok"], r


@pytest.mark.parametrize("impl", IMPLS)
def test_gradient_inside_shard_map(results, impl):
  r = _get(results, f"{impl}-shard_map-grad")
  assert r["ok"], r


def test_flax_training_step_on_2x4_mesh(results):
  r = _get(results, "flax-nnx-train-step-2x4")
  assert r["ok"], r


if __name__ == "__main__":
  _child()
