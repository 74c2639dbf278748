"""The demo's ``qwen`` preset (jax_fatrain/_demo_qwen.py) at tiny sizes: packing,
the mask the reference gets, agreement of the model's two attentions, and a run.

The geometry stays the preset's (16 query heads, 2 kv heads, head dim 256); only
width, depth and sequence length shrink, so each test takes seconds.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

try:
  import jax_fatrain
  from jax_fatrain import _demo_qwen as qwen
  from jax_fatrain import demo
  _IMPORT_ERROR = None
except Exception as e:  # pylint: disable=broad-except
  _IMPORT_ERROR = f"{type(e).__name__}: {e}"

pytestmark = pytest.mark.skipif(
    _IMPORT_ERROR is not None, reason=f"the demo cannot be imported: {_IMPORT_ERROR}")

# The two runs differ only inside attention (our kernels against XLA's dense
# softmax: other summation orders, other roundings to bfloat16), and those
# differences pass through every later bfloat16 layer and optimizer step.
# Measured at the tiny size below: the losses differ by about 6e-4 on losses near
# 3.5, where bfloat16's spacing is 2**-6 = 0.016. 1e-2 leaves room for another
# CPU's rounding; a reference that lets tokens see other documents (causal mask
# only, planted) moves the three losses by 0.02 to 0.06 and fails.
LOSS_ATOL = 1e-2

_TINY = ["--preset", "qwen", "--steps", "3", "--seq-len", "64", "--batch-size", "2",
         "--d-model", "32", "--layers", "1", "--mlp-dim", "64", "--min-doc", "8",
         "--max-doc", "24", "--timing-reps", "1", "--no-progress"]


def _ours() -> str:
  return "cpu" if "cpu" in jax_fatrain.available_implementations() else "xla"


def _data():
  data = demo.CharData.from_text(demo.load_corpus())
  return data, qwen.line_starts(data.train, data.chars.index("\n"))


def test_pack_batch_packs_whole_lines_into_segments():
  data, starts = _data()
  rng = np.random.default_rng(0)
  x, y, seg, w = qwen.pack_batch(data.train, starts, rng, batch_size=3, seq_len=200,
                                 min_doc=10, max_doc=40)
  assert x.shape == y.shape == seg.shape == w.shape == (3, 200)
  np.testing.assert_array_equal(x[:, 1:], y[:, :-1])
  line_start = set(starts.tolist())
  for b in range(3):
    assert seg[b, 0] == 0 and set(np.diff(seg[b])) <= {0, 1}
    bounds = np.flatnonzero(np.diff(seg[b])) + 1
    lengths = np.diff(np.concatenate([[0], bounds, [200]]))
    assert np.all(lengths[:-1] >= 10) and np.all(lengths <= 40)
    assert len(bounds) >= 4  # several documents in every row
    # No loss across a boundary, everywhere else a loss (the last target may
    # begin a document that the row has no room for).
    np.testing.assert_array_equal(
        w[b, :-1], np.isin(np.arange(199), bounds - 1, invert=True))
    for s, n in zip(np.concatenate([[0], bounds]), lengths):  # each document is a
      doc = x[b, s:s + n]                                     # corpus line's start
      hits = [o for o in line_start if np.array_equal(data.train[o:o + n], doc)]
      assert hits, (b, s, n)


def test_packed_causal_mask():
  seg = jnp.array([[0, 0, 0, 1, 1, 2], [0, 1, 1, 1, 1, 1]], jnp.int32)
  mask = np.asarray(qwen.packed_causal_mask(seg))
  assert mask.shape == (2, 1, 6, 6)
  for b in range(2):
    for i in range(6):
      for j in range(6):
        assert mask[b, 0, i, j] == (j <= i and seg[b, i] == seg[b, j])


def _logits(attend, cfg, x, seg, seed=0):
  from flax import nnx  # pylint: disable=import-outside-toplevel
  graphdef, state = nnx.split(qwen.QwenDecoder(cfg, attend, rngs=nnx.Rngs(seed)))
  return jax.jit(lambda state: nnx.merge(graphdef, state)(x, seg))(state)


def test_model_attentions_agree_and_the_check_sees_a_wrong_mask():
  """Ours and jax.nn with the boolean mask give the same logits, from the same
  parameters; the reference with a causal mask that ignores the documents does
  not (so the agreement is not an accident of a model that ignores attention)."""
  data, starts = _data()
  x, _, seg, _ = qwen.pack_batch(data.train, starts, np.random.default_rng(1),
                                 batch_size=2, seq_len=64, min_doc=8, max_doc=24)
  cfg = qwen.QwenConfig(vocab_size=data.vocab_size, d_model=32, layers=1, mlp_dim=64)

  def causal_only(q, k, v, segment_ids):
    del segment_ids
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla")

  ours = _logits(qwen.fatrain_attend(_ours()), cfg, x, seg)
  ref = _logits(qwen.reference_attend(), cfg, x, seg)
  wrong = _logits(causal_only, cfg, x, seg)
  assert ours.shape == (2, 64, data.vocab_size)
  scale = float(jnp.max(jnp.abs(ref)))
  good = float(jnp.max(jnp.abs(ours - ref))) / scale
  bad = float(jnp.max(jnp.abs(wrong - ref))) / scale
  assert good < 2e-2, good
  assert bad > 10 * good and bad > 2e-2, (good, bad)


def test_qwen_preset_tiny_run(tmp_path, capsys):
  plot = tmp_path / "qwen.png"
  result = demo.main(_TINY + ["--implementation", _ours(), "--plot", str(plot)])
  out = capsys.readouterr().out
  assert result["implementation"] == _ours()
  assert "attention 16 q heads, 2 kv heads x 256, causal, sigmoid output gate" in out
  for key in ("ours", "reference"):
    losses = result[f"losses_{key}"]
    assert len(losses) == 3 and all(math.isfinite(v) for v in losses)
    assert result[f"step_time_{key}"] > 0 and result[f"tokens_per_second_{key}"] > 0
    assert result[f"attention_share_{key}"] == pytest.approx(
        result[f"attention_time_{key}"] / result[f"step_time_{key}"])
  # Training moves the loss (the learning rate reaches the model) ...
  assert result["losses_ours"][-1] < result["losses_ours"][0]
  # ... and the two runs see the same data and parameters: the curves agree.
  np.testing.assert_allclose(result["losses_ours"], result["losses_reference"],
                             atol=LOSS_ATOL, rtol=0)
  assert result["documents_per_sequence"] > 2
  assert result["plot"] == str(plot) and plot.read_bytes()[:4] == b"\x89PNG"


def test_qwen_preset_sizes():
  args = qwen.parse_args(["--size", "cpu", "--steps", "7"])
  assert args.steps == 7 and args.seq_len == qwen.SIZES["cpu"]["seq_len"]
  args = qwen.parse_args(["--size", "gpu"])
  assert args.seq_len == qwen.SIZES["gpu"]["seq_len"]
  expect = "gpu" if jax.default_backend() == "gpu" else "cpu"
  assert qwen.parse_args([]).size == expect
  with pytest.raises(SystemExit):
    qwen.parse_args(["--min-doc", "50", "--max-doc", "10"])


def test_output_gate_multiplies_the_attention_output_before_the_projection():
  """With an attention that returns ones, the layer computes
  o_proj(sigmoid(gate_proj(x))): the gate comes from the layer input and is
  applied elementwise, head by head, before the output projection."""
  from flax import nnx  # pylint: disable=import-outside-toplevel
  cfg = qwen.QwenConfig(vocab_size=8, d_model=16, layers=1, mlp_dim=16,
                        dtype=jnp.float32)
  layer = qwen.GatedAttention(cfg, lambda q, k, v, seg: jnp.ones_like(q),
                              rngs=nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(1), (2, 5, 16))
  seg = jnp.zeros((2, 5), jnp.int32)
  want = layer.o_proj(jax.nn.sigmoid(layer.gate_proj(x)))
  np.testing.assert_allclose(layer(x, seg), want, rtol=1e-5, atol=1e-5)
  assert float(jnp.max(jnp.abs(want - layer.o_proj(jnp.ones((2, 5, 16 * 256)))))) > 0.1
