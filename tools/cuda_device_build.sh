#!/usr/bin/env bash
# Builds the CUDA (and CPU) FFI modules in place on a GPU machine whose Python
# already has jax, nanobind and scikit-build-core (e.g. an H100/H200 image):
#   bash tools/cuda_device_build.sh [extra cmake -D flags]
# Hopper only by default (sm_90a), to keep the build short. Also builds the
# standalone kernel check, BUILD_DIR/fatrain_cuda_kernel_check, that
# tools/cuda_gpu_tests.sh runs.
set -euo pipefail
cd "$(dirname "$0")/.."
build=${BUILD_DIR:-/tmp/fatrain_build}
cmake -S . -B "$build" -G Ninja -DPython_EXECUTABLE="$(which python3)" \
  -DJAX_FATRAIN_CUDA=ON -DJAX_FATRAIN_METAL_EMULATOR=OFF \
  -DJAX_FATRAIN_CUDA_GENCODE="-gencode=arch=compute_90a,code=sm_90a" "$@" >/dev/null
cmake --build "$build" -j"$(nproc)"
cmake --build "$build" -j"$(nproc)" --target fatrain_cuda_kernel_check
cp "$build"/_cuda_ffi*.so "$build"/_cpu_ffi*.so jax_fatrain/
