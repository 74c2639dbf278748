// -*- C++ -*-
// More of the Metal standard library for the MSL emulator's metal_stdlib shim:
// math constants, elementwise vector math, the remaining simd-group functions
// and the compiler intrinsics (`__metal_*`) that library code written against
// Apple's headers calls directly. Included by metal_stdlib after its simd
// functions and before the MSL keyword macros.
#pragma once

#include <cmath>
#include <cstring>

// Math constants (MSL spells them as macros).
#define M_E_F 2.71828182845904523536028747135266250f
#define M_LOG2E_F 1.44269504088896340735992468100189214f
#define M_LOG10E_F 0.434294481903251827651128918916605082f
#define M_LN2_F 0.693147180559945309417232121458176568f
#define M_LN10_F 2.30258509299404568401799145468436421f
#define M_PI_F 3.14159265358979323846264338327950288f
#define M_PI_2_F 1.57079632679489661923132169163975144f
#define M_PI_4_F 0.785398163397448309615660845819875721f
#define M_1_PI_F 0.318309886183790671537767526745028724f
#define M_2_PI_F 0.636619772367581343075535053490057448f
#define M_2_SQRTPI_F 1.12837916709551257389615890312154517f
#define M_SQRT2_F 1.41421356237309504880168872420969808f
#define M_SQRT1_2_F 0.707106781186547524400844362104849039f
#define M_E_H half(M_E_F)
#define M_LOG2E_H half(M_LOG2E_F)
#define M_LOG10E_H half(M_LOG10E_F)
#define M_LN2_H half(M_LN2_F)
#define M_LN10_H half(M_LN10_F)
#define M_PI_H half(M_PI_F)
#define M_PI_2_H half(M_PI_2_F)
#define M_PI_4_H half(M_PI_4_F)
#define M_SQRT2_H half(M_SQRT2_F)
#define M_SQRT1_2_H half(M_SQRT1_2_F)
#define MAXFLOAT __builtin_huge_valf()
#define HUGE_VALF __builtin_huge_valf()
#define INFINITY __builtin_inff()
#define NAN __builtin_nanf("")

