"""One forward and backward of each CUDA kernel family, small enough to run
under compute-sanitizer (tools/cuda_gpu_tests.sh runs it that way):

  compute-sanitizer --tool memcheck --kernel-name kns=fatrain \
      python3 tools/cuda_sanitize.py [--deterministic] [--family F] [--quick]

--family caps the kernel families (hopper, the default's kernels; mma_sync;
simt). Each case is also checked against jax.nn, so that a kernel the
sanitizer passes but that computes the wrong thing still fails. The output
ends with the distinct kernels that ran.
"""

import argparse
import os
import sys

import jax
import jax.numpy as jnp

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]
from attention_cases import Case, make_inputs  # noqa: E402
from checks import assert_matches_reference, reference_results, results  # noqa: E402

from jax_fatrain._backends import cuda as _cuda  # noqa: E402

B, N, T, S = "B", "N", "T", "S"

# Every head dim and dtype, causal and not, GQA, each kind of mask, bias and
# length, segment ids, and tile edges that are not whole (T, S not multiples
# of any tile). Small, because the sanitizer runs kernels tens of times slower.
CASES = [
    Case(batch=1, q_len=200, kv_len=190, q_heads=4, kv_heads=1, head_dim=64,
         dtype=jnp.bfloat16, is_causal=True),
    Case(batch=1, q_len=150, kv_len=210, q_heads=2, kv_heads=2, head_dim=64,
         dtype=jnp.float16),
    Case(batch=1, q_len=200, kv_len=300, q_heads=4, kv_heads=2, head_dim=128,
         dtype=jnp.bfloat16, is_causal=True),
    Case(batch=1, q_len=140, kv_len=260, q_heads=2, kv_heads=1, head_dim=128,
         dtype=jnp.float16, window=(40, 10), q_lengths=True, kv_lengths=True),
    Case(batch=1, q_len=160, kv_len=256, q_heads=2, kv_heads=1, head_dim=128,
         dtype=jnp.bfloat16, bias_shape=(1, N, T, S)),
    Case(batch=1, q_len=130, kv_len=200, q_heads=2, kv_heads=1, head_dim=128,
         dtype=jnp.bfloat16, mask_shape=(B, 1, T, S), bias_shape=(1, N, T, S)),
    Case(batch=1, q_len=200, kv_len=200, q_heads=4, kv_heads=2, head_dim=128,
         dtype=jnp.bfloat16, is_causal=True, segments="sorted"),
    Case(batch=1, q_len=180, kv_len=150, q_heads=2, kv_heads=1, head_dim=64,
         dtype=jnp.float16, segments="unsorted"),
    Case(batch=1, q_len=200, kv_len=330, q_heads=4, kv_heads=2, head_dim=256,
         dtype=jnp.bfloat16, is_causal=True),
    Case(batch=1, q_len=150, kv_len=150, q_heads=2, kv_heads=1, head_dim=256,
         dtype=jnp.bfloat16),
    Case(batch=1, q_len=130, kv_len=200, q_heads=2, kv_heads=1, head_dim=256,
         dtype=jnp.float16, is_causal=True, mask_shape=(B, 1, T, S)),
    Case(batch=1, q_len=150, kv_len=150, q_heads=4, kv_heads=1, head_dim=256,
         dtype=jnp.bfloat16, is_causal=True, segments="padding"),
    Case(batch=1, q_len=70, kv_len=90, q_heads=2, kv_heads=1, head_dim=96,
         dtype=jnp.float32, is_causal=True, bias_shape=(1, N, T, S)),
]

QUICK = (0, 2, 6, 8)


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--deterministic", action="store_true",
                      help="the deterministic backward (its own dQ kernel)")
  parser.add_argument("--family", default="hopper", choices=("hopper", "mma_sync", "simt"),
                      help="the fastest kernel family to use (default: every one)")
  parser.add_argument("--quick", action="store_true",
                      help="one causal case per head dim and a packed one (for racecheck, "
                           "which is slower still)")
  args = parser.parse_args()
  kernels = set()
  cases = [CASES[i] for i in QUICK] if args.quick else CASES
  for case in cases:
    x = make_inputs(case, seed=3)
    with _cuda.kernel_family(args.family), _cuda.recording_launches() as launched:
      got = jax.block_until_ready(results(case, x, "cuda", deterministic=args.deterministic))
    assert_matches_reference(case, x, got, reference_results(case, x))
    kernels.update(launched)
    print(f"ok {case.id}", flush=True)
  print(f"{len(kernels)} distinct kernels ran:")
  for name in sorted(kernels):
    print("  " + name.replace("fatrain::cuda::(anonymous namespace)::", "")[:200])
  return 0


if __name__ == "__main__":
  sys.exit(main())
