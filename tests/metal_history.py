"""Earlier versions of our Metal kernels, run by the MSL emulator for comparison.

The kernels before anything was staged in threadgroup memory (UNSTAGED below:
the forward and dQ read K and V, the dK/dV kernel Q and dO, from device memory
in every simdgroup) and, optionally, the dK/dV kernel between its staging and
its vectorised coalesced loads (DKDV_SCALAR_STAGED) are taken from this
repository's history with ``git show`` into a
temporary directory, built as standalone emulator libraries
(jax_fatrain.emulator.msl_standalone) and dispatched the way the dispatch plan of
their revision did (cpp/metal/plan/plan.cc there): the 160-byte AttnParams at
buffer 4, Q0 K1 V2 O3 L8 dO12 Delta13 dQ14 dK15 dV16, function constants
200/201 (aligned tiles) and 300-304 (mask, causal, window, lengths), grid
(ceil(length / tile), heads, batch), threadgroup (32, simdgroups, 1).
"""

from __future__ import annotations

import ctypes
import math
import subprocess
from pathlib import Path

import ml_dtypes
import numpy as np

from jax_fatrain.emulator import msl_standalone

ROOT = Path(__file__).resolve().parent.parent

# Revisions and the tiles their dispatch plans used for bfloat16 (flash_attn_abi.h
# there: fwd_block_q 32, fwd_block_k 16, bwd_block_q 32, bwd_block_kv 32,
# kSimdgroups 4; at DKDV_SCALAR_STAGED the dK/dV kernel runs 8 simdgroups of
# 8 keys x 64 columns, bwd_block_kv = 4096 / D and bwd_dkdv_block_q 16 at
# D = 64, else 8).
UNSTAGED = "9210a2f33ab7ab67eeca8e7aacbf52dcec364465"
# The parent of the dK/dV kernel's vectorised, coalesced loads.
DKDV_SCALAR_STAGED = "f8f2b8f6f295b13fd85661cc4de149909bc3354a^"


def available(commit: str) -> bool:
  """Whether the commit is in this checkout's history (not in a shallow clone)."""
  try:
    r = subprocess.run(["git", "rev-parse", "--verify", "--quiet", commit + "^{commit}"],
                       cwd=ROOT, capture_output=True, text=True)
  except OSError:
    return False
  return r.returncode == 0


def checkout_kernels(commit: str, dest: Path) -> Path:
  """jax_fatrain/metal/*.h and *.metal of ``commit`` written into dest/<commit>."""
  out = Path(dest) / commit.replace("^", "_parent")
  out.mkdir(parents=True, exist_ok=True)
  names = subprocess.run(["git", "ls-tree", "--name-only", commit, "jax_fatrain/metal/"],
                         cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
  for name in names:
    if name.endswith((".h", ".metal")):
      text = subprocess.run(["git", "show", f"{commit}:{name}"], cwd=ROOT, capture_output=True,
                            check=True).stdout
      (out / Path(name).name).write_bytes(text)
  return out


class _Params(ctypes.Structure):
  _fields_ = ([(n, ctypes.c_int) for n in ("b", "h", "d", "ql", "kl", "gqa_factor")]
              + [("scale", ctypes.c_float), ("softcapping", ctypes.c_float)]
              + [(n, ctypes.c_int) for n in ("nq", "nk", "nq_aligned", "nk_aligned", "ql_rem",
                                              "kl_rem", "ql_off", "pad_")]
              + [(n, ctypes.c_int64 * 3) for n in ("q", "k", "v", "o")])


assert ctypes.sizeof(_Params) == 160


def _params(batch: int, heads: int, length: int, head_dim: int) -> bytes:
  bq, bk = 32, 16  # make_params: the forward's tiles
  p = _Params(batch, heads, head_dim, length, length, 1, 1.0 / math.sqrt(head_dim), 1.0,
              -(-length // bq), -(-length // bk), length // bq, length // bk, length % bq,
              length % bk, 0, 0)
  for f in ("q", "k", "v", "o"):
    getattr(p, f)[:] = (heads * length * head_dim, length * head_dim, head_dim)
  return bytes(p)


def run_unstaged(tmp: Path, *, seq_len: int, head_dim: int, heads: int = 1, batch: int = 1,
                 causal: bool = False, sample=None,
                 dkdv_commit: str = UNSTAGED) -> dict[str, dict]:
  """{"fwd", "dq", "dkdv": dispatch record} of the earlier kernels (bfloat16);
  the dK/dV kernel of ``dkdv_commit`` (UNSTAGED or DKDV_SCALAR_STAGED)."""
  rng = np.random.default_rng(0)
  shape = (batch, heads, seq_len, head_dim)
  rand = lambda: rng.standard_normal(shape, np.float32).astype(ml_dtypes.bfloat16)
  q, k, v, o, d_o = rand(), rand(), rand(), rand(), rand()
  rows = lambda: rng.standard_normal((batch, heads, seq_len), np.float32)
  lse, delta = rows(), rows()
  params = _params(batch, heads, seq_len, head_dim)
  out = {}

  def dispatch(commit, source, op, buffers, tile, simdgroups, align_q, align_k):
    name = f"flash_attn_train_{op}_bf16_d{head_dim}"
    # These kernels predate the full-unroll directives; they are built to be
    # counted, never to run on a Mac.
    lib = msl_standalone.build_library(checkout_kernels(commit, tmp) / source, kernels=[name],
                                        skip_rules=("unroll",))
    constants = {200: align_q, 201: align_k, 300: False, 301: causal, 302: False, 303: False,
                 304: False}
    buffers = {**buffers, 4: params}
    return lib.dispatch(name, buffers=buffers, constants=constants,
                        grid=(-(-seq_len // tile), heads, batch), threadgroup=(32, simdgroups, 1),
                        count=True, sample=sample)

  out["fwd"] = dispatch(UNSTAGED, "flash_attn_train_fwd.metal", "fwd",
                        {0: q, 1: k, 2: v, 3: np.zeros_like(q), 8: np.zeros_like(lse)}, 32, 4,
                        seq_len % 32 == 0, seq_len % 16 == 0)
  out["dq"] = dispatch(UNSTAGED, "flash_attn_train_bwd.metal", "bwd_dq",
                       {0: q, 1: k, 2: v, 8: lse, 12: d_o, 13: delta, 14: np.zeros_like(q)}, 32,
                       4, seq_len % 32 == 0, seq_len % 32 == 0)
  if dkdv_commit == UNSTAGED:
    bkv, bq, simdgroups = 32, 32, 4
  else:
    bkv, bq, simdgroups = 4096 // head_dim, (16 if head_dim == 64 else 8), 8
  out["dkdv"] = dispatch(dkdv_commit, "flash_attn_train_bwd.metal", "bwd_dkdv",
                         {0: q, 1: k, 2: v, 8: lse, 12: d_o, 13: delta, 15: np.zeros_like(k),
                          16: np.zeros_like(v)}, bkv, simdgroups, seq_len % bq == 0,
                         seq_len % bkv == 0)
  return out
