// -*- C++ -*-
// MSL scalar and vector types, type traits, numeric limits and as_type for the
// MSL emulator's metal_stdlib shim. Plain C++17 (GCC or Clang); included by
// metal_stdlib before the MSL keyword macros are defined.
//
// What differs from Apple's compiler, on purpose:
//  * bfloat arithmetic goes through float (a bfloat operand converts to float,
//    the result is float until it is stored into a bfloat);
//  * vectors are structs with the members x, y, z, w (no swizzles); their size
//    and alignment follow MSL (a 3-vector occupies four elements);
//  * an integer vector operation keeps the element type (as in MSL: short2 -
//    short2 is short2), computed in int and converted back.
#pragma once

#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#include "msl_emulator/runtime.h"

// ---------------------------------------------------------------------------
// Scalar types.
// ---------------------------------------------------------------------------
typedef unsigned int uint;
typedef unsigned short ushort;
typedef unsigned char uchar;
typedef unsigned long ulong;
typedef _Float16 half;

// bfloat: 16-bit brain float. Conversions round to nearest even and are
// constexpr, so `constexpr bfloat` constants and static_asserts work.
struct bfloat {
  uint16_t bits;
  bfloat() = default;
  static constexpr uint16_t from_float(float f) {
    uint32_t u = __builtin_bit_cast(uint32_t, f);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((u >> 16) | 0x40);
    u += 0x7FFFu + ((u >> 16) & 1u);
    return static_cast<uint16_t>(u >> 16);
  }
  // Every conversion at run time is counted (bfloat_conversions): M1 and M2
  // GPUs convert bfloat in software.
  constexpr bfloat(float f) : bits(from_float(f)) { counted(); }
  constexpr bfloat(double f) : bits(from_float(static_cast<float>(f))) { counted(); }
  constexpr bfloat(int f) : bits(from_float(static_cast<float>(f))) { counted(); }
  constexpr bfloat(half f) : bits(from_float(static_cast<float>(f))) { counted(); }
  constexpr operator float() const {
    counted();
    return to_float_uncounted();
  }
  // The value as float without counting a conversion (simdgroup_matrix
  // operands, which the matrix unit reads).
  constexpr float to_float_uncounted() const {
    return __builtin_bit_cast(float, uint32_t(bits) << 16);
  }
  static constexpr void counted() {
    if (!__builtin_is_constant_evaluated()) msl::rt::note_bfloat_conversion();
  }
  static constexpr bfloat from_bits(uint16_t b) {
    bfloat r{};
    r.bits = b;
    return r;
  }
  // Compound assignment computes in float and rounds once.
  constexpr bfloat& operator+=(float v) { return *this = bfloat(float(*this) + v); }
  constexpr bfloat& operator-=(float v) { return *this = bfloat(float(*this) - v); }
  constexpr bfloat& operator*=(float v) { return *this = bfloat(float(*this) * v); }
  constexpr bfloat& operator/=(float v) { return *this = bfloat(float(*this) / v); }
};
static_assert(sizeof(bfloat) == 2, "bfloat must be 2 bytes");

// ---------------------------------------------------------------------------
// Vector types: msl_vec<T, N>, N = 1..4, spelled metal::vec<T, N> and
// float2, half4, short2, bool3, ... as in MSL.
// ---------------------------------------------------------------------------
template <class T, int N>
struct msl_vec;

namespace msl {
namespace detail {
template <class T, int N>
constexpr size_t vec_align() {
  return sizeof(T) * (N == 3 ? 4 : N);
}
}  // namespace detail
}  // namespace msl

namespace msl {
namespace detail {
// Element i of a vector (a switch rather than pointer arithmetic, so that it
// is valid in constant expressions).
template <class V>
constexpr auto& elem(V& v, int i) {
  if constexpr (V::size() == 1) {
    return v.x;
  } else if constexpr (V::size() == 2) {
    return i == 0 ? v.x : v.y;
  } else if constexpr (V::size() == 3) {
    return i == 0 ? v.x : i == 1 ? v.y : v.z;
  } else {
    return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
  }
}
}  // namespace detail
}  // namespace msl

