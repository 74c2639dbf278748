// Planted rule break (cpp/metal/emulator/README.md, "Rules", unroll): a
// register array indexed by the variable of a loop that is not fully
// unrolled. The first two loops are fine (the pragma, and MLX's macro
// spelling of it through a second macro); the third is the break.
#include <metal_stdlib>
using namespace metal;

#define PLANTED_PRAGMA_UNROLL _Pragma("clang loop unroll(full)")
#define PLANTED_UNROLL PLANTED_PRAGMA_UNROLL

[[kernel]] void planted_unroll(device float* out [[buffer(0)]],
                               uint lane [[thread_index_in_simdgroup]]) {
  simdgroup_matrix<float, 8, 8> acc[2];
  float partial[4];
#pragma clang loop unroll(full)
  for (int i = 0; i < 4; ++i) partial[i] = float(lane + i);
  PLANTED_UNROLL
  for (int t = 0; t < 2; ++t) acc[t] = make_filled_simdgroup_matrix<float, 8, 8>(partial[t]);
  float sum = 0.0f;
  for (int i = 0; i < 4; ++i) {
    const int j = 3 - i;
    sum += partial[j] + acc[i % 2].thread_elements()[0];
  }
  out[lane] = sum;
}
