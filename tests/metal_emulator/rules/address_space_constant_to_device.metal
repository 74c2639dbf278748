// Planted rule break (cpp/metal/emulator/README.md, "Rules", address-space):
// a constant pointer passed where a device pointer is expected. Both are
// read-only buffers to a C++ compiler, so only the address-space check sees
// it; Apple's compiler refuses it.
#include <metal_stdlib>
using namespace metal;

inline float first(const device float* p) { return p[0]; }

[[kernel]] void planted_constant_to_device(device float* out [[buffer(0)]],
                                           constant float* scale [[buffer(1)]],
                                           uint lane [[thread_index_in_simdgroup]]) {
  out[lane] = first(scale);  // the break: `scale` is constant memory
}
