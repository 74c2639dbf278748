"""Public entry points and the trace-time checks of their arguments."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jax_fatrain import _op, _registry
from jax_fatrain._config import AttentionConfig

_FLOAT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def _dtype_names(dtypes) -> str:
  return ", ".join(str(d) for d in dtypes)


def _as_array(name: str, x):
  # jnp.asarray raises TypeError for most non-arrays but ValueError for some
  # (None, ragged nested lists): both are the caller passing a non-array.
  try:
    return jnp.asarray(x)
  except (TypeError, ValueError) as e:
    raise TypeError(f"{name} must be an array, got {type(x).__name__}") from e


def _expand_to_rank4(name: str, x, what: str):
  if x.ndim > 4:
    raise ValueError(f"{name} must have rank <= 4 ({what}), got shape {x.shape}")
  return x.reshape((1,) * (4 - x.ndim) + x.shape)


def _check_score_operand(name: str, x, full: tuple[int, int, int, int], labels: str):
  """bias/mask: rank 4 after expansion, each dim 1 or the full extent."""
  for axis, (got, want) in enumerate(zip(x.shape, full)):
    if got not in (1, want):
      raise ValueError(
          f"{name} of shape {x.shape} does not broadcast to "
          f"[{labels}] = {list(full)}: dimension {axis} ({labels.split(', ')[axis]}) "
          f"is {got}, expected 1 or {want}")


def _check_lengths(name: str, x, batch: int):
  if x is None:
    return None
  x = _as_array(name, x)
  if x.dtype != jnp.int32:
    raise TypeError(f"{name} must be int32, got {x.dtype}")
  if x.shape != (batch,):
    raise ValueError(f"{name} must have shape ({batch},) (one length per batch "
                     f"element), got {x.shape}")
  return x


def _check_segment_ids(q_segment_ids, kv_segment_ids, batch: int, q_len: int,
                       kv_len: int, unbatched: bool = False):
  """Packed sequences: int32 ``[B, T]`` and ``[B, S]`` ids, both or neither.

  With ``unbatched`` (a rank-3 query) the ids may be ``[T]`` and ``[S]``.
  Returns the pair canonicalised to rank 2, or ``(None, None)``.
  """
  if (q_segment_ids is None) != (kv_segment_ids is None):
    given, missing = (("q_segment_ids", "kv_segment_ids") if kv_segment_ids is None
                      else ("kv_segment_ids", "q_segment_ids"))
    raise ValueError(f"{given} was given without {missing}: pass both (queries attend "
                     "only to keys with an equal segment id) or neither")
  if q_segment_ids is None:
    return None, None
  out = []
  for name, x, length, label in (("q_segment_ids", q_segment_ids, q_len, "T"),
                                 ("kv_segment_ids", kv_segment_ids, kv_len, "S")):
    x = _as_array(name, x)
    if x.dtype != jnp.int32:
      raise TypeError(f"{name} must be int32, got {x.dtype}")
    if unbatched and x.ndim == 1:
      x = x[None]
    want = (batch, length)
    if x.shape != want:
      shape = f"[{label}] or [B, {label}]" if unbatched else f"[B, {label}]"
      raise ValueError(f"{name} must have shape {shape} = {list(want)}, got {x.shape}")
    out.append(x)
  return tuple(out)


def _flag(name: str, value) -> bool:
  """A boolean known at trace time: True/False (also NumPy's, or the ints 0 and
  1). Anything else, a string such as "no" or an array or tracer, is refused
  rather than read by its truth value."""
  if isinstance(value, (bool, np.bool_)):
    return bool(value)
  if isinstance(value, (int, np.integer)) and value in (0, 1):
    return bool(value)
  got = type(value).__name__
  if isinstance(value, (str, int, float)):
    got += f" {value!r}"
  raise TypeError(f"{name} must be a bool known at trace time (True or False), got {got}")


def _window(local_window_size, limit: int) -> tuple[int, int]:
  """(left, right), -1 for an unbounded side.

  A side of at least ``limit`` (T + S) hides no key, so it is unbounded:
  the kernels then need not represent it (the Metal ABI holds 32-bit
  windows, the FFI attributes 64-bit ones).
  """
  if local_window_size is None:
    return -1, -1
  if isinstance(local_window_size, (int, np.integer)) and not isinstance(
      local_window_size, bool):
    left = right = int(local_window_size)
  elif (isinstance(local_window_size, (tuple, list)) and len(local_window_size) == 2
        and all(isinstance(w, (int, np.integer)) and not isinstance(w, bool)
                for w in local_window_size)):
    left, right = (int(w) for w in local_window_size)
  else:
    raise TypeError("local_window_size must be None, an int or a (left, right) "
                    f"pair of ints, got {local_window_size!r}")
  if left < 0 or right < 0:
    raise ValueError(f"local_window_size must be non-negative, got {local_window_size!r}")
  return (-1 if left >= limit else left), (-1 if right >= limit else right)


def _scale(scale, head_dim: int) -> float:
  if scale is None:
    return 1.0 / math.sqrt(head_dim)
  try:
    value = float(scale)
  except (TypeError, ValueError, jax.errors.ConcretizationTypeError) as e:
    # ValueError: a string that is no number.
    raise TypeError("scale must be a Python or NumPy number known at trace time, "
                    f"got {type(scale).__name__}") from e
  # The kernels take the scale as float32: a larger value would become inf.
  if not math.isfinite(value) or abs(value) > float(np.finfo(np.float32).max):
    raise ValueError(f"scale must be finite in float32, got {value}")
  return value


def _prepare(q, k, v, bias, mask, q_lengths, kv_lengths, *, layout: str,
             implementation, q_name="query", k_name="key", v_name="value",
             bias_name="bias", mask_name="mask"):
  """Checks operands in `layout` (rank 4) and returns them canonicalised."""
  q, k, v = (_as_array(n, x) for n, x in ((q_name, q), (k_name, k), (v_name, v)))
  impl = _registry.resolve_implementation(implementation, q.dtype,
                                          q.shape[-1] if q.ndim else None)
  dims = "[B, T, N, H]" if layout == "BTNH" else "[B, N, T, H]"
  kv_dims = "[B, S, K, H]" if layout == "BTNH" else "[B, K, S, H]"
  for name, x, want in ((q_name, q, dims), (k_name, k, kv_dims), (v_name, v, kv_dims)):
    if x.ndim != 4:
      raise ValueError(f"{name} must have rank 4 {want}, got shape {x.shape}")
  if q.dtype not in _FLOAT_DTYPES:
    raise TypeError(f"{q_name} dtype must be one of {_dtype_names(_FLOAT_DTYPES)}, "
                    f"got {q.dtype}")
  for name, x in ((k_name, k), (v_name, v)):
    if x.dtype != q.dtype:
      raise TypeError(f"{name} dtype must equal {q_name}'s ({q.dtype}), got {x.dtype}")
  if v.shape != k.shape:
    raise ValueError(f"{v_name} shape must equal {k_name}'s {k.shape}, got {v.shape}")
  seq_axis, head_axis = (1, 2) if layout == "BTNH" else (2, 1)
  batch, head_dim = q.shape[0], q.shape[3]
  t, n = q.shape[seq_axis], q.shape[head_axis]
  s, kh = k.shape[seq_axis], k.shape[head_axis]
  if k.shape[0] != batch:
    raise ValueError(f"{k_name} batch size must equal {q_name}'s ({batch}), "
                     f"got {k.shape[0]} ({k_name} shape {k.shape})")
  if k.shape[3] != head_dim:
    raise ValueError(f"{k_name} head_dim must equal {q_name}'s ({head_dim}), "
                     f"got {k.shape[3]} ({k_name} shape {k.shape})")
  for name, size in (("batch size", batch), ("query length", t), ("query heads", n),
                     ("key length", s), ("key/value heads", kh), ("head_dim", head_dim)):
    if size == 0:
      raise ValueError(f"{name} must be > 0, got 0 ({q_name} {q.shape}, {k_name} {k.shape})")
  if n % kh != 0:
    raise ValueError(f"the number of query heads ({n}) must be a multiple of the "
                     f"number of key/value heads ({kh})")
  if impl.max_head_dim is not None and head_dim > impl.max_head_dim:
    raise ValueError(f"head_dim must be <= {impl.max_head_dim} for implementation "
                     f"{impl.name!r}, got {head_dim}")
  full = (batch, n, t, s)
  if bias is not None:
    bias = _expand_to_rank4(bias_name, _as_array(bias_name, bias), "broadcastable to [B, N, T, S]")
    if bias.dtype not in _FLOAT_DTYPES:
      raise TypeError(f"{bias_name} dtype must be one of {_dtype_names(_FLOAT_DTYPES)}, "
                      f"got {bias.dtype}")
    _check_score_operand(bias_name, bias, full, "B, N, T, S")
  if mask is not None:
    mask = _expand_to_rank4(mask_name, _as_array(mask_name, mask), "broadcastable to [B, N, T, S]")
    if mask.dtype != jnp.bool_:
      raise TypeError(f"{mask_name} must be a boolean array (True = attend); pass "
                      f"additive masks as bias. Got dtype {mask.dtype}")
    _check_score_operand(mask_name, mask, full, "B, N, T, S")
  q_lengths = _check_lengths("query_seq_lengths", q_lengths, batch)
  kv_lengths = _check_lengths("key_value_seq_lengths", kv_lengths, batch)
  return q, k, v, bias, mask, q_lengths, kv_lengths, impl


def dot_product_attention(query, key, value, bias=None, mask=None, *, scale=None,
                          is_causal=False, query_seq_lengths=None,
                          key_value_seq_lengths=None, local_window_size=None,
                          implementation=None, return_residual=False,
                          q_segment_ids=None, kv_segment_ids=None, deterministic=False):
  """FlashAttention-2 attention with ``jax.nn.dot_product_attention``'s API.

  Arguments mean exactly what they mean for ``jax.nn.dot_product_attention``:
  ``query`` ``[B, T, N, H]`` (or ``[T, N, H]``), ``key``/``value``
  ``[B, S, K, H]`` with ``N % K == 0`` (GQA: query head n uses key/value head
  ``n // (N // K)``), ``bias`` additive and ``mask`` boolean (True = attend),
  both broadcastable to ``[B, N, T, S]`` without being materialised,
  top-left causal masking, ``query_seq_lengths`` / ``key_value_seq_lengths``
  (int32 ``[B]``) padding, and ``local_window_size`` ``(left, right)`` (an
  int means both sides).

  ``q_segment_ids`` ``[B, T]`` and ``kv_segment_ids`` ``[B, S]`` (int32,
  keyword-only, both or neither; not in ``jax.nn``) describe packed
  sequences: query i attends to key j only where their ids are equal, on
  top of every other mask. The ids are compared tile by tile inside the
  kernels (never materialised as a ``[T, S]`` mask), and key tiles that share
  no id with a query tile are skipped; sorted ids (documents laid out one
  after another) skip the most. They get no gradient.

  ``implementation``: ``None`` (the best one for the default backend:
  ``"cuda"`` on an NVIDIA GPU where the CUDA extension is built, for
  bfloat16/float16 at head dims 64, 128 and 256, ``"metal"``
  on a Mac where the Metal extension is, ``"cpu"`` on CPU, ``"xla"``
  elsewhere), or one by name: ``"cpu"`` (C++ kernels through XLA FFI),
  ``"cuda"``, ``"metal"``, ``"metal_emulated"`` or ``"xla"`` (a pure-JAX
  blockwise version of the same math, any platform).
  :func:`available_implementations` lists those this installation has.

  ``deterministic`` (keyword-only, not in ``jax.nn``): gradients bitwise
  reproducible from run to run. The ``cpu``, ``metal``, ``metal_emulated``
  and ``xla`` implementations always are; the ``cuda`` backward by default
  adds dQ with float32 atomics, whose order (and so the last bits) may vary
  between runs, and with ``deterministic=True`` computes dQ in a kernel of
  its own instead, somewhat slower.

  Differences from ``jax.nn``: a query row that sees no key at all (fully
  masked) gives 0 and a logsumexp of -inf (``jax.nn``'s XLA path gives the
  mean of ``value``), and its gradients are 0. With ``return_residual=True``
  the logsumexp ``[B, T, N]`` is float32 (``jax.nn`` casts it to the input
  dtype); like ``jax.nn`` it is returned under ``stop_gradient``.
  """
  q, k, v = (_as_array(n, x) for n, x in (("query", query), ("key", key), ("value", value)))
  output_shape = q.shape
  unbatched = len(output_shape) == 3
  if unbatched:
    if k.ndim != 3 or v.ndim != 3:
      raise ValueError("an unbatched query [T, N, H] needs unbatched key and value "
                       f"[S, K, H], got key {k.shape} and value {v.shape}")
    q, k, v = q[None], k[None], v[None]
  q, k, v, bias, mask, q_lengths, kv_lengths, impl = _prepare(
      q, k, v, bias, mask, query_seq_lengths, key_value_seq_lengths,
      layout="BTNH", implementation=implementation)
  q_seg, kv_seg = _check_segment_ids(q_segment_ids, kv_segment_ids, q.shape[0],
                                     q.shape[1], k.shape[1], unbatched=unbatched)
  left, right = _window(local_window_size, limit=q.shape[1] + k.shape[1])
  return_residual = _flag("return_residual", return_residual)
  config = AttentionConfig(scale=_scale(scale, q.shape[-1]),
                           is_causal=_flag("is_causal", is_causal),
                           window_left=left, window_right=right, layout="BTNH",
                           deterministic=_flag("deterministic", deterministic))
  out, lse = _op.attention(q, k, v, bias, mask, q_lengths, kv_lengths, config, impl,
                           q_seg, kv_seg)
  if unbatched:
    out, lse = out[0], lse[0]
  out = out.reshape(output_shape)
  if not return_residual:
    return out
  # [.., N, T] -> [.., T, N], jax.nn's residual layout.
  return out, jax.lax.stop_gradient(jnp.swapaxes(lse, -1, -2))


def _bhld_config(q, scale, causal, deterministic=False) -> AttentionConfig:
  return AttentionConfig(scale=_scale(scale, q.shape[-1]), is_causal=_flag("causal", causal),
                         layout="BNTH", deterministic=_flag("deterministic", deterministic))


def _split_bhld_mask(mask):
  """The ``[B, H, L, D]`` pair's `mask` is additive when floating point, boolean otherwise."""
  if mask is None:
    return None, None
  mask = _as_array("mask", mask)
  if mask.dtype == jnp.bool_:
    return None, mask
  return mask, None


def _prepare_bhld(q, k, v, mask, implementation, q_segment_ids, kv_segment_ids):
  """The checks and operands both ``[B, H, L, D]`` stages share:
  (q, k, v, bias, bool_mask, q_segment_ids, kv_segment_ids, implementation)."""
  bias, bool_mask = _split_bhld_mask(mask)
  q, k, v, bias, bool_mask, _, _, impl = _prepare(
      q, k, v, bias, bool_mask, None, None, layout="BNTH",
      implementation=implementation, q_name="q", k_name="k", v_name="v",
      bias_name="mask", mask_name="mask")
  q_seg, kv_seg = _check_segment_ids(q_segment_ids, kv_segment_ids, q.shape[0],
                                     q.shape[2], k.shape[2])
  return q, k, v, bias, bool_mask, q_seg, kv_seg, impl


def flash_attn_train_fwd(q, k, v, mask=None, *, scale, causal, implementation=None,
                         q_segment_ids=None, kv_segment_ids=None):
  """The forward in the ``[B, H, L, D]`` layout of mlx_native's ``flash_attn_train.rs``:
  returns ``(o, lse)``.

  ``mask`` is additive (floating point) or boolean (True = attend), shaped
  ``[B, H_q, qL, kL]`` or broadcastable to it; ``lse`` is float32
  ``[B, H_q, qL]`` in natural log. ``q_segment_ids`` ``[B, qL]`` and
  ``kv_segment_ids`` ``[B, kL]`` (int32, both or neither) restrict attention
  to equal ids, as in :func:`dot_product_attention`. Not differentiable
  itself: pair it with :func:`flash_attn_train_bwd` (or use
  :func:`dot_product_attention`).
  """
  q, k, v, bias, bool_mask, q_seg, kv_seg, impl = _prepare_bhld(
      q, k, v, mask, implementation, q_segment_ids, kv_segment_ids)
  config = _bhld_config(q, scale, causal)
  return _op.stage(impl, "forward", config)(q, k, v, bias, bool_mask, None, None,
                                            q_seg, kv_seg)


def flash_attn_train_bwd(q, k, v, o, lse, do, mask=None, *, scale, causal,
                         implementation=None, q_segment_ids=None, kv_segment_ids=None,
                         deterministic=False):
  """The backward in the ``[B, H, L, D]`` layout: returns ``(dq, dk, dv)``.

  Takes the forward's ``mask`` and segment ids (the same ones).
  ``deterministic``: as in :func:`dot_product_attention`.
  """
  q, k, v, bias, bool_mask, q_seg, kv_seg, impl = _prepare_bhld(
      q, k, v, mask, implementation, q_segment_ids, kv_segment_ids)
  o, do = _as_array("o", o), _as_array("do", do)
  for name, x in (("o", o), ("do", do)):
    if x.shape != q.shape or x.dtype != q.dtype:
      raise ValueError(f"{name} must have q's shape {q.shape} and dtype {q.dtype}, "
                       f"got {x.shape} {x.dtype}")
  lse = _as_array("lse", lse)
  want = (q.shape[0], q.shape[1], q.shape[2])
  if lse.shape != want or lse.dtype != jnp.float32:
    raise ValueError(f"lse must be float32 {list(want)} ([B, H_q, qL]), got "
                     f"{lse.dtype} {list(lse.shape)}")
  config = _bhld_config(q, scale, causal, deterministic)
  return _op.stage(impl, "backward", config)(
      q, k, v, bias, bool_mask, None, None, o, lse, do, q_seg, kv_seg)