namespace metal {

// --- elementwise vector math and relational functions ----------------------
#define MSL_EMU_VEC_UNARY(fn)                                   \
  template <class T, int N>                                     \
  inline msl_vec<T, N> fn(const msl_vec<T, N>& a) {             \
    msl_vec<T, N> r{};                                          \
    for (int i = 0; i < N; ++i) r[i] = static_cast<T>(fn(a[i])); \
    return r;                                                   \
  }
MSL_EMU_VEC_UNARY(exp)
MSL_EMU_VEC_UNARY(exp2)
MSL_EMU_VEC_UNARY(log)
MSL_EMU_VEC_UNARY(log2)
MSL_EMU_VEC_UNARY(sqrt)
MSL_EMU_VEC_UNARY(rsqrt)
MSL_EMU_VEC_UNARY(abs)
MSL_EMU_VEC_UNARY(fabs)
MSL_EMU_VEC_UNARY(tanh)
#undef MSL_EMU_VEC_UNARY

template <class T, int N>
inline msl_vec<T, N> max(const msl_vec<T, N>& a, const msl_vec<T, N>& b) {
  msl_vec<T, N> r{};
  for (int i = 0; i < N; ++i) r[i] = max(a[i], b[i]);
  return r;
}
template <class T, int N>
inline msl_vec<T, N> min(const msl_vec<T, N>& a, const msl_vec<T, N>& b) {
  msl_vec<T, N> r{};
  for (int i = 0; i < N; ++i) r[i] = min(a[i], b[i]);
  return r;
}
template <class T, int N>
inline msl_vec<T, N> select(const msl_vec<T, N>& a, const msl_vec<T, N>& b,
                            const msl_vec<bool, N>& c) {
  msl_vec<T, N> r{};
  for (int i = 0; i < N; ++i) r[i] = c[i] ? b[i] : a[i];
  return r;
}
template <int N>
inline bool all(const msl_vec<bool, N>& v) {
  for (int i = 0; i < N; ++i)
    if (!v[i]) return false;
  return true;
}
template <int N>
inline bool any(const msl_vec<bool, N>& v) {
  for (int i = 0; i < N; ++i)
    if (v[i]) return true;
  return false;
}
inline bool all(bool v) { return v; }
inline bool any(bool v) { return v; }
template <class T>
inline T fmax(T a, T b) { return std::fmax(float(a), float(b)); }
template <class T>
inline T fmin(T a, T b) { return std::fmin(float(a), float(b)); }
inline float floor(float x) { return std::floor(x); }
inline float ceil(float x) { return std::ceil(x); }
inline float round(float x) { return std::round(x); }
inline float trunc(float x) { return std::trunc(x); }
inline float pow(float x, float y) { ::msl::rt::note_transcendental(); return std::pow(x, y); }
inline float log10(float x) { ::msl::rt::note_transcendental(); return std::log10(x); }
inline float sin(float x) { ::msl::rt::note_transcendental(); return std::sin(x); }
inline float cos(float x) { ::msl::rt::note_transcendental(); return std::cos(x); }
inline float precise_divide(float x, float y) { return x / y; }
inline float divide(float x, float y) { return x / y; }

// --- the remaining simd-group functions (all 32 lanes meet) ----------------
namespace detail {
// Reduction over the lanes below (exclusive) or up to (inclusive) this lane.
template <class T, class F>
inline T prefix(T v, F f, T identity, bool inclusive, const char* what) {
  put(v);
  ::msl::rt::simd_sync(::msl::rt::SyncKind::kSimdReduce, what);
  const int me = int(::msl::rt::lane_id());
  T acc = identity;
  for (int l = 0; l < (inclusive ? me + 1 : me); ++l) acc = f(acc, peer<T>(l));
  return acc;
}
template <class T>
struct shuffle_fill {
  T data, filling;
};
template <class T>
inline T bits_op(T a, T b, int op) {
  // Bitwise and/or/xor on the bit patterns (for floating types too).
  unsigned char x[sizeof(T)], y[sizeof(T)];
  std::memcpy(x, &a, sizeof(T));
  std::memcpy(y, &b, sizeof(T));
  for (size_t i = 0; i < sizeof(T); ++i)
    x[i] = op == 0 ? (x[i] & y[i]) : op == 1 ? (x[i] | y[i]) : (x[i] ^ y[i]);
  T r;
  std::memcpy(&r, x, sizeof(T));
  return r;
}
}  // namespace detail

template <class T> inline T simd_product(T v) {
  return detail::reduce(v, [](T a, T b) { return T(a * b); }, "simd_product");
}
template <class T> inline T simd_and(T v) {
  return detail::reduce(v, [](T a, T b) { return detail::bits_op(a, b, 0); }, "simd_and");
}
template <class T> inline T simd_or(T v) {
  return detail::reduce(v, [](T a, T b) { return detail::bits_op(a, b, 1); }, "simd_or");
}
template <class T> inline T simd_xor(T v) {
  return detail::reduce(v, [](T a, T b) { return detail::bits_op(a, b, 2); }, "simd_xor");
}
inline bool simd_all(bool v) {
  return detail::reduce(v, [](bool a, bool b) { return a && b; }, "simd_all");
}
inline bool simd_any(bool v) {
  return detail::reduce(v, [](bool a, bool b) { return a || b; }, "simd_any");
}
template <class T> inline T simd_prefix_inclusive_sum(T v) {
  return detail::prefix(v, [](T a, T b) { return T(a + b); }, T(0), true,
                        "simd_prefix_inclusive_sum");
}
template <class T> inline T simd_prefix_exclusive_sum(T v) {
  return detail::prefix(v, [](T a, T b) { return T(a + b); }, T(0), false,
                        "simd_prefix_exclusive_sum");
}
template <class T> inline T simd_prefix_inclusive_product(T v) {
  return detail::prefix(v, [](T a, T b) { return T(a * b); }, T(1), true,
                        "simd_prefix_inclusive_product");
}
template <class T> inline T simd_prefix_exclusive_product(T v) {
  return detail::prefix(v, [](T a, T b) { return T(a * b); }, T(1), false,
                        "simd_prefix_exclusive_product");
}
template <class T> inline T simd_shuffle_rotate_down(T v, ushort delta) {
  return detail::shuffle_from(v, int((::msl::rt::lane_id() + delta) % 32),
                              "simd_shuffle_rotate_down");
}
template <class T> inline T simd_shuffle_rotate_up(T v, ushort delta) {
  return detail::shuffle_from(v, int((::msl::rt::lane_id() + 32 - delta % 32) % 32),
                              "simd_shuffle_rotate_up");
}
// Within groups of `modulo` lanes: lane i takes `data` from lane i - delta,
// or, below the group's start, `filling` from lane i - delta + modulo.
template <class T> inline T simd_shuffle_and_fill_up(T data, T filling, ushort delta,
                                                     ushort modulo = 32) {
  detail::put(detail::shuffle_fill<T>{data, filling});
  ::msl::rt::simd_sync(::msl::rt::SyncKind::kSimdShuffle, "simd_shuffle_and_fill_up");
  const int me = int(::msl::rt::lane_id()), m = modulo ? modulo : 32;
  const int base = me - me % m, src = me % m - int(delta);
  if (src >= 0) return detail::peer<detail::shuffle_fill<T>>(base + src).data;
  return detail::peer<detail::shuffle_fill<T>>(base + src + m).filling;
}
// Within groups of `modulo` lanes: lane i takes `data` from lane i + delta,
// or, past the group's end, `filling` from lane i + delta - modulo.
template <class T> inline T simd_shuffle_and_fill_down(T data, T filling, ushort delta,
                                                       ushort modulo = 32) {
  detail::put(detail::shuffle_fill<T>{data, filling});
  ::msl::rt::simd_sync(::msl::rt::SyncKind::kSimdShuffle, "simd_shuffle_and_fill_down");
  const int me = int(::msl::rt::lane_id()), m = modulo ? modulo : 32;
  const int base = me - me % m, src = me % m + int(delta);
  if (src < m) return detail::peer<detail::shuffle_fill<T>>(base + src).data;
  return detail::peer<detail::shuffle_fill<T>>(base + src - m).filling;
}
}  // namespace metal

