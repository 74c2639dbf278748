// Planted rule break (cpp/metal/emulator/README.md, "Rules", language): a
// recursive helper. Metal has no call stack for it; Apple's compiler refuses.
#include <metal_stdlib>
using namespace metal;

inline uint planted_factorial(uint n) { return n <= 1 ? 1 : n * planted_factorial(n - 1); }

[[kernel]] void planted_recursion(device uint* out [[buffer(0)]],
                                  uint lane [[thread_index_in_simdgroup]]) {
  out[lane] = planted_factorial(lane % 8);
}
