"""The ``qwen`` preset of the demo: ``python -m jax_fatrain.demo --preset qwen``.

It trains a decoder whose attention layers have the geometry of the full-attention
layers of Qwen3.6-35B-A3B-class models, scaled down in width and depth only:

* 16 query heads, 2 key/value heads (GQA 8:1), head dim 256, causal;
* RMSNorm on each query and key head, then rotary position embeddings (the
  demo's :func:`~jax_fatrain.demo.rotate`);
* a sigmoid output gate: a projection of the layer input, ``sigmoid(x W_g)``, is
  multiplied elementwise into the attention output, head by head, before the
  output projection;
* bfloat16 activations (float32 parameters and optimizer state, float32 logits),
  pre-norm RMSNorm blocks with a SwiGLU MLP (dense, where those models route
  tokens to experts), an output head tied to the token embedding, Optax AdamW.

Every training sequence packs documents of random lengths (``--min-doc`` to
``--max-doc`` characters, each starting at a line of the demo's corpus); the
document number of every position is passed as ``q_segment_ids`` / ``kv_segment_ids``, so
a token attends only to earlier tokens of its own document, and the loss leaves
out the one prediction per document boundary. Rotary positions count from the
start of the sequence rather than of each document; this changes nothing, since
a rotated query-key product depends only on the distance between the two
positions and no query sees another document.

The same model, from the same initial parameters and on the same batches, is
trained a second time with ``jax.nn.dot_product_attention`` (XLA) given the
equivalent boolean mask ``[B, 1, T, T]``: causal and same document. Reported for
each: mean step time (the compiled step, without its compilation, step 0 left
out), tokens per
second, attention's share of the step, memory, and the loss curves (PNG).

Attention's share is measured, not estimated: the attention forward and backward
(``jax.grad`` with respect to q, k and v) is compiled alone at the model's shapes,
on the first batch's packing, and timed with the two implementations taking
turns; that time times the number of layers, over the mean step time, is the
share. The projections, norms, rotary embeddings and gate count as the rest of the
step.

Memory: XLA's buffer assignment of the compiled training step
(``memory_analysis()``: arguments + outputs + temporaries - donated aliases),
on every backend; and, where the backend reports it (``device.memory_stats()``,
GPUs), the device's peak bytes in use after each run. That peak is a running
maximum over the process, and ours runs first, so the reference's figure is the
larger of the two runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import sys
import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jax_fatrain._flax import flax_attention_fn
from jax_fatrain import demo as _demo

# (segment ids [B, T] int32) -> attention(q, k, v) in the model's layout.
Attend = Callable[[jax.Array, jax.Array, jax.Array, jax.Array], jax.Array]

# The attention geometry of the preset; the point of the preset, so no flags.
HEADS, KV_HEADS, HEAD_DIM = 16, 2, 256

# Sizes by --size. "cpu" finishes in about 3 minutes on 2 cores (both runs and
# the attention timing); "gpu" is for one NVIDIA H100/H200.
SIZES: dict[str, dict[str, int]] = {
    "cpu": dict(steps=120, seq_len=512, batch_size=1, d_model=256, layers=2,
                mlp_dim=512, min_doc=32, max_doc=256),
    "gpu": dict(steps=200, seq_len=4096, batch_size=4, d_model=1024, layers=4,
                mlp_dim=2048, min_doc=128, max_doc=2048),
}

# ---------------------------------------------------------------------------
# Data: documents of random lengths packed into each sequence
# ---------------------------------------------------------------------------


def line_starts(ids: np.ndarray, newline: int) -> np.ndarray:
  """Offsets in ``ids`` where a line begins (documents begin there)."""
  return np.concatenate([[0], np.flatnonzero(ids[:-1] == newline) + 1])


def pack_batch(ids: np.ndarray, starts: np.ndarray, rng: np.random.Generator, *,
               batch_size: int, seq_len: int, min_doc: int, max_doc: int):
  """One batch of packed sequences.

  Each row is filled with documents one after another, each of a length drawn
  uniformly from ``[min_doc, max_doc]`` (the last one cut to fit) and starting at a
  random line of ``ids``. Returns ``x`` and ``y`` (inputs and next-token targets,
  ``[B, T]`` int32), ``segment_ids`` ``[B, T]`` int32 (the document of each input
  position: 0, 1, 2, ... along the row) and ``weights`` ``[B, T]`` float32, 0 where
  the target lies in the next document (nothing to learn there), else 1.
  """
  tokens = np.empty((batch_size, seq_len + 1), np.int32)
  seg = np.empty((batch_size, seq_len + 1), np.int32)
  usable = starts[starts < len(ids) - max_doc]
  for b in range(batch_size):
    pos, doc = 0, 0
    while pos < seq_len + 1:
      n = min(int(rng.integers(min_doc, max_doc + 1)), seq_len + 1 - pos)
      s = int(usable[rng.integers(len(usable))])
      tokens[b, pos:pos + n] = ids[s:s + n]
      seg[b, pos:pos + n] = doc
      pos, doc = pos + n, doc + 1
  weights = (seg[:, 1:] == seg[:, :-1]).astype(np.float32)
  return tokens[:, :-1], tokens[:, 1:], seg[:, :-1], weights


def packed_causal_mask(segment_ids: jax.Array) -> jax.Array:
  """The boolean mask ``[B, 1, T, T]`` equivalent to causal + segment ids."""
  t = segment_ids.shape[-1]
  same = segment_ids[:, :, None] == segment_ids[:, None, :]
  causal = jnp.tril(jnp.ones((t, t), jnp.bool_))
  return (same & causal)[:, None]


def fatrain_attend(implementation: str | None = None, *, attention=None) -> Attend:
  """Our attention through the Flax adapter: causal, segment ids per call."""
  hook = (flax_attention_fn(implementation) if attention is None
          else flax_attention_fn(attention=attention))

  def attend(q, k, v, segment_ids):
    return hook(q, k, v, is_causal=True, q_segment_ids=segment_ids,
                kv_segment_ids=segment_ids)
  return attend


def reference_attend() -> Attend:
  """``jax.nn.dot_product_attention`` (XLA) with the equivalent boolean mask."""
  hook = flax_attention_fn(attention=_demo.reference_attention())

  def attend(q, k, v, segment_ids):
    return hook(q, k, v, mask=packed_causal_mask(segment_ids))
  return attend


# ---------------------------------------------------------------------------
# Model
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class QwenConfig:
  vocab_size: int
  d_model: int = 256
  layers: int = 2
  mlp_dim: int = 512
  heads: int = HEADS
  kv_heads: int = KV_HEADS
  head_dim: int = HEAD_DIM
  dtype: Any = jnp.bfloat16


class GatedAttention(nnx.Module):
  """GQA attention with q/k RMSNorm, rotary positions and a sigmoid output gate."""

  def __init__(self, cfg: QwenConfig, attend: Attend, *, rngs: nnx.Rngs):
    d, n, k, h = cfg.d_model, cfg.heads, cfg.kv_heads, cfg.head_dim
    linear = functools.partial(nnx.Linear, use_bias=False, dtype=cfg.dtype, rngs=rngs)
    self.q_proj, self.gate_proj = linear(d, n * h), linear(d, n * h)
    self.k_proj, self.v_proj = linear(d, k * h), linear(d, k * h)
    self.o_proj = linear(n * h, d)
    self.q_norm = nnx.RMSNorm(h, dtype=cfg.dtype, rngs=rngs)
    self.k_norm = nnx.RMSNorm(h, dtype=cfg.dtype, rngs=rngs)
    self.shape = (n, k, h)
    self.attend = attend

  def __call__(self, x, segment_ids):
    b, t, _ = x.shape
    n, k, h = self.shape
    q = _demo.rotate(self.q_norm(self.q_proj(x).reshape(b, t, n, h)))
    kk = _demo.rotate(self.k_norm(self.k_proj(x).reshape(b, t, k, h)))
    v = self.v_proj(x).reshape(b, t, k, h)
    o = self.attend(q, kk, v, segment_ids)  # [b, t, n, h]
    gate = jax.nn.sigmoid(self.gate_proj(x).reshape(b, t, n, h))
    return self.o_proj((o * gate).reshape(b, t, n * h))


class Block(nnx.Module):
  """Pre-norm block: x + Attn(RMSNorm(x)), then x + SwiGLU(RMSNorm(x))."""

  def __init__(self, cfg: QwenConfig, attend: Attend, *, rngs: nnx.Rngs):
    d = cfg.d_model
    linear = functools.partial(nnx.Linear, use_bias=False, dtype=cfg.dtype, rngs=rngs)
    self.norm1 = nnx.RMSNorm(d, dtype=cfg.dtype, rngs=rngs)
    self.attn = GatedAttention(cfg, attend, rngs=rngs)
    self.norm2 = nnx.RMSNorm(d, dtype=cfg.dtype, rngs=rngs)
    self.up, self.gate = linear(d, cfg.mlp_dim), linear(d, cfg.mlp_dim)
    self.down = linear(cfg.mlp_dim, d)

  def __call__(self, x, segment_ids):
    x = x + self.attn(self.norm1(x), segment_ids)
    y = self.norm2(x)
    return x + self.down(jax.nn.silu(self.gate(y)) * self.up(y))


class QwenDecoder(nnx.Module):
  """Causal character LM; the output head reuses the token embedding (tied)."""

  def __init__(self, cfg: QwenConfig, attend: Attend, *, rngs: nnx.Rngs):
    self.cfg = cfg
    self.tok = nnx.Embed(cfg.vocab_size, cfg.d_model, dtype=cfg.dtype, rngs=rngs)
    self.blocks = nnx.List([Block(cfg, attend, rngs=rngs) for _ in range(cfg.layers)])
    self.norm = nnx.RMSNorm(cfg.d_model, dtype=cfg.dtype, rngs=rngs)

  def __call__(self, ids, segment_ids):
    x = self.tok(ids)
    for block in self.blocks:
      x = block(x, segment_ids)
    return self.tok.attend(self.norm(x)).astype(jnp.float32)


def masked_cross_entropy(logits, targets, weights):
  ce = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
  return jnp.sum(ce * weights) / jnp.maximum(jnp.sum(weights), 1.0)


# ---------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------


@dataclasses.dataclass
class QwenRun:
  name: str
  losses: list[float]
  step_times: list[float]  # the compiled step, without its compilation
  compile_time: float
  step_bytes: int | None  # XLA's buffer assignment of the training step
  peak_bytes: int | None  # device.memory_stats(), running peak of the process
  tokens_per_step: int
  model: QwenDecoder

  @property
  def mean_step_time(self) -> float:
    times = self.step_times[1:] or self.step_times  # step 0 also warms up
    return float(np.mean(times))

  @property
  def tokens_per_second(self) -> float:
    return self.tokens_per_step / self.mean_step_time


def _step_bytes(compiled) -> int | None:
  try:
    m = compiled.memory_analysis()
    return int(m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
               - m.alias_size_in_bytes)
  except Exception:  # pylint: disable=broad-except  # not every backend reports it
    return None


def _peak_bytes() -> int | None:
  try:
    stats = jax.devices()[0].memory_stats()
  except Exception:  # pylint: disable=broad-except
    return None
  return int(stats["peak_bytes_in_use"]) if stats and "peak_bytes_in_use" in stats else None


def train(name: str, attend: Attend, cfg: QwenConfig, batches, *, seed: int, lr: float,
          progress: bool = True) -> QwenRun:
  """Trains a fresh model (initialised from ``seed``) on ``batches``."""
  model = QwenDecoder(cfg, attend, rngs=nnx.Rngs(seed))
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  tx = _demo.make_optimizer(len(batches), lr)
  opt_state = tx.init(params)

  def loss_fn(params, x, y, seg, w):
    return masked_cross_entropy(nnx.merge(graphdef, params, rest)(x, seg), y, w)

  def train_step(params, opt_state, x, y, seg, w):
    loss, grads = jax.value_and_grad(loss_fn)(params, x, y, seg, w)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  t0 = time.perf_counter()
  step = jax.jit(train_step, donate_argnums=(0, 1)).lower(
      params, opt_state, *batches[0]).compile()
  compile_time = time.perf_counter() - t0

  losses, times = [], []
  steps = range(len(batches))
  bar = None
  if progress and _demo.tqdm is not None:
    bar = _demo.tqdm(steps, desc=f"train [{name}]", leave=True, dynamic_ncols=True,
                     file=sys.stderr)
    steps = bar
  for i in steps:
    t0 = time.perf_counter()
    params, opt_state, loss = step(params, opt_state, *batches[i])
    loss = float(loss)  # waits for the step to finish
    times.append(time.perf_counter() - t0)
    losses.append(loss)
    if bar is not None:
      bar.set_postfix(loss=f"{loss:.4f}", step=f"{times[-1] * 1e3:.0f}ms")
  if bar is not None:
    bar.close()
  nnx.update(model, params)
  x = batches[0][0]
  return QwenRun(name, losses, times, compile_time, _step_bytes(step), _peak_bytes(),
                 int(x.shape[0] * x.shape[1]), model)


def time_attention(attends: dict[str, Attend], cfg: QwenConfig, segment_ids, *,
                   reps: int = 5, seed: int = 0) -> dict[str, float]:
  """Median seconds of one attention forward + backward at the model's shapes.

  ``q`` ``[B, T, heads, head_dim]``, ``k``/``v`` ``[B, T, kv_heads, head_dim]`` in
  the model's dtype, called as a layer calls them (with ``segment_ids``: our
  kernels take the ids, the reference builds its mask from them, inside the timed
  function), under ``jax.grad`` with respect to q, k and v. The implementations
  take turns, one call each per round.
  """
  b, t = segment_ids.shape
  kq, kk, kv, kc = jax.random.split(jax.random.key(seed), 4)
  q = jax.random.normal(kq, (b, t, cfg.heads, cfg.head_dim), cfg.dtype)
  k = jax.random.normal(kk, (b, t, cfg.kv_heads, cfg.head_dim), cfg.dtype)
  v = jax.random.normal(kv, (b, t, cfg.kv_heads, cfg.head_dim), cfg.dtype)
  cotangent = jax.random.normal(kc, q.shape, jnp.float32)
  segment_ids = jnp.asarray(segment_ids)

  def fwd_bwd(attend):
    def loss(q, k, v, seg):
      return jnp.sum(attend(q, k, v, seg).astype(jnp.float32) * cotangent)
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))

  fns = {name: fwd_bwd(fn) for name, fn in attends.items()}
  for fn in fns.values():  # compile
    jax.block_until_ready(fn(q, k, v, segment_ids))
  times: dict[str, list[float]] = {name: [] for name in fns}
  for _ in range(max(1, reps)):
    for name, fn in fns.items():
      t0 = time.perf_counter()
      jax.block_until_ready(fn(q, k, v, segment_ids))
      times[name].append(time.perf_counter() - t0)
  return {name: float(np.median(t)) for name, t in times.items()}


# ---------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------


def _mib(n: int | None) -> str:
  return "n/a" if n is None else f"{n / 2**20:.0f} MiB"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
  import jax_fatrain  # pylint: disable=import-outside-toplevel
  available = jax_fatrain.available_implementations()
  p = argparse.ArgumentParser(
      prog="python -m jax_fatrain.demo --preset qwen",
      description="Train a decoder with the attention geometry of Qwen3.6-35B-A3B's "
      f"full-attention layers ({HEADS} query heads, {KV_HEADS} kv heads, head dim "
      f"{HEAD_DIM}, causal, sigmoid output gate, rotary), on packed documents, in "
      "bfloat16, with jax_fatrain attention and with jax.nn.dot_product_attention.")
  p.add_argument("--preset", choices=("qwen",), default="qwen", help=argparse.SUPPRESS)
  p.add_argument("--size", choices=("auto",) + tuple(SIZES), default="auto",
                 help="default sizes: 'gpu' where jax's default backend is a GPU, else "
                 "'cpu' (auto); "
                 "the flags below override single sizes. " + "; ".join(
                     f"{k}: " + ", ".join(f"{n}={v}" for n, v in s.items())
                     for k, s in SIZES.items()))
  helps = {"mlp_dim": "hidden width of the SwiGLU MLP",
           "min_doc": "shortest document packed into a sequence, in characters",
           "max_doc": "longest document packed into a sequence, in characters"}
  for name in SIZES["cpu"]:
    p.add_argument("--" + name.replace("_", "-"), type=int, default=None,
                   help=helps.get(name))
  p.add_argument("--implementation", default=None, metavar="NAME",
                 help="implementation= passed to jax_fatrain.dot_product_attention: "
                 f"one of {', '.join(available)} here, or 'auto' (the default)")
  p.add_argument("--no-reference", action="store_true",
                 help="skip the run with jax.nn.dot_product_attention")
  p.add_argument("--lr", type=float, default=3e-3)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--timing-reps", type=int, default=5,
                 help="calls of each attention forward+backward timed alone (median "
                 "reported); 0 skips this measurement")
  p.add_argument("--plot", default="jax_fatrain_demo_qwen.png", metavar="PATH",
                 help="PNG with the loss curves and step times (default %(default)s; "
                 "'' writes none)")
  p.add_argument("--no-plot", action="store_true", help="write no plot")
  p.add_argument("--no-progress", action="store_true", help="hide the progress bars")
  args = p.parse_args(argv)
  if args.implementation in ("auto", ""):
    args.implementation = None
  if args.implementation is not None:
    try:
      jax_fatrain.explain_implementation(args.implementation)
    except ValueError as e:
      p.error(f"--implementation: {e}")
  if args.size == "auto":
    args.size = "gpu" if jax.default_backend() == "gpu" else "cpu"
  for name, value in SIZES[args.size].items():
    if getattr(args, name) is None:
      setattr(args, name, value)
  if not 1 <= args.min_doc <= args.max_doc:
    p.error(f"need 1 <= --min-doc ({args.min_doc}) <= --max-doc ({args.max_doc})")
  if args.no_plot:
    args.plot = ""
  return args


def main(argv: Sequence[str] | None = None, *,
         attend: Attend | None = None) -> dict[str, Any]:
  """Runs the preset; returns the measured numbers.

  ``attend`` replaces our attention for the first run (for testing).
  """
  import jax_fatrain  # pylint: disable=import-outside-toplevel
  args = parse_args(argv)
  t_start, cpu_start = time.perf_counter(), time.process_time()
  data = _demo.CharData.from_text(_demo.load_corpus())
  cfg = QwenConfig(vocab_size=data.vocab_size, d_model=args.d_model, layers=args.layers,
                   mlp_dim=args.mlp_dim)
  rng = np.random.default_rng(args.seed)
  starts = line_starts(data.train, data.chars.index("\n"))
  batches = [pack_batch(data.train, starts, rng, batch_size=args.batch_size,
                        seq_len=args.seq_len, min_doc=args.min_doc, max_doc=args.max_doc)
             for _ in range(args.steps)]
  docs = np.mean([b[2].max(axis=1).mean() + 1 for b in batches])

  if attend is None:
    impl_name, impl_reason = jax_fatrain.explain_implementation(
        args.implementation, cfg.dtype, cfg.head_dim)
    attend = fatrain_attend(args.implementation)
  else:
    impl_name, impl_reason = "custom", "an attention function passed to main"
  ours_name = f"jax_fatrain/{impl_name}"
  n_params = sum(x.size for x in jax.tree.leaves(
      nnx.state(QwenDecoder(cfg, reference_attend(), rngs=nnx.Rngs(args.seed)), nnx.Param)))
  chosen = "chosen automatically" if args.implementation is None else "--implementation"
  geometry = (f"attention {cfg.heads} q heads, {cfg.kv_heads} kv heads x {cfg.head_dim}, "
              "causal, sigmoid output gate, rotary")
  sizes = (f"{_demo._layers(cfg.layers)}, d_model {cfg.d_model}, SwiGLU {cfg.mlp_dim}, "
           f"{n_params / 1e6:.1f}M params, bfloat16 activations; batch {args.batch_size} x "
           f"{args.seq_len} tokens, {docs:.1f} documents per sequence on average "
           f"({args.min_doc}-{args.max_doc} chars), {args.steps} steps")
  print(f"jax {jax.__version__} on {jax.devices()[0].platform} "
        f"({jax.devices()[0].device_kind}), sizes '{args.size}'")
  print(f"attention: jax_fatrain implementation {impl_name!r} ({chosen}: {impl_reason})")
  print(f"model: {geometry}; {sizes}")

  common = dict(seed=args.seed, lr=args.lr, progress=not args.no_progress)
  runs = [train(ours_name, attend, cfg, batches, **common)]
  attends = {ours_name: attend}
  if not args.no_reference:
    runs.append(train("jax.nn", reference_attend(), cfg, batches, **common))
    attends["jax.nn"] = reference_attend()

  result: dict[str, Any] = {"config": vars(args).copy(), "implementation": impl_name,
                            "implementation_reason": impl_reason, "n_params": n_params,
                            "documents_per_sequence": float(docs)}
  print()
  for key, run in zip(("ours", "reference"), runs):
    result.update({f"losses_{key}": run.losses, f"step_times_{key}": run.step_times,
                   f"loss_{key}": run.losses[-1], f"step_time_{key}": run.mean_step_time,
                   f"tokens_per_second_{key}": run.tokens_per_second,
                   f"compile_time_{key}": run.compile_time,
                   f"step_bytes_{key}": run.step_bytes, f"peak_bytes_{key}": run.peak_bytes})
    print(f"{run.name:>16}: final loss {run.losses[-1]:.4f}, mean step "
          f"{run.mean_step_time * 1e3:.1f} ms, {run.tokens_per_second:,.0f} tokens/s "
          f"(compile {run.compile_time:.1f} s); memory: compiled step "
          f"{_mib(run.step_bytes)}, device peak {_mib(run.peak_bytes)}")
  if len(runs) == 2:
    _demo.compare_runs(runs[0], runs[1], result)

  attention_step: dict[str, float] = {}
  if args.timing_reps > 0:
    per_call = time_attention(attends, cfg, batches[0][2], reps=args.timing_reps,
                              seed=args.seed)
    attention_step = {name: t * cfg.layers for name, t in per_call.items()}
    for key, run in zip(("ours", "reference"), runs):
      result[f"attention_time_{key}"] = attention_step[run.name]
      result[f"attention_share_{key}"] = attention_step[run.name] / run.mean_step_time
    times = ", ".join(f"{label} {attention_step[run.name] * 1e3:.1f} ms "
                      f"({attention_step[run.name] / run.mean_step_time:.0%} of its step)"
                      for label, run in zip(("ours", "reference"), runs))
    print(f"attention fwd+bwd timed alone ({_demo._layers(cfg.layers)} x "
          f"[{args.batch_size}, {args.seq_len}, {cfg.heads} (kv {cfg.kv_heads}), "
          f"{cfg.head_dim}], packed causal): {times} per step")

  if args.plot:
    title = (f"jax_fatrain demo, preset qwen: implementation {impl_name!r}"
             + (" vs jax.nn (XLA, boolean mask)" if len(runs) == 2 else "")
             + f"\n{geometry}\n{sizes}")
    # The plot leaves out step 0 as the compiling step; charge it the compilation.
    plot_runs = [_demo.RunResult(r.name, r.losses,
                                 [r.compile_time + r.step_times[0]] + r.step_times[1:],
                                 float("nan"), r.model) for r in runs]
    _demo.plot_or_explain(args.plot, plot_runs, attention_step, title, result)
  result["wall_time"] = time.perf_counter() - t_start
  # On a shared machine the wall time depends on the other jobs; the CPU time
  # this process used (all threads) does much less.
  result["cpu_time"] = time.process_time() - cpu_start
  print(f"\ntotal wall time {result['wall_time']:.1f} s, CPU time {result['cpu_time']:.1f} s")
  return result
