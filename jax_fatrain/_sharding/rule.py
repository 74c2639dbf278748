"""The Shardy sharding rule of a stage: an einsum-like string relating the dims
of q/k/v/bias/mask/lengths/segment ids to those of o/lse (or dq/dk/dv, or
dbias), built per call from the operand shapes, so that shardings propagate
through the op in both directions."""

from __future__ import annotations

from jax_fatrain._sharding.operands import BIAS, expand, operand_roles


def sharding_rule(stage, config, present, shapes):
  full = expand(present, shapes)
  q, k = full[0], full[1]
  seq, head = config.seq_axis, config.head_axis
  n, kh = q[head], k[head]
  g = n // kh
  # Query and kv heads are separate factors on purpose: a compound "(k g)"
  # makes Shardy split a mesh axis into sub-axes when K is not divisible by
  # it, which the partition callback cannot decode. The callback enforces the
  # GQA relation itself (see _make_plan).
  heads = "n"
  kv_heads = "n" if g == 1 else "k"

  def layout(b, s, h):
    dims = [b, None, None, "h"]
    dims[seq], dims[head] = s, h
    return " ".join(dims)

  q_map = layout("b", "t", heads)
  kv_map = layout("b", "s", kv_heads)
  lse_map = f"b {heads} t"
  unique = iter(f"u{i}" for i in range(64))

  def score_map(shape):
    names = ("b", heads, "t", "s")
    return " ".join(nm if d != 1 or f == 1 else next(unique)
                    for nm, d, f in zip(names, shape, (q[0], n, q[seq], k[seq])))

  maps = []
  bias_map = None
  roles = operand_roles(len(full))
  for i, x in enumerate(full):
    if x is None:
      continue
    role = roles[i]
    if role == "qseg":
      maps.append("b t")
    elif role == "kvseg":
      maps.append("b s")
    elif role == "q":
      maps.append(q_map)
    elif role == "kv":
      maps.append(kv_map)
    elif role == "lse":
      maps.append(lse_map)
    elif role == "len":
      maps.append("b")
    else:
      m = score_map(x)
      if i == BIAS:
        bias_map = m
      maps.append(m)
  if stage == "forward":
    results = f"{q_map}, {lse_map}"
  elif stage == "backward":
    results = f"{q_map}, {kv_map}, {kv_map}"
  else:
    results = bias_map
  kwargs = {}
  if stage == "bias_grad":
    used = set(results.split())
    # Factors that vanish in dbias (in order of appearance: Shardy wants the
    # special factors sorted by index).
    kwargs["reduction_factors"] = tuple(dict.fromkeys(
        f for f in " ".join(maps).replace(",", " ").split() if f not in used))
  return f"{', '.join(maps)} -> {results}", kwargs
