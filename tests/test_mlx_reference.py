"""MLX's steel attention forward, unmodified, through the MSL emulator.

The kernel comes from the pinned mlx-metal wheel (downloaded once per cache);
these tests skip only when that download is impossible. The emulator language
features it relies on are also tested without it
(tests/metal_emulator/msl_language_features.metal).
"""

from __future__ import annotations

import zlib
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jax_fatrain.emulator import mlx_reference as mlx_ref
from jax_fatrain.emulator import msl_standalone

ROOT = Path(__file__).resolve().parent.parent
FEATURES = ROOT / "tests" / "metal_emulator" / "msl_language_features.metal"

DTYPES = {"float32": np.dtype(np.float32), "float16": np.dtype(np.float16),
          "bfloat16": np.dtype(ml_dtypes.bfloat16)}
# Relative error against the float32 reference (docs/testing.md).
TOLERANCE = {"float32": 1e-5, "float16": 2e-3, "bfloat16": 1e-2}


@pytest.fixture(scope="module")
def features_lib():
  return msl_standalone.build_library(FEATURES)


def test_vector_types_traits_literals_and_max_threads(features_lib):
  out = np.full(14, np.nan, np.float32)
  features_lib.dispatch("lang_vectors", buffers={0: out}, constants={}, grid=(1, 1, 1),
                        threadgroup=(32, 1, 1))
  expected = [5, -2, 3.5, 0, 8, 2, 20, 11, 1, 1, 7.5, 8, 65504, np.log2(np.e)]
  np.testing.assert_allclose(out, expected, rtol=1e-6)
  # [[kernel, max_total_threads_per_threadgroup(32)]] is enforced.
  with pytest.raises(msl_standalone.EmulatorError, match="max_total_threads_per_threadgroup"):
    features_lib.dispatch("lang_vectors", buffers={0: out}, constants={}, grid=(1, 1, 1),
                          threadgroup=(64, 1, 1))


def test_address_space_overloads_helper_attributes_and_simd(features_lib):
  out = np.full((32, 5), np.nan, np.float32)
  features_lib.dispatch("lang_simd", buffers={0: out}, constants={}, grid=(1, 1, 1),
                        threadgroup=(32, 1, 1))
  lane = np.arange(32, dtype=np.float32)
  np.testing.assert_array_equal(out[:, 0], (lane + 1) % 32)         # threadgroup overload
  np.testing.assert_array_equal(out[:, 1], 2 * lane)                 # thread overload
  np.testing.assert_array_equal(out[:, 2], np.cumsum(lane))          # simd_prefix_inclusive_sum
  np.testing.assert_array_equal(out[:, 3], np.where(lane >= 2, lane - 2, 100 + lane + 30))
  np.testing.assert_array_equal(out[:, 4], lane)                     # member overloads


def test_element_addresses_of_device_buffers_stay_checked_and_counted(features_lib):
  out = np.full(97, np.nan, np.float32)
  record = features_lib.dispatch("lang_element_address", buffers={0: out}, constants={},
                                 grid=(1, 1, 1), threadgroup=(32, 1, 1), count=True)
  lane = np.arange(32, dtype=np.float32)
  np.testing.assert_array_equal(out[:64:2], lane)
  np.testing.assert_array_equal(out[1:64:2], -lane)
  np.testing.assert_array_equal(out[64:96], 0.5)  # lanes overlap: each writes two floats
  assert record["device_bytes_written"] == 32 * 4 * 4
  # One float short: the last lane's second store is out of bounds.
  with pytest.raises(msl_standalone.EmulatorError, match="out-of-bounds"):
    features_lib.dispatch("lang_element_address", buffers={0: out[:96].copy()}, constants={},
                          grid=(1, 1, 1), threadgroup=(32, 1, 1))


def test_macro_generated_instantiations(features_lib):
  assert {"lang_scale_float32_x3", "lang_scale_bfloat16_x2"} <= set(features_lib.kernel_names)
  x = np.arange(8, dtype=np.float32)
  y = np.full(8, np.nan, np.float32)
  features_lib.dispatch("lang_scale_float32_x3", buffers={0: x, 1: y}, constants={},
                        grid=(1, 1, 1), threadgroup=(8, 1, 1))
  np.testing.assert_array_equal(y, 3 * x)
  xb = x.astype(ml_dtypes.bfloat16)
  yb = np.zeros(8, ml_dtypes.bfloat16)
  features_lib.dispatch("lang_scale_bfloat16_x2", buffers={0: xb, 1: yb}, constants={},
                        grid=(1, 1, 1), threadgroup=(8, 1, 1))
  np.testing.assert_array_equal(yb.astype(np.float32), 2 * x)


def test_a_wheel_with_another_hash_is_refused(tmp_path, monkeypatch):
  fake = tmp_path / mlx_ref.MLX_METAL_WHEEL
  fake.write_bytes(b"not the mlx-metal wheel")
  monkeypatch.setenv("JAX_FATRAIN_CACHE", str(tmp_path / "cache"))
  monkeypatch.setenv("JAX_FATRAIN_MLX_METAL_WHEEL", str(fake))
  with pytest.raises(mlx_ref.MlxUnavailable, match="SHA-256"):
    mlx_ref.fetch_mlx_kernels()


