// Planted rule breaks (cpp/metal/emulator/README.md, "Rules", language):
// C++ that a C++ compiler accepts and Metal does not have, one per line of
// the kernel below. `= delete` (the first struct) is valid Metal.
#include <metal_stdlib>
using namespace metal;

struct NoCopy {
  NoCopy() = default;
  NoCopy(const NoCopy&) = delete;
};
struct Shape {
  virtual float area() const { return 0.0f; }
};
inline float twice(float x) { return 2.0f * x; }

[[kernel]] void planted_language(device float* out [[buffer(0)]],
                                 uint lane [[thread_index_in_simdgroup]]) {
  float (*op)(float) = twice;
  float* scratch = new float[4];
  delete[] scratch;
  if (lane > 31) throw 1;
  try { out[lane] = op(float(lane)); } catch (...) {}
  out[lane] += float(std::max(1, 2));
}
