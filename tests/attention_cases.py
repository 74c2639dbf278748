"""The shared description of test problems and the reference they are held to.

Every implementation runs the same cases (tests/test_attention.py). The
reference is ``jax.nn.dot_product_attention(implementation="xla")`` on inputs
upcast to float32 (docs/testing.md); segment ids, which jax.nn does not take,
become the equivalent materialised boolean mask there (``jax_nn_kwargs``).
Rows that see no key are compared against our own convention (zero output,
-inf logsumexp, zero gradients) because jax.nn returns the mean of ``value``
there.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

# Implementations that run the whole suite here. cpu and xla must pass on every
# machine (never skipped); cuda joins where its extension is built and JAX sees
# a GPU. metal_emulated runs the same cases from tests/test_metal_emulator.py,
# which also covers every compiled kernel variant.
def _implementations():
  from jax_fatrain._backends import cuda as _cuda
  if not _cuda.gpu_present():
    return ("cpu", "xla")
  # On a GPU, XLA computes float32 matmuls in TF32 by default (~5e-4 relative
  # error), which would make the float32 reference itself miss the float32
  # tolerance; the reference must be true float32 (docs/testing.md).
  jax.config.update("jax_default_matmul_precision", "highest")
  return ("cpu", "xla", "cuda")


# metal joins on a Mac with a Metal device (where jax_fatrain builds it);
# JAX_FATRAIN_REQUIRE_METAL=1 (the macOS workflow) makes its absence an error
# instead of a silent omission.
def _with_metal(impls):
  import os
  import jax_fatrain
  from jax_fatrain._backends import metal as _metal
  if "metal" in jax_fatrain.available_implementations():
    return impls + ("metal",)
  if os.environ.get("JAX_FATRAIN_REQUIRE_METAL") == "1":
    raise RuntimeError(f"JAX_FATRAIN_REQUIRE_METAL=1 but 'metal' is unavailable: "
                       f"{_metal.IMPORT_ERROR}")
  return impls


IMPLEMENTATIONS = _with_metal(_implementations())

@dataclasses.dataclass(frozen=True)
class Tolerance:
  """Largest relative errors (norm of the difference / norm of the reference)."""
  out: float    # attention output, on rows that see a key
  lse: float    # logsumexp, on rows that see a key
  grad: float   # dq, dk, dv, dbias
  # Plus this multiple of the gradient's cancellation noise (checks.py,
  # gradient_noise): where a gradient is 0 exactly (a row that sees one key,
  # a bias shared by all keys), both sides are rounding of D = rowsum(dO * O),
  # whose O is stored in the input dtype. About 4x that dtype's rounding.
  grad_noise: float


# Per operand dtype; the reference is float32 (docs/testing.md).
TOLERANCE = {
    jnp.float32: Tolerance(out=1e-4, lse=1e-5, grad=2e-4, grad_noise=2e-5),
    jnp.float16: Tolerance(out=5e-3, lse=1e-3, grad=1e-2, grad_noise=2e-3),
    jnp.bfloat16: Tolerance(out=1.5e-2, lse=1e-3, grad=3e-2, grad_noise=1e-2),
}


# Elementwise float32 bounds (atol, rtol) against jax.nn in float32 at precision
# "highest", as tokamax's attention test battery holds its kernels: values 1e-6 /
# 1e-6, gradients 2e-5 / 2e-6 (test_elementwise_float32 in test_attention.py).
ELEMENTWISE_F32 = {"out": (1e-6, 1e-6), "grad": (2e-5, 2e-6)}


@dataclasses.dataclass(frozen=True)
class Case:
  batch: int = 2
  q_len: int = 33
  kv_len: int = 47
  q_heads: int = 4
  kv_heads: int = 2
  head_dim: int = 64
  dtype: type = jnp.float32
  is_causal: bool = False
  window: tuple[int, int] | int | None = None   # an int: the same on both sides
  bias_shape: tuple[int, ...] | None = None   # symbolic: "B", "N", "T", "S" or 1
  mask_shape: tuple[int, ...] | None = None
  q_lengths: bool = False
  kv_lengths: bool = False
  # Masks out every key of one query row (through the boolean mask).
  fully_masked_row: bool = False
  scale: float | None = None
  # Packed sequences (q_segment_ids / kv_segment_ids), one of SEGMENT_KINDS.
  segments: str | None = None

  @property
  def id(self) -> str:
    parts = [f"b{self.batch}", f"t{self.q_len}", f"s{self.kv_len}",
             f"n{self.q_heads}k{self.kv_heads}", f"d{self.head_dim}",
             jnp.dtype(self.dtype).name]
    if self.is_causal: parts.append("causal")
    if self.window is not None: parts.append("win{}-{}".format(*window_sides(self.window)))
    if self.bias_shape: parts.append("bias" + "".join(map(str, self.bias_shape)))
    if self.mask_shape: parts.append("mask" + "".join(map(str, self.mask_shape)))
    if self.q_lengths: parts.append("qlen")
    if self.kv_lengths: parts.append("kvlen")
    if self.fully_masked_row: parts.append("deadrow")
    if self.scale is not None: parts.append(f"scale{self.scale}")
    if self.segments: parts.append(f"seg_{self.segments}")
    return "-".join(parts)

  def concrete(self, shape):
    sizes = {"B": self.batch, "N": self.q_heads, "T": self.q_len, "S": self.kv_len}
    return tuple(sizes.get(d, d) for d in shape)


@dataclasses.dataclass
class Inputs:
  q: jax.Array
  k: jax.Array
  v: jax.Array
  bias: jax.Array | None
  mask: jax.Array | None
  q_lengths: jax.Array | None
  kv_lengths: jax.Array | None
  cotangent: jax.Array      # random dO, zero on rows that see no key
  live_rows: np.ndarray     # bool [B, T, N]: the row sees at least one key
  q_segment_ids: jax.Array | None = None    # int32 [B, T]
  kv_segment_ids: jax.Array | None = None   # int32 [B, S]

  def kwargs(self, case: Case):
    """Keyword arguments of jax_fatrain.dot_product_attention."""
    kw = dict(bias=self.bias, mask=self.mask, scale=case.scale,
              is_causal=case.is_causal, query_seq_lengths=self.q_lengths,
              key_value_seq_lengths=self.kv_lengths,
              local_window_size=case.window)
    if self.q_segment_ids is not None:
      kw.update(q_segment_ids=self.q_segment_ids, kv_segment_ids=self.kv_segment_ids)
    return kw


# Segment-id layouts of packed sequences (Case.segments):
#   sorted    documents of random lengths one after another (ids 0, 1, ...),
#             crossing tile boundaries; with T != S the keys are split into
#             as many documents of other lengths (cross attention of packs)
#   unsorted  ids drawn at random from {0, 1, 2} for every token
#   one       a single segment: the same as no segment ids
#   each      every token its own segment (query i sees key i only)
#   padding   sorted documents, then a tail of padding whose query id (-1)
#             differs from its key id (-2): those query rows see no key
SEGMENT_KINDS = ("sorted", "unsorted", "one", "each", "padding")


def _sorted_ids(rng, length: int, documents: int) -> np.ndarray:
  """Ids 0..documents-1, each a contiguous run of random (>= 1) length."""
  documents = min(documents, length)
  cuts = np.sort(rng.choice(np.arange(1, length), documents - 1, replace=False))
  ids = np.zeros(length, np.int32)
  ids[cuts] = 1
  return np.cumsum(ids).astype(np.int32)


def segment_ids(kind: str, rng, batch: int, t: int, s: int):
  """(q_segment_ids [B, T], kv_segment_ids [B, S]) as numpy int32."""
  q, kv = np.zeros((batch, t), np.int32), np.zeros((batch, s), np.int32)
  for b in range(batch):
    if kind == "sorted":
      docs = int(rng.integers(2, 6))
      q[b], kv[b] = _sorted_ids(rng, t, docs), _sorted_ids(rng, s, docs)
      if t == s:
        kv[b] = q[b]   # self attention of a pack
    elif kind == "unsorted":
      q[b], kv[b] = rng.integers(0, 3, t), rng.integers(0, 3, s)
    elif kind == "one":
      pass
    elif kind == "each":
      q[b], kv[b] = np.arange(t), np.arange(s)
    elif kind == "padding":
      docs = int(rng.integers(2, 4))
      tq, ts = max(1, t - t // 4 - b), max(1, s - s // 4 - b)
      q[b, :tq], kv[b, :ts] = _sorted_ids(rng, tq, docs), _sorted_ids(rng, ts, docs)
      if t == s:
        kv[b, :ts] = q[b, :tq]
      q[b, tq:], kv[b, ts:] = -1, -2
    else:
      raise ValueError(f"unknown segment kind {kind!r}")
  return q, kv


def jax_nn_kwargs(kwargs: dict) -> dict:
  """``kwargs`` for jax.nn.dot_product_attention: segment ids become the
  equivalent boolean mask [B, 1, T, S], combined with any mask given."""
  kwargs = dict(kwargs)
  q_seg, kv_seg = kwargs.pop("q_segment_ids", None), kwargs.pop("kv_segment_ids", None)
  if q_seg is not None:
    same = (q_seg[:, :, None] == kv_seg[:, None, :])[:, None]
    mask = kwargs.get("mask")
    kwargs["mask"] = same if mask is None else same & mask
  return kwargs


def make_inputs(case: Case, seed: int) -> Inputs:
  """Fresh random inputs (never zeros) for one case."""
  rng = np.random.default_rng(seed)
  b, t, s, n, kh, h = (case.batch, case.q_len, case.kv_len, case.q_heads,
                       case.kv_heads, case.head_dim)

  def normal(*shape):
    return rng.standard_normal(shape).astype(np.float32)

  q = jnp.asarray(normal(b, t, n, h), case.dtype)
  k = jnp.asarray(normal(b, s, kh, h), case.dtype)
  v = jnp.asarray(normal(b, s, kh, h), case.dtype)
  bias = None
  if case.bias_shape is not None:
    bias = jnp.asarray(normal(*case.concrete(case.bias_shape)), case.dtype)
  mask_np = None
  if case.mask_shape is not None:
    mask_np = rng.random(case.concrete(case.mask_shape)) < 0.7
  if case.fully_masked_row:
    full = np.ones((b, n, t, s), bool) if mask_np is None else np.broadcast_to(
        mask_np, (b, n, t, s)).copy()
    full[b - 1, n - 1, t // 2, :] = False
    mask_np = full
  mask = None if mask_np is None else jnp.asarray(mask_np)
  q_lengths = kv_lengths = None
  if case.q_lengths:
    q_lengths = jnp.asarray(rng.integers(1, t + 1, size=b), jnp.int32)
  if case.kv_lengths:
    kv_lengths = jnp.asarray(rng.integers(1, s + 1, size=b), jnp.int32)
  segments = None
  if case.segments is not None:
    segments = segment_ids(case.segments, rng, b, t, s)

  visible = visibility(case, mask_np, q_lengths, kv_lengths, segments)   # [B, N, T, S]
  live_rows = visible.any(-1).transpose(0, 2, 1)                # [B, T, N]
  cotangent = normal(b, t, n, h) * live_rows[..., None]
  q_seg, kv_seg = (None, None) if segments is None else (jnp.asarray(x) for x in segments)
  return Inputs(q, k, v, bias, mask, q_lengths, kv_lengths,
                jnp.asarray(cotangent, case.dtype), live_rows, q_seg, kv_seg)


def window_sides(window) -> tuple[int, int]:
  """(left, right) of a local_window_size: an int means both sides."""
  return (window, window) if isinstance(window, int) else tuple(window)


def visibility(case: Case, mask_np, q_lengths, kv_lengths, segments=None) -> np.ndarray:
  b, t, s, n = case.batch, case.q_len, case.kv_len, case.q_heads
  i = np.arange(t)[:, None]
  j = np.arange(s)[None, :]
  vis = np.ones((b, n, t, s), bool)
  if mask_np is not None:
    vis &= np.broadcast_to(mask_np, vis.shape)
  if case.is_causal:
    vis &= (j <= i)[None, None]
  if case.window is not None:
    left, right = window_sides(case.window)
    vis &= ((j >= i - left) & (j <= i + right))[None, None]
  if q_lengths is not None:
    vis &= (np.arange(t)[None, :] < np.asarray(q_lengths)[:, None])[:, None, :, None]
  if kv_lengths is not None:
    vis &= (np.arange(s)[None, :] < np.asarray(kv_lengths)[:, None])[:, None, None, :]
  if segments is not None:
    q_seg, kv_seg = segments
    vis &= (q_seg[:, :, None] == kv_seg[:, None, :])[:, None]
  return vis


def reference(case: Case, x: Inputs):
  """(out, lse [B, T, N]) from jax.nn in float32."""
  up = lambda a: None if a is None else a.astype(jnp.float32)
  return jax.nn.dot_product_attention(
      up(x.q), up(x.k), up(x.v), implementation="xla", return_residual=True,
      **jax_nn_kwargs({**x.kwargs(case), "bias": up(x.bias)}))


def relative_error(got, want, rows=None, norm=None) -> float:
  """‖got − want‖ / ‖want‖ (over ``rows``), or / ``norm`` when given."""
  got = np.asarray(got, np.float64)
  want = np.asarray(want, np.float64)
  if rows is not None:
    got, want = got[rows], want[rows]
  denom = np.linalg.norm(want) if norm is None else norm
  return float(np.linalg.norm(got - want) / (denom if denom > 0 else 1.0))