#define MSL_EMU_VEC_COMMON(N)                                                        \
  msl_vec() = default;                                                               \
  explicit constexpr msl_vec(T a) : msl_vec(fill_tag(), a) {}                        \
  template <class U>                                                                 \
  explicit constexpr msl_vec(const msl_vec<U, N>& o) : msl_vec(convert_tag(), o) {}  \
  constexpr T& operator[](int i) { return msl::detail::elem(*this, i); }                          \
  constexpr const T& operator[](int i) const { return msl::detail::elem(*this, i); }              \
  static constexpr int size() { return N; }

template <class T>
struct msl_vec<T, 1> {
  T x;
  struct fill_tag {};
  struct convert_tag {};
  constexpr msl_vec(fill_tag, T a) : x(a) {}
  template <class U>
  constexpr msl_vec(convert_tag, const msl_vec<U, 1>& o) : x(T(o.x)) {}
  MSL_EMU_VEC_COMMON(1)
};
template <class T>
struct alignas(msl::detail::vec_align<T, 2>()) msl_vec<T, 2> {
  T x, y;
  struct fill_tag {};
  struct convert_tag {};
  constexpr msl_vec(fill_tag, T a) : x(a), y(a) {}
  template <class U>
  constexpr msl_vec(convert_tag, const msl_vec<U, 2>& o) : x(T(o.x)), y(T(o.y)) {}
  constexpr msl_vec(T a, T b) : x(a), y(b) {}
  MSL_EMU_VEC_COMMON(2)
};
template <class T>
struct alignas(msl::detail::vec_align<T, 3>()) msl_vec<T, 3> {
  T x, y, z;
  struct fill_tag {};
  struct convert_tag {};
  constexpr msl_vec(fill_tag, T a) : x(a), y(a), z(a) {}
  template <class U>
  constexpr msl_vec(convert_tag, const msl_vec<U, 3>& o) : x(T(o.x)), y(T(o.y)), z(T(o.z)) {}
  constexpr msl_vec(T a, T b, T c) : x(a), y(b), z(c) {}
  constexpr msl_vec(const msl_vec<T, 2>& ab, T c) : x(ab.x), y(ab.y), z(c) {}
  constexpr msl_vec(T a, const msl_vec<T, 2>& bc) : x(a), y(bc.x), z(bc.y) {}
  MSL_EMU_VEC_COMMON(3)
};
template <class T>
struct alignas(msl::detail::vec_align<T, 4>()) msl_vec<T, 4> {
  T x, y, z, w;
  struct fill_tag {};
  struct convert_tag {};
  constexpr msl_vec(fill_tag, T a) : x(a), y(a), z(a), w(a) {}
  template <class U>
  constexpr msl_vec(convert_tag, const msl_vec<U, 4>& o)
      : x(T(o.x)), y(T(o.y)), z(T(o.z)), w(T(o.w)) {}
  constexpr msl_vec(T a, T b, T c, T d) : x(a), y(b), z(c), w(d) {}
  constexpr msl_vec(const msl_vec<T, 2>& ab, const msl_vec<T, 2>& cd)
      : x(ab.x), y(ab.y), z(cd.x), w(cd.y) {}
  constexpr msl_vec(const msl_vec<T, 3>& abc, T d) : x(abc.x), y(abc.y), z(abc.z), w(d) {}
  constexpr msl_vec(T a, const msl_vec<T, 3>& bcd) : x(a), y(bcd.x), z(bcd.y), w(bcd.z) {}
  MSL_EMU_VEC_COMMON(4)
};
#undef MSL_EMU_VEC_COMMON

#define MSL_EMU_VEC_TYPES(T, name) \
  typedef msl_vec<T, 2> name##2;   \
  typedef msl_vec<T, 3> name##3;   \
  typedef msl_vec<T, 4> name##4;