@pytest.fixture(scope="module")
def mlx_kernels():
  try:
    return mlx_ref.fetch_mlx_kernels()
  except mlx_ref.MlxUnavailable as e:
    pytest.skip(f"MLX's kernel headers are not available: {e}")


def _reference(q, k, v, scale, causal, mask):
  """jax.nn.dot_product_attention (XLA) on float32 inputs, MLX's [B, H, L, D] layout."""
  T, S = q.shape[2], k.shape[2]
  to_btnh = lambda x: jnp.asarray(x.astype(np.float32)).transpose(0, 2, 1, 3)
  bias = None
  bool_mask = None
  if mask is not None and mask.dtype == np.bool_:
    bool_mask = jnp.asarray(mask)
  elif mask is not None:
    bias = jnp.asarray(mask.astype(np.float32))
  is_causal = causal and T == S
  if causal and T != S:  # MLX's causal mask is aligned to the bottom-right corner
    bottom_right = np.arange(S)[None, :] <= np.arange(T)[:, None] + (S - T)
    bool_mask = bottom_right if bool_mask is None else jnp.logical_and(bool_mask, bottom_right)
  o = jax.nn.dot_product_attention(to_btnh(q), to_btnh(k), to_btnh(v), bias=bias,
                                   mask=bool_mask, scale=scale, is_causal=is_causal,
                                   implementation="xla")
  return np.asarray(o).transpose(0, 2, 1, 3)


# (dtype, D, H_q, H_kv, T, S, causal, mask): the lengths are not multiples of
# MLX's 32-row query tile or its key tile, except where a case says aligned.
CASES = [
    ("float32", 64, 2, 1, 100, 77, False, None),
    ("float32", 128, 1, 1, 64, 64, True, None),        # aligned, causal
    ("float16", 128, 2, 2, 100, 100, True, None),
    ("float16", 64, 2, 1, 77, 100, False, "bool"),
    ("bfloat16", 64, 2, 2, 77, 100, True, None),       # T < S: bottom-right causal
    ("bfloat16", 128, 2, 1, 100, 77, False, "bool"),
    ("bfloat16", 256, 1, 1, 70, 90, True, "additive"),  # D = 256: head dim split in two
]


@pytest.mark.parametrize("dtype,D,Hq,Hkv,T,S,causal,mask_kind", CASES,
                         ids=[f"{c[0]}-d{c[1]}-h{c[2]}x{c[3]}-t{c[4]}-s{c[5]}"
                              f"{'-causal' if c[6] else ''}{'-' + c[7] if c[7] else ''}"
                              for c in CASES])
