// What every XLA FFI binding module of jax_fatrain shares: the capsule that
// hands a handler to jax.ffi.register_ffi_target, the conversion of an error
// message into an ffi::Error, and the output-poisoning test hook.
#pragma once

#include <cstdlib>
#include <string>
#include <type_traits>

#include "nanobind/nanobind.h"
#include "xla/ffi/api/ffi.h"

namespace fatrain::ffi_glue {

// A handler symbol as the capsule jax.ffi.register_ffi_target takes.
template <typename T>
nanobind::capsule EncapsulateFfiHandler(T* fn) {
  static_assert(std::is_invocable_r_v<XLA_FFI_Error*, T, XLA_FFI_CallFrame*>,
                "Encapsulated function must be an XLA FFI handler");
  return nanobind::capsule(reinterpret_cast<void*>(fn));
}

// Success for an empty message; otherwise an error with `code` whose text
// starts with `who` (e.g. "jax_fatrain cpu"), added unless already there.
inline xla::ffi::Error Status(const char* who, const std::string& message,
                              xla::ffi::ErrorCode code = xla::ffi::ErrorCode::kInvalidArgument) {
  if (message.empty()) return xla::ffi::Error::Success();
  const std::string prefix = std::string(who) + ":";
  if (message.rfind(prefix, 0) == 0) return xla::ffi::Error(code, message);
  return xla::ffi::Error(code, prefix + " " + message);
}

// Test hook: with JAX_FATRAIN_POISON_OUTPUTS=1 every output is filled with NaN
// (0xFF bytes) before a kernel runs, so an element a kernel forgets to write
// cannot pass a test by inheriting a plausible value.
inline bool PoisonOutputsRequested() {
  static const bool poison = [] {
    const char* value = std::getenv("JAX_FATRAIN_POISON_OUTPUTS");
    return value != nullptr && value[0] == '1';
  }();
  return poison;
}

}  // namespace fatrain::ffi_glue