MSL_EMU_VEC_TYPES(float, float)
MSL_EMU_VEC_TYPES(half, half)
MSL_EMU_VEC_TYPES(bfloat, bfloat)
MSL_EMU_VEC_TYPES(bool, bool)
MSL_EMU_VEC_TYPES(char, char)
MSL_EMU_VEC_TYPES(uchar, uchar)
MSL_EMU_VEC_TYPES(int, int)
MSL_EMU_VEC_TYPES(uint, uint)
MSL_EMU_VEC_TYPES(short, short)
MSL_EMU_VEC_TYPES(ushort, ushort)
MSL_EMU_VEC_TYPES(long, long)
MSL_EMU_VEC_TYPES(ulong, ulong)
#undef MSL_EMU_VEC_TYPES

// --- vector operators -------------------------------------------------------
namespace msl {
namespace detail {
template <class T>
struct is_vec : std::false_type {};
template <class T, int N>
struct is_vec<msl_vec<T, N>> : std::true_type {};
// A scalar that may meet a vector in an arithmetic expression.
template <class S>
constexpr bool is_scalar_v = std::is_arithmetic<S>::value || std::is_same<S, half>::value ||
                             std::is_same<S, bfloat>::value;
// Elementwise result of `a OP b` stored back in the element type.
template <class T, int N, class F>
constexpr msl_vec<T, N> map2(const msl_vec<T, N>& a, const msl_vec<T, N>& b, F f) {
  msl_vec<T, N> r{};
  for (int i = 0; i < N; ++i) r[i] = static_cast<T>(f(a[i], b[i]));
  return r;
}
template <class T, int N, class F>
constexpr msl_vec<bool, N> cmp2(const msl_vec<T, N>& a, const msl_vec<T, N>& b, F f) {
  msl_vec<bool, N> r{};
  for (int i = 0; i < N; ++i) r[i] = f(a[i], b[i]);
  return r;
}
}  // namespace detail
}  // namespace msl

#define MSL_EMU_VEC_BINOP(OP, OPEQ)                                                         \
  template <class T, int N>                                                                 \
  constexpr msl_vec<T, N> operator OP(const msl_vec<T, N>& a, const msl_vec<T, N>& b) {     \
    return msl::detail::map2(a, b, [](T u, T v) { return u OP v; });                        \
  }                                                                                         \
  template <class T, int N, class S,                                                        \
            class = std::enable_if_t<msl::detail::is_scalar_v<S>>>                          \
  constexpr msl_vec<T, N> operator OP(const msl_vec<T, N>& a, S s) {                        \
    return a OP msl_vec<T, N>(static_cast<T>(s));                                           \
  }                                                                                         \
  template <class T, int N, class S,                                                        \
            class = std::enable_if_t<msl::detail::is_scalar_v<S>>>                          \
  constexpr msl_vec<T, N> operator OP(S s, const msl_vec<T, N>& b) {                        \
    return msl_vec<T, N>(static_cast<T>(s)) OP b;                                           \
  }                                                                                         \
  template <class T, int N, class R>                                                        \
  constexpr msl_vec<T, N>& operator OPEQ(msl_vec<T, N>& a, const R& b) {                    \
    return a = a OP b;                                                                      \
  }
MSL_EMU_VEC_BINOP(+, +=)
MSL_EMU_VEC_BINOP(-, -=)
MSL_EMU_VEC_BINOP(*, *=)
MSL_EMU_VEC_BINOP(/, /=)
MSL_EMU_VEC_BINOP(%, %=)
MSL_EMU_VEC_BINOP(&, &=)
MSL_EMU_VEC_BINOP(|, |=)
MSL_EMU_VEC_BINOP(^, ^=)
MSL_EMU_VEC_BINOP(<<, <<=)
MSL_EMU_VEC_BINOP(>>, >>=)
#undef MSL_EMU_VEC_BINOP

