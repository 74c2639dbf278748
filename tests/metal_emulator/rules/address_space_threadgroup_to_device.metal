// Planted rule break (cpp/metal/emulator/README.md, "Rules", address-space):
// a threadgroup pointer passed where a device pointer is expected. Apple's
// compiler refuses this; the emulator's address-space check must too.
#include <metal_stdlib>
using namespace metal;

template <typename T>
inline void store_row(device T* dst, const threadgroup T* src, uint lane) {
  dst[lane] = src[lane];
}

template <typename T>
[[kernel]] void planted_address_space(device T* out [[buffer(0)]],
                                      uint lane [[thread_index_in_simdgroup]]) {
  threadgroup T tile[32];
  tile[lane] = T(lane);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  store_row(tile, tile, lane);  // the break: `tile` is threadgroup memory
  out[lane] = tile[lane];
}

template [[host_name("planted_address_space")]] [[kernel]]
decltype(planted_address_space<float>) planted_address_space<float>;
