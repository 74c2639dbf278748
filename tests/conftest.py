import os

# Every FFI output buffer is filled with NaN before a kernel runs, so an element
# a kernel forgets to write fails the comparison instead of passing on a zero
# XLA happened to leave there. Must be set before the extension is loaded.
os.environ.setdefault("JAX_FATRAIN_POISON_OUTPUTS", "1")

# On a GPU, XLA's GEMM autotuner compiles and times candidate kernels for every
# matrix product of each test's float32 jax.nn reference (about 15 s a test on
# an H200). The reference needs a correct product, not the fastest one, and
# no test times anything. Must be set before JAX starts its GPU backend; a
# level the caller chose is kept.
if "xla_gpu_autotune_level" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             " --xla_gpu_autotune_level=0").strip()