// --- compiler intrinsics ----------------------------------------------------
// Apple's metal_stdlib implements the library on top of `__metal_*` builtins;
// code that overloads library functions for its own types (e.g. bfloat math)
// calls them directly. The math-mode argument only selects accuracy there; the
// emulator computes in float either way.
#define __METAL_MAYBE_FAST_MATH__ 0
#define __METAL_FAST_MATH__ 1
#define __METAL_PRECISE_MATH__ 2

#define MSL_EMU_INTRINSIC1(name, expr) \
  template <class T>                   \
  inline T __metal_##name(T x, int = 0) { const float a = float(x); return T(expr); }
// The transcendental ones also count a call (transcendentals).
#define MSL_EMU_INTRINSIC1_T(name, expr)                \
  template <class T>                                    \
  inline T __metal_##name(T x, int = 0) {               \
    ::msl::rt::note_transcendental();                   \
    const float a = float(x);                           \
    return T(expr);                                     \
  }
#define MSL_EMU_INTRINSIC2(name, expr) \
  template <class T>                   \
  inline T __metal_##name(T x, T y, int = 0) { const float a = float(x), b = float(y); return T(expr); }
#define MSL_EMU_INTRINSIC3(name, expr)                  \
  template <class T>                                    \
  inline T __metal_##name(T x, T y, T z, int = 0) {     \
    const float a = float(x), b = float(y), c = float(z); \
    return T(expr);                                     \
  }