def test_mlx_forward_matches_jax_nn(mlx_kernels, dtype, D, Hq, Hkv, T, S, causal, mask_kind):
  rng = np.random.default_rng(zlib.crc32(repr((dtype, D, T, S, causal, mask_kind)).encode()))
  dt = DTYPES[dtype]
  q = rng.standard_normal((2, Hq, T, D)).astype(dt)
  k = rng.standard_normal((2, Hkv, S, D)).astype(dt)
  v = rng.standard_normal((2, Hkv, S, D)).astype(dt)
  mask = None
  if mask_kind == "bool":  # per batch, broadcast over heads; every row keeps a key
    mask = rng.random((2, 1, T, S)) < 0.6
    mask[..., 0] = True
  elif mask_kind == "additive":  # per key, broadcast over batch and rows
    mask = rng.standard_normal((1, Hq, 1, S)).astype(dt)
  scale = D ** -0.5
  o, lse = mlx_ref.mlx_attention_forward(q, k, v, scale=scale, causal=causal, mask=mask,
                                         return_lse=True)
  assert o.dtype == dt and o.shape == q.shape
  ref = _reference(q, k, v, scale, causal, mask)
  got = o.astype(np.float32)
  assert np.isfinite(got).all()
  err = np.linalg.norm(got - ref) / np.linalg.norm(ref)
  assert err < TOLERANCE[dtype], f"relative error {err:.2e}"
  # MLX's logsumexp output (natural log) against the reference's.
  s = np.einsum("bhtd,bhsd->bhts", q.astype(np.float64),
                np.repeat(k.astype(np.float64), Hq // Hkv, axis=1)) * scale
  keep = np.ones((T, S), bool)
  if causal:
    keep = np.arange(S)[None, :] <= np.arange(T)[:, None] + (S - T)
  if mask is not None and mask.dtype == np.bool_:
    keep = keep & mask
  elif mask is not None:
    s = s + mask.astype(np.float64)
  s = np.where(keep, s, -np.inf)
  mx = s.max(-1)
  ref_lse = mx + np.log(np.exp(s - mx[..., None]).sum(-1))
  np.testing.assert_allclose(lse, ref_lse, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("D", [64, 256])
def test_mlx_forward_counters(mlx_kernels, D):
  """Counted exactly: MMAs (4 T S D / 1024 FLOP-equivalents), Q read once, K and
  V once per 32-row query tile, O written once; no threadgroup-memory race."""
  B, H, T, S = 1, 2, 64, 64
  rng = np.random.default_rng(D)
  q, k, v = (rng.standard_normal((B, H, n, D)).astype(np.float16) for n in (T, S, S))
  record = {}
  o = mlx_ref.mlx_attention_forward(q, k, v, scale=D ** -0.5, counters=record)
  assert np.isfinite(o.astype(np.float32)).all()
  nq = T // 32
  assert record["kernel"] == mlx_ref.mlx_kernel_name(np.float16, D)
  assert record["races"] == 0 and record["race_reports"] == []
  assert record["simdgroup_mma"] == B * H * T * S * D // 256
  assert record["device_bytes_read"] == 2 * B * H * D * (T + 2 * nq * S)
  assert record["device_bytes_written"] == 2 * B * H * T * D
  assert record["threadgroups_total"] == record["threadgroups_executed"] == nq * H * B
  assert record["sampled_fraction"] == 1.0
  # A sample of one threadgroup in four, scaled to the grid.
  sampled = {}
  mlx_ref.mlx_attention_forward(q, k, v, scale=D ** -0.5, counters=sampled, sample=1)
  assert sampled["threadgroups_executed"] == 1 and sampled["sampled_fraction"] == 0.25
  assert sampled["simdgroup_mma"] == record["simdgroup_mma"]


def test_mlx_kernel_names_follow_mlx():
  assert (mlx_ref.mlx_kernel_name(np.float16, 128) ==
          "steel_attention_float16_bq32_bk16_bd128_bv128_wm4_wn1_maskfloat16")
  assert (mlx_ref.mlx_kernel_name(ml_dtypes.bfloat16, 256, bool) ==
          "steel_attention_bfloat16_bq32_bk16_bd256_bv256_wm4_wn2_maskbool_")
  assert (mlx_ref.mlx_kernel_name(np.float32, 64) ==
          "steel_attention_float32_bq32_bk32_bd64_bv64_wm4_wn1_maskfloat32")


@pytest.mark.parametrize("dtype,transpose_b,device_class", [
    ("float16", False, "g"), ("bfloat16", True, "s"), ("float32", False, "d")])
def test_mlx_steel_gemm_matches_numpy(mlx_kernels, dtype, transpose_b, device_class):
  """MLX's steel GEMM with the tiles its host picks per device class; M, N, K
  not multiples of any tile (the unaligned paths run)."""
  rng = np.random.default_rng(3)
  m, n, k = 70, 50, 40
  a = rng.standard_normal((m, k), np.float32).astype(DTYPES[dtype])
  b = rng.standard_normal((n, k) if transpose_b else (k, n), np.float32).astype(DTYPES[dtype])
  counters = {}
  d = mlx_ref.mlx_gemm(a, b, transpose_b=transpose_b, device_class=device_class,
                       counters=counters)
  ref = a.astype(np.float64) @ (b.T if transpose_b else b).astype(np.float64)
  err = np.linalg.norm(d.astype(np.float64) - ref) / np.linalg.norm(ref)
  assert err < TOLERANCE[dtype], err
  bm, bn, bk, wm, wn = mlx_ref.mlx_gemm_tiles(device_class, a.dtype, m, n, k, 1, False,
                                              transpose_b)
  assert counters["kernel"] == mlx_ref.mlx_gemm_kernel_name(a.dtype, (bm, bn, bk, wm, wn), False,
                                                           transpose_b)
  assert counters["grid"] == (-(-n // bn), -(-m // bm), 1)
  # Every threadgroup runs ceil(K / BK) steps of (BM/8)(BN/8)(BK/8) MMAs.
  assert counters["simdgroup_mma"] == (counters["threadgroups_total"] * -(-k // bk)
                                       * (bm // 8) * (bn // 8) * (bk // 8))
  assert counters["races"] == 0


def test_mlx_gemm_tiles_follow_mlx_host():
  f16 = np.dtype(np.float16)
  assert mlx_ref.mlx_gemm_tiles("g", f16, 4096, 4096, 4096) == (64, 64, 16, 1, 2)
  assert mlx_ref.mlx_gemm_tiles("g", f16, 4096, 4096, 4096, 1, False, True) == (64, 32, 32, 2, 2)
  assert mlx_ref.mlx_gemm_tiles("s", np.float32, 4096, 4096, 4096) == (64, 64, 16, 2, 2)
  assert mlx_ref.mlx_gemm_tiles("d", f16, 1024, 1024, 8192) == (32, 64, 16, 1, 2)
  assert mlx_ref.mlx_gemm_tiles("d", np.float32, 256, 256, 256) == (64, 32, 32, 2, 2)
  assert mlx_ref.mlx_kernel_name(f16, 256, ultra=True).startswith(
      "steel_attention_float16_bq32_bk32_bd256_bv256_wm4_wn2")
  assert mlx_ref.mlx_kernel_name(f16, 256).startswith(
      "steel_attention_float16_bq32_bk16_bd256_bv256_wm4_wn2")
