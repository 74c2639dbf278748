// [[max_total_threads_per_threadgroup(N)]] in its two spellings, N
// depending on a template parameter: the emulator refuses a dispatch whose
// threadgroup is larger than N (tests/test_metal_emulator.py).
#include <metal_stdlib>
using namespace metal;

template <int kSimdgroups>
[[kernel, max_total_threads_per_threadgroup(32 * kSimdgroups)]] void bounded(
    device uint* out [[buffer(0)]], uint tid [[thread_index_in_threadgroup]]) {
  out[tid] = tid;
}

[[kernel]] [[max_total_threads_per_threadgroup(64)]] void bounded_64(
    device uint* out [[buffer(0)]], uint tid [[thread_index_in_threadgroup]]) {
  out[tid] = tid + 1;
}

[[kernel]] void unbounded(device uint* out [[buffer(0)]],
                          uint tid [[thread_index_in_threadgroup]]) {
  out[tid] = tid + 2;
}

template [[host_name("bounded_2")]] [[kernel]] decltype(bounded<2>) bounded<2>;
template [[host_name("bounded_4")]] [[kernel]] decltype(bounded<4>) bounded<4>;