MSL_EMU_INTRINSIC1(fabs, std::fabs(a))
MSL_EMU_INTRINSIC1_T(acos, std::acos(a))
MSL_EMU_INTRINSIC1_T(acosh, std::acosh(a))
MSL_EMU_INTRINSIC1_T(asin, std::asin(a))
MSL_EMU_INTRINSIC1_T(asinh, std::asinh(a))
MSL_EMU_INTRINSIC1_T(atan, std::atan(a))
MSL_EMU_INTRINSIC1_T(atanh, std::atanh(a))
MSL_EMU_INTRINSIC1(ceil, std::ceil(a))
MSL_EMU_INTRINSIC1_T(cos, std::cos(a))
MSL_EMU_INTRINSIC1_T(cosh, std::cosh(a))
MSL_EMU_INTRINSIC1_T(cospi, std::cos(M_PI_F * a))
MSL_EMU_INTRINSIC1_T(exp, std::exp(a))
MSL_EMU_INTRINSIC1_T(exp10, std::pow(10.0f, a))
MSL_EMU_INTRINSIC1_T(exp2, std::exp2(a))
MSL_EMU_INTRINSIC1(floor, std::floor(a))
MSL_EMU_INTRINSIC1(fract, std::fmin(a - std::floor(a), 0x1.fffffep-1f))
MSL_EMU_INTRINSIC1_T(log, std::log(a))
MSL_EMU_INTRINSIC1_T(log10, std::log10(a))
MSL_EMU_INTRINSIC1_T(log2, std::log2(a))
MSL_EMU_INTRINSIC1(rint, std::rint(a))
MSL_EMU_INTRINSIC1(round, std::round(a))
MSL_EMU_INTRINSIC1_T(rsqrt, 1.0f / std::sqrt(a))
MSL_EMU_INTRINSIC1_T(sin, std::sin(a))
MSL_EMU_INTRINSIC1_T(sinh, std::sinh(a))
MSL_EMU_INTRINSIC1_T(sinpi, std::sin(M_PI_F * a))
MSL_EMU_INTRINSIC1_T(sqrt, std::sqrt(a))
MSL_EMU_INTRINSIC1_T(tan, std::tan(a))
MSL_EMU_INTRINSIC1_T(tanh, std::tanh(a))
MSL_EMU_INTRINSIC1_T(tanpi, std::tan(M_PI_F * a))
MSL_EMU_INTRINSIC1(trunc, std::trunc(a))
MSL_EMU_INTRINSIC2(atan2, std::atan2(a, b))
MSL_EMU_INTRINSIC2(divide, a / b)
MSL_EMU_INTRINSIC2(fmax, std::fmax(a, b))
MSL_EMU_INTRINSIC2(fmin, std::fmin(a, b))
MSL_EMU_INTRINSIC2(fmod, std::fmod(a, b))
MSL_EMU_INTRINSIC2(nextafter, std::nextafter(a, b))
template <class T>
inline T __metal_pow(T x, T y, int = 0) {
  ::msl::rt::note_transcendental();
  return T(std::pow(float(x), float(y)));
}
template <class T>
inline T __metal_powr(T x, T y, int = 0) {
  ::msl::rt::note_transcendental();
  return T(std::pow(float(x), float(y)));
}
MSL_EMU_INTRINSIC3(fma, std::fma(a, b, c))
MSL_EMU_INTRINSIC3(fmax3, std::fmax(std::fmax(a, b), c))
MSL_EMU_INTRINSIC3(fmin3, std::fmin(std::fmin(a, b), c))
MSL_EMU_INTRINSIC3(fmedian3, std::fmax(std::fmin(a, b), std::fmin(std::fmax(a, b), c)))
#undef MSL_EMU_INTRINSIC1
#undef MSL_EMU_INTRINSIC1_T
#undef MSL_EMU_INTRINSIC2
#undef MSL_EMU_INTRINSIC3
template <class T>
inline T __metal_frexp(T x, int* e) { return T(std::frexp(float(x), e)); }
template <class T>
inline T __metal_ldexp(T x, int k, int = 0) { return T(std::ldexp(float(x), k)); }

inline ushort __metal_get_simdgroup_size(ushort) { return 32; }
#define MSL_EMU_SIMD_INTRINSIC(name)                                        \
  template <class T, class... A>                                           \
  inline T __metal_##name(T x, A... a) { return metal::name(x, a...); }
MSL_EMU_SIMD_INTRINSIC(simd_broadcast)
MSL_EMU_SIMD_INTRINSIC(simd_shuffle)
MSL_EMU_SIMD_INTRINSIC(simd_shuffle_down)
MSL_EMU_SIMD_INTRINSIC(simd_shuffle_up)
MSL_EMU_SIMD_INTRINSIC(simd_shuffle_xor)
MSL_EMU_SIMD_INTRINSIC(simd_shuffle_rotate_down)
MSL_EMU_SIMD_INTRINSIC(simd_shuffle_rotate_up)
MSL_EMU_SIMD_INTRINSIC(simd_shuffle_and_fill_down)
MSL_EMU_SIMD_INTRINSIC(simd_shuffle_and_fill_up)
MSL_EMU_SIMD_INTRINSIC(simd_max)
MSL_EMU_SIMD_INTRINSIC(simd_min)
MSL_EMU_SIMD_INTRINSIC(simd_sum)
MSL_EMU_SIMD_INTRINSIC(simd_product)
MSL_EMU_SIMD_INTRINSIC(simd_and)
MSL_EMU_SIMD_INTRINSIC(simd_or)
MSL_EMU_SIMD_INTRINSIC(simd_xor)
MSL_EMU_SIMD_INTRINSIC(simd_prefix_inclusive_sum)
MSL_EMU_SIMD_INTRINSIC(simd_prefix_exclusive_sum)
MSL_EMU_SIMD_INTRINSIC(simd_prefix_inclusive_product)
MSL_EMU_SIMD_INTRINSIC(simd_prefix_exclusive_product)
#undef MSL_EMU_SIMD_INTRINSIC