#define MSL_EMU_VEC_CMP(OP)                                                                  \
  template <class T, int N>                                                                  \
  constexpr msl_vec<bool, N> operator OP(const msl_vec<T, N>& a, const msl_vec<T, N>& b) {   \
    return msl::detail::cmp2(a, b, [](T u, T v) { return u OP v; });                         \
  }                                                                                          \
  template <class T, int N, class S,                                                         \
            class = std::enable_if_t<msl::detail::is_scalar_v<S>>>                           \
  constexpr msl_vec<bool, N> operator OP(const msl_vec<T, N>& a, S s) {                      \
    return a OP msl_vec<T, N>(static_cast<T>(s));                                            \
  }                                                                                          \
  template <class T, int N, class S,                                                         \
            class = std::enable_if_t<msl::detail::is_scalar_v<S>>>                           \
  constexpr msl_vec<bool, N> operator OP(S s, const msl_vec<T, N>& b) {                      \
    return msl_vec<T, N>(static_cast<T>(s)) OP b;                                            \
  }
MSL_EMU_VEC_CMP(==)
MSL_EMU_VEC_CMP(!=)
MSL_EMU_VEC_CMP(<)
MSL_EMU_VEC_CMP(>)
MSL_EMU_VEC_CMP(<=)
MSL_EMU_VEC_CMP(>=)
MSL_EMU_VEC_CMP(&&)
MSL_EMU_VEC_CMP(||)
#undef MSL_EMU_VEC_CMP

template <class T, int N>
constexpr msl_vec<T, N> operator-(const msl_vec<T, N>& a) {
  msl_vec<T, N> r{};
  for (int i = 0; i < N; ++i) r[i] = static_cast<T>(-a[i]);
  return r;
}
template <class T, int N>
constexpr msl_vec<T, N> operator+(const msl_vec<T, N>& a) {
  return a;
}
template <class T, int N>
constexpr msl_vec<T, N> operator~(const msl_vec<T, N>& a) {
  msl_vec<T, N> r{};
  for (int i = 0; i < N; ++i) r[i] = static_cast<T>(~a[i]);
  return r;
}
template <class T, int N>
constexpr msl_vec<bool, N> operator!(const msl_vec<T, N>& a) {
  msl_vec<bool, N> r{};
  for (int i = 0; i < N; ++i) r[i] = !a[i];
  return r;
}
template <class T, int N>
constexpr msl_vec<T, N>& operator++(msl_vec<T, N>& a) {
  return a += T(1);
}
template <class T, int N>
constexpr msl_vec<T, N>& operator--(msl_vec<T, N>& a) {
  return a -= T(1);
}

// ---------------------------------------------------------------------------
// The metal namespace: vec, type traits, numeric limits, as_type.
// ---------------------------------------------------------------------------
namespace metal {
template <class T, int N>
using vec = msl_vec<T, N>;

// Type traits. Address spaces do not exist in the emulator (the pre-pass maps
// them away), so remove_addrspace is the identity.
using std::add_const;
using std::add_const_t;
using std::add_pointer;
using std::add_pointer_t;
using std::bool_constant;
using std::conditional;
using std::conditional_t;
using std::decay;
using std::decay_t;
using std::declval;
using std::enable_if;
using std::enable_if_t;
using std::false_type;
using std::integral_constant;
using std::is_base_of;
using std::is_base_of_v;
using std::is_class;
using std::is_class_v;
using std::is_const;
using std::is_const_v;
using std::is_convertible;
using std::is_convertible_v;
using std::is_enum;
using std::is_enum_v;
using std::is_integral;
using std::is_integral_v;
using std::is_pointer;
using std::is_pointer_v;
using std::is_reference;
using std::is_reference_v;
using std::is_same;
using std::is_same_v;
using std::is_signed;
using std::is_signed_v;
using std::is_trivially_copyable;
using std::is_trivially_copyable_v;
using std::is_unsigned;
using std::is_unsigned_v;
using std::is_void;
using std::is_void_v;
using std::make_signed;
using std::make_signed_t;
using std::make_unsigned;
using std::make_unsigned_t;
using std::remove_const;
using std::remove_const_t;
using std::remove_cv;
using std::remove_cv_t;
using std::remove_pointer;
using std::remove_pointer_t;
using std::remove_reference;
using std::remove_reference_t;
using std::remove_volatile;
using std::remove_volatile_t;
using std::true_type;
using std::underlying_type;
using std::underlying_type_t;

template <class T>
struct remove_addrspace {
  using type = T;
};
template <class T>
using remove_addrspace_t = typename remove_addrspace<T>::type;

// half and bfloat are floating-point types in MSL.
template <class T>
struct is_floating_point
    : bool_constant<std::is_floating_point<std::remove_cv_t<T>>::value ||
                    std::is_same<std::remove_cv_t<T>, half>::value ||
                    std::is_same<std::remove_cv_t<T>, bfloat>::value> {};
template <class T>
constexpr bool is_floating_point_v = is_floating_point<T>::value;
template <class T>
struct is_arithmetic : bool_constant<std::is_integral<T>::value || is_floating_point<T>::value> {};
template <class T>
constexpr bool is_arithmetic_v = is_arithmetic<T>::value;
template <class T>
struct is_scalar : bool_constant<is_arithmetic<T>::value || std::is_enum<T>::value ||
                                 std::is_pointer<T>::value> {};
template <class T>
constexpr bool is_scalar_v = is_scalar<T>::value;
template <class T>
struct is_vector : false_type {};
template <class T, int N>
struct is_vector<msl_vec<T, N>> : true_type {};
template <class T>
constexpr bool is_vector_v = is_vector<T>::value;
template <class T>
struct vec_elements : integral_constant<int, 1> {};
template <class T, int N>
struct vec_elements<msl_vec<T, N>> : integral_constant<int, N> {};

// numeric_limits: std's for the C++ types, MSL's values for half and bfloat.
template <class T>
struct numeric_limits : std::numeric_limits<T> {};
template <>
struct numeric_limits<half> {
  static constexpr bool is_specialized = true;
  static constexpr bool is_signed = true;
  static constexpr bool is_integer = false;
  static constexpr bool has_infinity = true;
  static constexpr bool has_quiet_NaN = true;
  static constexpr int digits = 11;
  static constexpr half min() { return half(6.103515625e-05f); }
  static constexpr half max() { return half(65504.0f); }
  static constexpr half lowest() { return half(-65504.0f); }
  static constexpr half epsilon() { return half(9.765625e-04f); }
  static constexpr half infinity() { return half(__builtin_huge_valf()); }
  static constexpr half quiet_NaN() { return half(__builtin_nanf("")); }
  static constexpr half denorm_min() { return half(5.9604644775390625e-08f); }
};
template <>
struct numeric_limits<bfloat> {
  static constexpr bool is_specialized = true;
  static constexpr bool is_signed = true;
  static constexpr bool is_integer = false;
  static constexpr bool has_infinity = true;
  static constexpr bool has_quiet_NaN = true;
  static constexpr int digits = 8;
  static constexpr bfloat min() { return bfloat::from_bits(0x0080); }
  static constexpr bfloat max() { return bfloat::from_bits(0x7F7F); }
  static constexpr bfloat lowest() { return bfloat::from_bits(0xFF7F); }
  static constexpr bfloat epsilon() { return bfloat::from_bits(0x3C00); }
  static constexpr bfloat infinity() { return bfloat::from_bits(0x7F80); }
  static constexpr bfloat quiet_NaN() { return bfloat::from_bits(0x7FC0); }
  static constexpr bfloat denorm_min() { return bfloat::from_bits(0x0001); }
};

// as_type<T>(x): reinterprets the bits of x (same size) as T.
template <class To, class From>
constexpr To as_type(const From& from) {
  static_assert(sizeof(To) == sizeof(From), "as_type needs types of the same size");
  return __builtin_bit_cast(To, from);
}
}  // namespace metal
